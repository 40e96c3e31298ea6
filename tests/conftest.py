"""Shared fixtures: a real etcd, a connected client, per-test cluster names and a process group."""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from pdcoord.dev import etcd_server, launcher
from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.etcd_server import LocalEtcd, etcd_healthy
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.etcd import EtcdClient

ETCD_IMAGE = os.environ.get("PDCOORD_TEST_ETCD_IMAGE", "quay.io/coreos/etcd:v3.5.17")


class EtcdEndpoint(Protocol):
    @property
    def endpoint(self) -> str: ...


class ContainerEtcd:
    """etcd in a testcontainers container, exposing the same ``.endpoint`` as LocalEtcd."""

    def __init__(self, container: Any) -> None:
        self.container = container
        host = container.get_container_host_ip()
        self.host = "127.0.0.1" if host in ("localhost", "::1") else host
        self.port = int(container.get_exposed_port(2379))

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self.container.stop()


def _docker_etcd() -> ContainerEtcd | None:
    """etcd in Docker when a daemon answers; None otherwise (no daemon fails construction in ms)."""
    if os.environ.get("PDCOORD_TEST_NO_DOCKER"):
        return None
    try:
        from testcontainers.core.container import DockerContainer
    except ImportError:
        return None
    try:
        container = DockerContainer(
            ETCD_IMAGE,
            command=(
                "etcd --name test --data-dir /tmp/etcd-data "
                "--listen-client-urls http://0.0.0.0:2379 --advertise-client-urls http://0.0.0.0:2379"
            ),
        ).with_exposed_ports(2379)
    except Exception:  # docker.errors.DockerException: no daemon
        return None
    container.start()
    try:
        server = ContainerEtcd(container)
        deadline = time.monotonic() + 60
        while not etcd_healthy(server.host, server.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd container on {server.endpoint} did not become healthy")
            time.sleep(0.1)
    except BaseException:
        container.stop()
        raise
    return server


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdEndpoint]:
    """One etcd for the whole session (tests isolate themselves with ``cluster_name``)."""
    container = _docker_etcd()
    if container is not None:
        try:
            yield container
        finally:
            container.stop()
        return
    base = tmp_path_factory.mktemp("etcd-session")
    server = LocalEtcd(data_dir=str(base / "data"), log_path=base / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def local_etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    """A private local etcd for tests that stop, kill or restart it."""
    server = LocalEtcd(data_dir=str(tmp_path / "etcd-data"), log_path=tmp_path / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
        assert not server.listening(), f"etcd still listening on {server.endpoint}"


@pytest.fixture
async def etcd_client(etcd: EtcdEndpoint) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.endpoint]) as client:
        yield client


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name unique to this test, so tests sharing the session etcd never see each other."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")[:60] or "test"
    return f"{base}-{secrets.token_hex(3)}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def proc_group(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ProcessGroup]:
    """A ProcessGroup logging under tmp_path; everything is stopped at test end."""
    group = ProcessGroup(tmp_path / "logs", handle_signals=False)
    try:
        yield group
    finally:
        failed = any(
            getattr(getattr(request.node, f"rep_{when}", None), "failed", False) for when in ("setup", "call")
        )
        if failed:
            for proc in group.processes:
                print(f"\n===== {proc.name} (pid {proc._proc.pid if proc._proc else '-'}) {proc.log_path}")
                print(proc.tail(40))
        group.close()


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_behind() -> Iterator[None]:
    """Fail the session if anything a ProcessGroup or LocalEtcd started is still running at the end."""
    yield
    leftovers = launcher.live_processes()
    servers = etcd_server.live_servers()
    for proc in leftovers:
        proc.kill()
    for server in servers:
        server.kill()
    names = [repr(p) for p in leftovers] + [repr(s) for s in servers]
    assert not names, f"processes still running at the end of the session (now killed): {names}"


@pytest.fixture
def cluster(etcd, proc_group, cluster_name) -> LocalCluster:  # type: ignore[no-untyped-def]
    """A LocalCluster on the session etcd."""
    return LocalCluster(proc_group, etcd.endpoint, cluster_name)


@pytest.fixture
def local_cluster(local_etcd, proc_group, cluster_name) -> LocalCluster:  # type: ignore[no-untyped-def]
    """A LocalCluster on a function-scoped etcd the test may kill and restart."""
    return LocalCluster(proc_group, local_etcd.endpoint, cluster_name)
