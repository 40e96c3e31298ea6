"""etcd with TLS, client-certificate auth and username/password auth: the adapter, a master and an
agent against it, and clear failures with wrong credentials. Auth is enabled through the etcd gRPC
API (etcd3aio), no etcdctl."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import etcd3aio
import pytest

from pdcoord.dev.cluster import LocalCluster, http_json
from pdcoord.dev.etcd_server import EtcdServerTLS, LocalEtcd
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.etcd import EtcdAuthError, EtcdClient, EtcdTLSError, EtcdUnavailable
from pdcoord.registration import Registration
from tests.cluster.pki import PKI, make_pki

USER, PASSWORD = "pdcoord", "s3cret-pw"


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


async def _enable_auth(endpoint: str, pki: PKI) -> None:
    async with EtcdClient(
        [endpoint], ca_cert=pki.ca.cert, cert_chain=pki.client.cert, cert_key=pki.client.key
    ) as c:
        auth = c._c().auth
        assert auth is not None
        await auth.user_add("root", "root-pw")
        await auth.role_add("root")
        await auth.user_grant_role("root", "root")
        await auth.user_add(USER, PASSWORD)
        await auth.role_add("pdcoord")
        await auth.role_grant_permission(
            "pdcoord",
            "/pdcoord/",
            etcd3aio.prefix_range_end("/pdcoord/"),
            perm_type=etcd3aio.PermissionType.READWRITE,
        )
        await auth.user_grant_role(USER, "pdcoord")
        await auth.auth_enable()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[LocalEtcd]:
    base = tmp_path_factory.mktemp("secure-etcd")
    server = LocalEtcd(
        data_dir=str(base / "data"),
        log_path=base / "etcd.log",
        tls=EtcdServerTLS(pki.server.cert, pki.server.key, client_ca_file=pki.ca.cert),
    )
    server.start()
    try:
        asyncio.run(_enable_auth(server.endpoint, pki))
        yield server
    finally:
        server.stop()


def _good(pki: PKI) -> dict[str, Any]:
    return {
        "ca_cert": pki.ca.cert,
        "cert_chain": pki.client.cert,
        "cert_key": pki.client.key,
        "username": USER,
        "password": PASSWORD,
    }


async def test_adapter_with_tls_and_auth(secure_etcd: LocalEtcd, pki: PKI, cluster_name: str) -> None:
    key = f"/pdcoord/{cluster_name}/k"
    async with EtcdClient([secure_etcd.endpoint], **_good(pki)) as c:
        await c.put(key, "v")
        assert (await c.get(key)).value == b"v"  # type: ignore[union-attr]
        reg = Registration(c, key + "-reg", b"x", ttl=5)
        await reg.start()
        assert await c.lease_ttl(reg.lease_id) > 0
        await reg.stop(revoke=True)
        assert await c.get(key + "-reg") is None

    endpoint = [secure_etcd.endpoint]
    wrong_pw = {**_good(pki), "password": "wrong"}
    with pytest.raises(EtcdAuthError, match="authentication failed"):
        async with EtcdClient(endpoint, **wrong_pw):
            pass
    no_user = {k: v for k, v in _good(pki).items() if k not in ("username", "password")}
    async with EtcdClient(endpoint, **no_user) as c:
        with pytest.raises(EtcdAuthError, match="refused the credentials"):
            await c.put(key, "nope")
    # outside the role's prefix: permission denied even with valid credentials
    async with EtcdClient(endpoint, **_good(pki)) as c:
        with pytest.raises(EtcdAuthError, match="permission denied"):
            await c.put("/elsewhere/k", "nope")

    rogue_ca = {**_good(pki), "ca_cert": pki.rogue.cert}
    no_client_cert = {k: v for k, v in _good(pki).items() if k not in ("cert_chain", "cert_key")}
    for bad in (rogue_ca, no_client_cert):
        with pytest.raises(EtcdTLSError, match="TLS handshake with etcd failed"):
            async with EtcdClient(endpoint, timeout=2, **bad) as c:
                await c.put(key, "nope")
    with pytest.raises(EtcdUnavailable):
        async with EtcdClient(endpoint, timeout=2) as c:  # plaintext to a TLS port
            await c.put(key, "nope")

    async with EtcdClient(endpoint, **_good(pki)) as c:
        assert (await c.get(key)).value == b"v"  # type: ignore[union-attr]


def _etcd_flags(pki: PKI) -> dict[str, str]:
    return {
        "etcd_ca": pki.ca.cert,
        "etcd_cert": pki.client.cert,
        "etcd_key": pki.client.key,
        "etcd_user": USER,
    }


@pytest.mark.cluster
def test_master_and_agent_against_secured_etcd(
    secure_etcd: LocalEtcd, pki: PKI, proc_group: ProcessGroup, cluster_name: str, tmp_path: Path
) -> None:
    cluster = LocalCluster(proc_group, secure_etcd.endpoint, cluster_name)
    pw_file = tmp_path / "etcd-password"
    pw_file.write_text(PASSWORD + "\n")
    # the master reads the password from a file, the agent from its environment variable
    m = cluster.start_master("m1", etcd_password_file=str(pw_file), **_etcd_flags(pki))
    cluster.start_agent(
        "d1", "decode", capacity=3, env={"NODEAGENT_ETCD_PASSWORD": PASSWORD}, **_etcd_flags(pki)
    )
    cluster.wait_for(
        lambda: (
            {n["node_id"]: n["effective_share"] for n in http_json(m.url + "/admission")["nodes"]}
            == {"d1": 3}
        ),
        timeout=15,
    )


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **(env or {})},
    )
    assert "Traceback" not in r.stderr, r.stderr[-3000:]  # refusals are explained, not crashes
    return r


def _argv(flags: dict[str, str]) -> list[str]:
    return [x for k, v in flags.items() for x in ("--" + k.replace("_", "-"), v)]


@pytest.mark.cluster
def test_wrong_etcd_credentials_fail_clearly(secure_etcd: LocalEtcd, pki: PKI, cluster_name: str) -> None:
    master = ["--etcd", secure_etcd.endpoint, "--cluster", cluster_name, "--master-id", "m1",
              "--http-host", "127.0.0.1", "--http-port", "0",
              "--grpc-host", "127.0.0.1", "--grpc-port", "0"]  # fmt: skip
    agent = ["--etcd", secure_etcd.endpoint, "--cluster", cluster_name, "--node-id", "d1", "--role", "decode",
             "--endpoint", "http://127.0.0.1:9", "--running-max-req-size", "2"]  # fmt: skip
    flags = _etcd_flags(pki)

    r = _run("pdmaster", *master, *_argv(flags), "--etcd-password", "wrong")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pdmaster: error: etcd:" in r.stderr and "authentication failed" in r.stderr, r.stderr[-2000:]

    r = _run("nodeagent", *agent, *_argv(flags), env={"NODEAGENT_ETCD_PASSWORD": "wrong"})
    assert r.returncode == 2 and "etcd refused the credentials" in r.stderr, r.stderr[-2000:]

    no_auth = {k: v for k, v in flags.items() if k != "etcd_user"}
    r = _run("pdmaster", *master, *_argv(no_auth))
    assert r.returncode == 2 and "etcd refused the credentials" in r.stderr, r.stderr[-2000:]

    rogue = {**flags, "etcd_ca": pki.rogue.cert}
    r = _run("nodeagent", *agent, *_argv(rogue), "--etcd-password", PASSWORD)
    assert r.returncode == 2 and "TLS handshake with etcd failed" in r.stderr, r.stderr[-2000:]

    r = _run("pdmaster", *master, *_argv(flags))  # a user without any password
    assert r.returncode == 2 and "--etcd-user needs a password" in r.stderr, r.stderr[-2000:]
