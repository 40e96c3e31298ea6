"""What an operator installs besides the pods: the Grafana dashboard, the PrometheusRule, the
NetworkPolicies, TLS for the bundled etcd (chart and ``pdcoord etcd``), the image reference.

The chart is rendered with the real ``helm`` (as in test_helm.py); the dashboard's and the alerts'
metric names are checked against a scrape of a real master (and etcd) that served a completion.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.netutil import free_port
from pdcoord.etcd import EtcdClient, EtcdTLSError
from tests.cluster.pki import make_pki

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdcoord"
DASHBOARD = CHART / "dashboards" / "pdcoord.json"
README = CHART / "README.md"
RELEASE, NAMESPACE = "pd", "inference"
KUBE_VERSION = "1.30.0"

# Metrics the dashboard and the alerts use before any component exports them. Each entry says which
# work adds it; remove it from here when it lands, and the scrape below then requires it.
PENDING_METRICS: set[str] = set()
# Series Prometheus itself adds to every scrape target.
PROMETHEUS_SYNTHETIC = {"up"}

# Everything on, with cert-manager issuing the bundled etcd's certificates.
ALL_ON: dict[str, Any] = {
    "demo": {"enabled": True},
    "master": {"adminPort": 9090, "serviceMonitor": {"enabled": True}},
    "etcd": {
        "serviceMonitor": {"enabled": True},
        "tls": {
            "certManager": {"enabled": True, "issuerRef": {"name": "pdcoord-ca", "kind": "ClusterIssuer"}}
        },
    },
    "tls": {"grpc": {"existingSecret": "pdcoord-grpc-tls"}},
    "monitoring": {"grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True}},
    "networkPolicy": {"enabled": True},
}
CERT_MANAGER_API = "cert-manager.io/v1/Certificate"

Doc = dict[str, Any]


def _helm() -> str:
    for candidate in (ROOT / ".venv" / "bin" / "helm", Path(sys.executable).parent / "helm"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("helm")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("helm is required in CI: run scripts/get-helm.sh (installs it into .venv/bin)")
        pytest.skip("helm not found (`make test` and scripts/get-helm.sh install it into .venv/bin)")
    return found


def render(values: dict[str, Any] | None, *api_versions: str) -> list[Doc]:
    args = [
        _helm(),
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
    ]
    for api in api_versions:
        args += ["--api-versions", api]
    proc = subprocess.run(
        [*args, "--values", "-"], input=json.dumps(values or {}), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def kinds(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in kinds(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name} not in {[d['metadata']['name'] for d in kinds(docs, kind)]}"
    return found[0]


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            queries.append(target["expr"])
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            queries.append(q["query"])
    return queries


def alert_rules(docs: list[Doc]) -> list[Doc]:
    (rule,) = kinds(docs, "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


# PromQL words that look like metric names: functions, aggregations, keywords, label names.
_PROMQL_WORDS = re.compile(
    r"^(sum|max|min|count|avg|rate|irate|increase|histogram_quantile|max_over_time|by|without|on|"
    r"ignoring|or|and|unless|label_values|le|class|outcome|pod|namespace|node|role|job|status|reason)$"
)


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside {...} and [...] that are not PromQL."""
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped))
    return {w for w in words if not _PROMQL_WORDS.match(w) and not w.startswith("$")}


# Sample names Prometheus derives from a metric family of each type.
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def scraped_names(url: str) -> set[str]:
    """Every series name the target exports, including families declared (# TYPE) without a sample yet,
    such as a labelled counter nothing has incremented."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    names = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        base = family.removesuffix("_total") if kind == "counter" else family
        names |= {family, *(base + suffix for suffix in _SUFFIXES.get(kind, ()))}
    return names


# --- the dashboard and the alerts against a live master ----------------------------------------------


def test_dashboard_parses_and_covers_what_operators_look_at() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "pdcoord" and dash["panels"]
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("capacity", "share", "queue", "wait", "outcomes", "first token", "engine", "agent"):
        assert topic in titles, f"no panel about {topic}: {titles}"
    names = set().union(*(metric_names(q) for q in dashboard_queries()))
    assert "pdcoord_node_engine_up" in names  # engine health
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.cluster
def test_every_dashboard_and_alert_metric_is_exported(cluster: LocalCluster, etcd: Any) -> None:
    """Run a master with a prefill and a decode node, serve one streamed and one plain completion,
    scrape the master (and etcd for the etcd alerts): every name the dashboard or the alerts query
    must be there, except the explicitly pending ones."""
    master = cluster.start_master("m1", model="sim")
    cluster.start_node("p1", "prefill", 4, model="sim")
    cluster.start_node("d1", "decode", 4, model="sim")
    cluster.wait_for(lambda: cluster.full_capacity_held(["m1"], {"p1": 4, "d1": 4}), timeout=30)
    for stream in (False, True):
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        req = urllib.request.Request(
            master.url + "/v1/chat/completions",
            data=json.dumps({**body, "stream": stream}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
            resp.read()
    exported = scraped_names(master.url + "/metrics")
    etcd_exported = scraped_names(f"http://{etcd.endpoint}/metrics")

    dashboard = set().union(*(metric_names(q) for q in dashboard_queries()))
    missing = {n for n in dashboard - PENDING_METRICS if n not in exported}
    assert not missing, f"dashboard queries metrics the master does not export: {sorted(missing)}"

    rules = set().union(*(metric_names(r["expr"]) for r in alert_rules(render(ALL_ON, CERT_MANAGER_API))))
    known = exported | etcd_exported | PROMETHEUS_SYNTHETIC | PENDING_METRICS
    assert not rules - known, f"alerts query unknown metrics: {sorted(rules - known)}"
    # A pending name that the master now exports must leave PENDING_METRICS.
    assert not PENDING_METRICS & exported, "drop the exported names from PENDING_METRICS"


# --- chart: everything on --------------------------------------------------------------------------


def test_everything_on_validates_and_crds_are_well_formed() -> None:
    docs = render(ALL_ON, CERT_MANAGER_API)
    crds = {"ServiceMonitor", "PrometheusRule", "Certificate"}
    for doc in docs:
        if doc["kind"] in crds:
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    assert {d["kind"] for d in docs} >= crds | {"NetworkPolicy", "ConfigMap"}

    # PrometheusRule: every alert has an expression, a duration, a severity and a runbook section.
    runbook = README.read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", runbook, re.M)
    }
    rules = alert_rules(docs)
    names = {r["alert"] for r in rules}
    assert names >= {
        "PdcoordMasterNoDecodeCapacity",
        "PdcoordFleetLostDecodeCapacity",
        "PdcoordNodeEngineDown",
        "PdcoordAgentStreamDown",
        "PdcoordRequestsRefused",
        "PdcoordEtcdUnreachable",
    }
    for r in rules:
        assert r["expr"].strip() and re.fullmatch(r"[0-9]+[smh]", r["for"]), r
        assert r["labels"]["severity"] in {"warning", "critical"}, r
        assert r["annotations"]["summary"], r
        anchor = r["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert anchor == r["alert"].lower() and anchor in anchors, f"no runbook section {anchor!r} in README"

    # ServiceMonitors scrape a named port of the Service they select.
    services = kinds(docs, "Service")
    for sm in kinds(docs, "ServiceMonitor"):
        sel = sm["spec"]["selector"]["matchLabels"]
        ports = {
            p["name"]
            for s in services
            if sel.items() <= s["metadata"]["labels"].items()
            for p in s["spec"]["ports"]
        }
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in ports, (sm["metadata"]["name"], ep["port"], ports)

    # The dashboard ConfigMap carries the sidecar label and exactly the dashboard file.
    cm = one(docs, "ConfigMap", f"{RELEASE}-pdcoord-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pdcoord.json"]) == json.loads(DASHBOARD.read_text())


def test_operations_objects_are_off_by_default() -> None:
    docs = render(None)
    present = {d["kind"] for d in docs}
    assert not present & {"PrometheusRule", "NetworkPolicy", "Certificate", "ConfigMap", "ServiceMonitor"}


def _pod(docs: list[Doc], kind: str, name: str) -> Doc:
    return dict(one(docs, kind, name)["spec"]["template"])


def test_network_policies_select_the_pods_and_ports_they_protect() -> None:
    docs = render(ALL_ON, CERT_MANAGER_API)
    for component, kind in (("master", "Deployment"), ("etcd", "StatefulSet")):
        policy = one(docs, "NetworkPolicy", f"{RELEASE}-pdcoord-{component}")
        pod = _pod(docs, kind, f"{RELEASE}-pdcoord-{component}")
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert port["port"] in port_names, (component, port["port"], port_names)
    master = one(docs, "NetworkPolicy", f"{RELEASE}-pdcoord-master")["spec"]["ingress"]
    by_port = {r["ports"][0]["port"]: r for r in master}
    assert "from" not in by_port["http"]  # clients: any source unless networkPolicy.clients is set
    assert by_port["grpc"]["from"] == [{"podSelector": {}}]  # agents: the release namespace by default
    etcd_client = one(docs, "NetworkPolicy", f"{RELEASE}-pdcoord-etcd")["spec"]["ingress"][0]
    master_labels = _pod(docs, "Deployment", f"{RELEASE}-pdcoord-master")["metadata"]["labels"]
    assert any(
        p.get("podSelector", {}).get("matchLabels", {"x": "y"}).items() <= master_labels.items()
        for p in etcd_client["from"]
        if p.get("podSelector", {}).get("matchLabels")
    )
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
    restricted = render({**ALL_ON, "networkPolicy": {"enabled": True, "clients": clients}}, CERT_MANAGER_API)
    http = next(r for r in one(restricted, "NetworkPolicy", f"{RELEASE}-pdcoord-master")["spec"]["ingress"])
    assert http["from"] == clients
    # masters that spill refused requests to each other reach each other's API port too
    spilling = render(
        {
            **ALL_ON,
            "networkPolicy": {"enabled": True, "clients": clients},
            "master": {**ALL_ON["master"], "spillPeers": 2},
        },
        CERT_MANAGER_API,
    )
    http = next(r for r in one(spilling, "NetworkPolicy", f"{RELEASE}-pdcoord-master")["spec"]["ingress"])
    assert http["from"][:-1] == clients
    peers = http["from"][-1]["podSelector"]["matchLabels"]
    assert (
        peers.items()
        <= _pod(spilling, "Deployment", f"{RELEASE}-pdcoord-master")["metadata"]["labels"].items()
    )
    assert (
        "--spill-peers=2"
        in _pod(spilling, "Deployment", f"{RELEASE}-pdcoord-master")["spec"]["containers"][0]["args"]
    )


def test_engine_priority_reaches_the_masters_only_when_set() -> None:
    def args(docs: list[Doc]) -> list[str]:
        return list(_pod(docs, "Deployment", f"{RELEASE}-pdcoord-master")["spec"]["containers"][0]["args"])

    assert not [a for a in args(render(None)) if a.startswith("--engine-priority")]
    for order in ("high-first", "low-first"):
        assert f"--engine-priority={order}" in args(render({"master": {"enginePriority": order}}))


def test_ttft_slo_reaches_the_masters_and_leaves_the_rest_to_derive() -> None:
    def args(docs: list[Doc]) -> list[str]:
        return list(_pod(docs, "Deployment", f"{RELEASE}-pdcoord-master")["spec"]["containers"][0]["args"])

    assert not [a for a in args(render(None)) if a.startswith(("--ttft-slo", "--spill-peers"))]
    derived = args(render({"master": {"ttftSlo": 2}}))
    assert "--ttft-slo=2" in derived
    # the master derives targets, priority and spilling itself: nothing else is passed for them
    assert not [
        a for a in derived if a.startswith(("--spill-peers", "--engine-priority", "--admission-target"))
    ]
    # explicit values win, an explicit 0 and off included
    explicit = args(render({"master": {"ttftSlo": 1.5, "spillPeers": 0, "enginePriority": "off"}}))
    assert {"--ttft-slo=1.5", "--spill-peers=0", "--engine-priority=off"} <= set(explicit)


# --- chart: TLS to the bundled etcd --------------------------------------------------------------


def _args(c: Doc) -> dict[str, str]:
    return dict(a[2:].partition("=")[::2] for a in c.get("args", []))


@pytest.mark.parametrize("source", ["existingSecret", "certManager"])
def test_bundled_etcd_serves_tls_and_every_client_uses_it(source: str) -> None:
    if source == "existingSecret":
        tls: dict[str, Any] = {"existingSecret": "etcd-server", "clientSecret": "etcd-client"}
        server_secret, client_secret = "etcd-server", "etcd-client"
        docs = render({"demo": {"enabled": True}, "etcd": {"tls": tls}})
        assert not kinds(docs, "Certificate")
    else:
        docs = render(ALL_ON, CERT_MANAGER_API)
        server_secret, client_secret = (
            f"{RELEASE}-pdcoord-etcd-server-tls",
            f"{RELEASE}-pdcoord-etcd-client-tls",
        )
        certs = {c["spec"]["secretName"]: c["spec"] for c in kinds(docs, "Certificate")}
        assert set(certs) == {server_secret, client_secret}
        assert {"server auth", "client auth"} <= set(certs[server_secret]["usages"])
        assert "client auth" in certs[client_secret]["usages"]
        for spec in certs.values():
            assert spec["issuerRef"] == {
                "name": "pdcoord-ca",
                "kind": "ClusterIssuer",
                "group": "cert-manager.io",
            }

    sts = _pod(docs, "StatefulSet", f"{RELEASE}-pdcoord-etcd")
    etcd = sts["spec"]["containers"][0]
    args = _args(etcd)
    for flag in (
        "listen-client-urls",
        "advertise-client-urls",
        "listen-peer-urls",
        "initial-advertise-peer-urls",
    ):
        assert args[flag].startswith("https://"), (flag, args[flag])
    assert all(m.split("=", 1)[1].startswith("https://") for m in args["initial-cluster"].split(","))
    assert args["listen-metrics-urls"].startswith("http://")  # probes stay plain HTTP
    assert args["client-cert-auth"] == "true" and args["peer-client-cert-auth"] == "true"
    mount = next(m for m in etcd["volumeMounts"] if m["name"] == "tls")["mountPath"]
    for flag in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file"):
        assert args[flag].startswith(mount + "/"), flag
    volume = next(v for v in sts["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == server_secret

    # Every master and nodeagent container dials etcd with the client Secret's CA and certificate.
    # With a certificate, a server name matching the member DNS names the certificates carry.
    clients = 0
    for d in kinds(docs, "Deployment"):
        pod = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            if c.get("command") not in (["pdmaster"], ["nodeagent"]):
                continue
            clients += 1
            a = _args(c)
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            assert a["etcd-ca"] == mounts["pdcoord-etcd-tls"] + "/ca.crt"
            assert a["etcd-cert"] == mounts["pdcoord-etcd-tls"] + "/tls.crt"
            assert volumes["pdcoord-etcd-tls"]["secret"]["secretName"] == client_secret
            for endpoint in a["etcd"].split(","):
                assert endpoint.endswith(
                    f".{RELEASE}-pdcoord-etcd-headless.{NAMESPACE}.svc.cluster.local:2379"
                )
    assert clients >= 3


def test_etcd_server_certificate_names_cover_the_endpoints() -> None:
    docs = render(ALL_ON, CERT_MANAGER_API)
    cert = one(docs, "Certificate", f"{RELEASE}-pdcoord-etcd-server")
    master = next(
        c
        for c in _pod(docs, "Deployment", f"{RELEASE}-pdcoord-master")["spec"]["containers"]
        if c["name"] == "pdmaster"
    )
    for endpoint in _args(master)["etcd"].split(","):
        host = endpoint.rsplit(":", 1)[0]
        parent = host.split(".", 1)[1]
        assert f"*.{parent}" in cert["spec"]["dnsNames"], (host, cert["spec"]["dnsNames"])


def test_cert_manager_needs_an_issuer() -> None:
    values = {"etcd": {"tls": {"certManager": {"enabled": True}}}}
    proc = subprocess.run(
        [_helm(), "template", RELEASE, str(CHART), "--api-versions", CERT_MANAGER_API, "--values", "-"],
        input=json.dumps(values),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "issuerRef.name" in proc.stderr, proc.stderr


# --- pdcoord etcd --cert-file ... -------------------------------------------------------------------


def test_pdcoord_etcd_serves_tls(tmp_path: Path, proc_group: ProcessGroup) -> None:
    pki = make_pki(tmp_path / "pki")
    port, metrics = free_port(), free_port()
    pdcoord = str(Path(sys.executable).parent / "pdcoord")
    argv = [pdcoord, "etcd", "--port", str(port), "--peer-port", str(free_port())]
    argv += ["--data-dir", str(tmp_path / "data"), "--metrics-port", str(metrics)]
    argv += ["--cert-file", pki.server.cert, "--key-file", pki.server.key, "--trusted-ca-file", pki.ca.cert]
    proc_group.start(
        "pdcoord-etcd-tls",
        argv,
        ready=f"http://127.0.0.1:{metrics}/health",
        ready_timeout=30,
    )
    endpoint = f"127.0.0.1:{port}"

    async def exercise() -> None:
        good = {"ca_cert": pki.ca.cert, "cert_chain": pki.client.cert, "cert_key": pki.client.key}
        async with EtcdClient([endpoint], **good) as c:  # type: ignore[arg-type]
            await c.put("/pdcoord/tls-cli/k", "v")
            kv = await c.get("/pdcoord/tls-cli/k")
            assert kv is not None and kv.value == b"v"
        # --trusted-ca-file means client certificates are required.
        with pytest.raises(EtcdTLSError):
            async with EtcdClient([endpoint], timeout=2, ca_cert=pki.ca.cert) as c:
                await c.put("/pdcoord/tls-cli/k", "nope")

    asyncio.run(exercise())
    log = proc_group["pdcoord-etcd-tls"].tail(200)
    assert f"serving on https://127.0.0.1:{port}" in log


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cert-file", "c.pem"], "--cert-file and --key-file go together"),
        (["--trusted-ca-file", "ca.pem"], "--trusted-ca-file needs --cert-file"),
    ],
)
def test_pdcoord_etcd_refuses_half_tls(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdcoord.dev.cli", "etcd", "--data-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
