"""What a master advertises in etcd for a listener on a wildcard address (pdmaster.server.advertised_host)."""

from __future__ import annotations

import socket

import pytest

from pdmaster.server import StartupError, advertised_host, default_route_address, host_port, is_wildcard


class Lookups:
    """Injected route and host-name lookups that record what was asked."""

    def __init__(self, routes: dict[int, str | None] | None = None, hostname: str | None = None) -> None:
        self.routes = routes or {}
        self.hostname = hostname
        self.calls: list[object] = []

    def route(self, family: int) -> str | None:
        self.calls.append(family)
        return self.routes.get(family)

    def name(self) -> str | None:
        self.calls.append("hostname")
        return self.hostname


def resolve(
    bind: str,
    advertise: str | None = None,
    *,
    routes: dict[int, str | None] | None = None,
    hostname: str | None = None,
) -> tuple[str, list[object]]:
    lk = Lookups(routes, hostname)
    host = advertised_host(bind, advertise, "--grpc-host", route_address=lk.route, hostname_address=lk.name)
    return host, lk.calls


def test_advertise_host_wins_and_nothing_is_looked_up() -> None:
    assert resolve("0.0.0.0", "10.1.2.3") == ("10.1.2.3", [])
    assert resolve("127.0.0.1", "master-0.example") == ("master-0.example", [])


def test_a_specific_bind_address_is_advertised_as_it_is() -> None:
    assert resolve("127.0.0.1") == ("127.0.0.1", [])
    assert resolve("10.0.0.7") == ("10.0.0.7", [])
    assert resolve("::1") == ("::1", [])


def test_a_wildcard_advertises_the_default_route_interface_first() -> None:
    host, calls = resolve("0.0.0.0", routes={socket.AF_INET: "192.0.2.2"}, hostname="10.9.9.9")
    assert host == "192.0.2.2"
    assert calls == [socket.AF_INET]  # the host name is not asked when the route answers


def test_without_a_default_route_the_host_name_is_used() -> None:
    assert resolve("0.0.0.0", hostname="10.9.9.9")[0] == "10.9.9.9"


def test_loopback_and_link_local_answers_do_not_count() -> None:
    # Debian maps the host name to 127.0.1.1; a route lookup may end on a link-local address.
    host, _ = resolve("0.0.0.0", routes={socket.AF_INET: "169.254.1.1"}, hostname="10.9.9.9")
    assert host == "10.9.9.9"
    with pytest.raises(StartupError) as err:
        resolve("0.0.0.0", routes={socket.AF_INET: "127.0.0.1"}, hostname="127.0.1.1")
    msg = str(err.value)
    assert "--advertise-host" in msg and "--grpc-host 0.0.0.0" in msg
    assert "127.0.1.1" in msg  # says what it found


def test_nothing_found_refuses_naming_the_flag() -> None:
    with pytest.raises(StartupError, match="--advertise-host"):
        resolve("0.0.0.0")


def test_ipv6_wildcard_tries_ipv6_then_ipv4() -> None:
    host, calls = resolve("::", routes={socket.AF_INET: "192.0.2.2"})
    assert host == "192.0.2.2"
    assert calls[:2] == [socket.AF_INET6, socket.AF_INET]
    assert resolve("::", routes={socket.AF_INET6: "2001:db8::5"})[0] == "2001:db8::5"
    # a link-local IPv6 answer (with its zone) is not reachable from elsewhere
    assert resolve("::", routes={socket.AF_INET6: "fe80::1%eth0"}, hostname="10.0.0.1")[0] == "10.0.0.1"


def test_wildcards_and_host_port() -> None:
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "", "[::]", " 0.0.0.0 "))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "localhost", "10.0.0.1", "::1"))
    assert host_port("10.0.0.1", 50051) == "10.0.0.1:50051"
    assert host_port("2001:db8::5", 50051) == "[2001:db8::5]:50051"
    assert host_port("[2001:db8::5]", 8000) == "[2001:db8::5]:8000"


def test_the_real_route_lookup_answers_an_address_or_none() -> None:
    # Whatever this machine's network: an address string or None, never an exception.
    for family in (socket.AF_INET, socket.AF_INET6):
        address = default_route_address(family)
        assert address is None or isinstance(address, str)
