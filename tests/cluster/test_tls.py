"""gRPC TLS and mutual TLS between agents and masters: real processes, certificates made by openssl."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pdcoord.dev.cluster import LocalCluster, http_json
from pdcoord.tls import ClientTLS, ServerTLS, TLSConfigError
from pdcoord.v1 import coordination_pb2 as pb
from pdcoord.v1 import coordination_pb2_grpc as pb_grpc
from tests.cluster.pki import PKI, make_pki

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _mtls_master(cluster: LocalCluster, pki: PKI, master_id: str = "m1") -> str:
    m = cluster.start_master(
        master_id,
        grpc_tls_cert=pki.server.cert,
        grpc_tls_key=pki.server.key,
        grpc_tls_client_ca=pki.ca.cert,
    )
    return f"127.0.0.1:{m.grpc_port}"


def _register_over(channel: grpc.Channel, node: str) -> grpc.RpcError | None:
    """Open Connect, send a Register; None when the master acknowledged it."""
    reg = pb.Register(node_id=node, role=pb.DECODE, endpoint="http://127.0.0.1:9", running_max_req_size=2)
    stub = pb_grpc.NodeCoordinationStub(channel)
    try:
        for _ in stub.Connect(iter([pb.AgentMessage(register=reg)]), timeout=5):
            pass
    except grpc.RpcError as exc:
        return exc
    return None


def _nodes(cluster: LocalCluster, master_id: str = "m1") -> dict[str, dict[str, object]]:
    return {n["node_id"]: n for n in http_json(cluster.masters[master_id].url + "/admission")["nodes"]}


def _creds(pki: PKI, client: tuple[str, str] | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=Path(pki.ca.cert).read_bytes(),
        private_key=Path(client[1]).read_bytes() if client else None,
        certificate_chain=Path(client[0]).read_bytes() if client else None,
    )


def test_mtls_master_accepts_signed_agent_and_refuses_everyone_else(cluster: LocalCluster, pki: PKI) -> None:
    addr = _mtls_master(cluster, pki)
    cluster.start_agent(
        "good",
        "decode",
        capacity=4,
        grpc_tls_ca=pki.ca.cert,
        grpc_tls_cert=pki.client.cert,
        grpc_tls_key=pki.client.key,
    )
    cluster.wait_for(lambda: _nodes(cluster).get("good", {}).get("effective_share") == 4, timeout=15)

    # a client certificate from another CA, no client certificate, and plaintext: all refused
    rogue = grpc.secure_channel(addr, _creds(pki, (pki.rogue_client.cert, pki.rogue_client.key)))
    anonymous = grpc.secure_channel(addr, _creds(pki, None))
    plaintext = grpc.insecure_channel(addr)
    for name, channel in (("rogue", rogue), ("anonymous", anonymous), ("plaintext", plaintext)):
        with channel:
            err = _register_over(channel, f"intruder-{name}")
        assert err is not None, f"{name} client was accepted"
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (name, err)

    # the control: the same code path with the trusted client certificate is accepted
    with grpc.secure_channel(addr, _creds(pki, (pki.client.cert, pki.client.key))) as ok:
        assert _register_over(ok, "trusted-probe") is None

    # an agent process holding a rogue certificate never gets in either
    agent = cluster.start_agent(
        "rogue-agent",
        "decode",
        capacity=4,
        grpc_tls_ca=pki.ca.cert,
        grpc_tls_cert=pki.rogue_client.cert,
        grpc_tls_key=pki.rogue_client.key,
    )
    time.sleep(3)
    nodes = _nodes(cluster)
    assert "rogue-agent" not in nodes and not any(n.startswith("intruder") for n in nodes)
    assert nodes["good"]["effective_share"] == 4 and nodes["good"]["connected"]
    assert agent.proc.alive  # it keeps retrying (the certificate may be fixed), it does not crash


def test_agent_refuses_master_whose_certificate_does_not_match(cluster: LocalCluster, pki: PKI) -> None:
    # The master's certificate names only elsewhere.example; agents dial 127.0.0.1.
    cluster.start_master("m1", grpc_tls_cert=pki.wrong_host.cert, grpc_tls_key=pki.wrong_host.key)
    strict = cluster.start_agent("strict", "decode", capacity=2, grpc_tls_ca=pki.ca.cert)
    # told which name to expect, an agent accepts the same master (the certificate itself is fine)
    cluster.start_agent(
        "named", "decode", capacity=2, grpc_tls_ca=pki.ca.cert, grpc_tls_server_name="elsewhere.example"
    )
    cluster.wait_for(lambda: _nodes(cluster).get("named", {}).get("effective_share") == 2, timeout=15)
    time.sleep(2)
    assert "strict" not in _nodes(cluster)
    log = strict.proc.tail(200)
    assert "TLS" in log and "--grpc-tls" in log, log[-2000:]

    # a master signed by a CA the agent does not trust is refused the same way
    cluster.start_master("m2", grpc_tls_cert=pki.rogue_client.cert, grpc_tls_key=pki.rogue_client.key)
    time.sleep(3)
    assert not _nodes(cluster, "m2"), "an agent connected to a master signed by an untrusted CA"


def test_plain_tls_without_client_certificates(cluster: LocalCluster, pki: PKI) -> None:
    m = cluster.start_master("m1", grpc_tls_cert=pki.server.cert, grpc_tls_key=pki.server.key)
    cluster.start_agent("d1", "decode", capacity=3, grpc_tls_ca=pki.ca.cert)
    cluster.wait_for(lambda: _nodes(cluster).get("d1", {}).get("effective_share") == 3, timeout=15)
    # a plaintext client cannot talk to a TLS port
    with grpc.insecure_channel(f"127.0.0.1:{m.grpc_port}") as plain:
        err = _register_over(plain, "plain")
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert "plain" not in _nodes(cluster)


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60)


def test_bad_tls_files_stop_the_processes_with_the_flag_named(pki: PKI, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    not_pem = tmp_path / "junk.pem"
    not_pem.write_text("hello")
    base = ["--etcd", "127.0.0.1:1", "--master-id", "m", "--grpc-port", "0", "--http-port", "0"]
    cases = [
        (["--grpc-tls-cert", missing, "--grpc-tls-key", pki.server.key], "--grpc-tls-cert"),
        (["--grpc-tls-cert", pki.server.cert, "--grpc-tls-key", pki.client.key], "matching key"),
        (
            ["--grpc-tls-cert", pki.server.cert, "--grpc-tls-key", pki.server.key]
            + ["--grpc-tls-client-ca", str(not_pem)],
            "--grpc-tls-client-ca",
        ),
        (["--grpc-tls-client-ca", pki.ca.cert], "needs --grpc-tls-cert"),
    ]
    for flags, expected in cases:
        r = _run("pdmaster", *base, *flags)
        assert r.returncode == 2, (flags, r.stderr[-1500:])
        assert "pdmaster: error:" in r.stderr and expected in r.stderr, (flags, r.stderr[-1500:])
        assert "Traceback" not in r.stderr

    agent = ["--etcd", "127.0.0.1:1", "--node-id", "n", "--role", "decode", "--endpoint", "http://x:1",
             "--running-max-req-size", "1"]  # fmt: skip
    r = _run("nodeagent", *agent, "--grpc-tls-cert", pki.client.cert)
    assert r.returncode == 2 and "--grpc-tls-cert and --grpc-tls-key must be given together" in r.stderr
    r = _run("nodeagent", *agent, "--grpc-tls-ca", missing)
    assert r.returncode == 2 and "--grpc-tls-ca" in r.stderr and "cannot read" in r.stderr


def test_credential_objects(pki: PKI) -> None:
    server = ServerTLS.load(pki.server.cert, pki.server.key, pki.ca.cert)
    assert server.mutual and b"BEGIN CERTIFICATE" in server.cert
    assert not ServerTLS.load(pki.server.cert, pki.server.key).mutual
    client = ClientTLS.load(pki.ca.cert, server_name="master.pdcoord.test")
    assert client.options() == [("grpc.ssl_target_name_override", "master.pdcoord.test")]
    with pytest.raises(TLSConfigError, match="not a usable certificate"):
        ServerTLS.load(pki.server.cert, pki.rogue_client.key)


def test_agent_tls_flags_from_environment(pki: PKI, monkeypatch: pytest.MonkeyPatch) -> None:
    from nodeagent.main import build_parser
    from pdcoord.tls import client_tls_from_args

    base = ["--node-id", "n", "--role", "decode", "--endpoint", "http://x:1"]
    assert client_tls_from_args(build_parser().parse_args(base)) is None
    system_roots = client_tls_from_args(build_parser().parse_args([*base, "--grpc-tls"]))
    assert system_roots is not None and system_roots.ca is None and system_roots.cert is None
    monkeypatch.setenv("NODEAGENT_GRPC_TLS_CA", pki.ca.cert)
    monkeypatch.setenv("NODEAGENT_GRPC_TLS_CERT", pki.client.cert)
    monkeypatch.setenv("NODEAGENT_GRPC_TLS_KEY", pki.client.key)
    monkeypatch.setenv("NODEAGENT_GRPC_TLS_SERVER_NAME", "master.pdcoord.test")
    tls = client_tls_from_args(build_parser().parse_args(base))
    assert tls is not None and tls.ca == Path(pki.ca.cert).read_bytes() and tls.cert is not None
    assert tls.options() == [("grpc.ssl_target_name_override", "master.pdcoord.test")]
