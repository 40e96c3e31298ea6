"""The chart's Grafana dashboard and alerts against a real Prometheus scraping a local cluster under load.

A Prometheus (Debian's ``prometheus`` package; .ci/run installs it) on 127.0.0.1, a free port and a
temporary data directory scrapes two masters and etcd every second, with the labels the chart's
ServiceMonitors give them (``namespace``, ``pod``, ``job``), and evaluates the PrometheusRule that
``helm template`` renders. While client load runs, every query of helm/pdcoord/dashboards/pdcoord.json
(template variables substituted as Grafana would) must return at least one series with a number;
every alert rule must evaluate without error and stay quiet on the healthy cluster; a killed decode
engine must then turn PdcoordNodeEngineDown pending for that node. Prometheus is killed by its PID at
the end, and its port must be closed.

In CI (``$CI`` set) a missing prometheus is a failure; elsewhere the test skips with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.launcher import ManagedProcess, ProcessGroup
from pdcoord.dev.netutil import free_port
from pdcoord.v1 import coordination_pb2 as pb
from tests.cluster.cluster_helpers import cluster_load, summarize
from tests.helm.test_prometheus_rules import NAMESPACE, RELEASE, RULES_FILE, alert_names, rule_groups

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "pdcoord" / "dashboards" / "pdcoord.json"
MASTERS = ("m1", "m2")
PREFILL = {"p1": 8}
DECODE = {"d1": 4, "d2": 4}
# Grafana's $__rate_interval is max(4 x scrape interval, step); with a 1 s scrape a dashboard at its
# default resolution asks for tens of seconds.
RATE_INTERVAL = "30s"
MASTER_JOB, ETCD_JOB = f"{RELEASE}-pdcoord-master", f"{RELEASE}-pdcoord-etcd"


def _prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        how = "apt-get install prometheus (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"prometheus is required in CI: {how}")
        pytest.skip(f"prometheus not found: {how}")
    return found


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title and legend, expression) of every query of the dashboard, rows included."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for t in panel.get("targets", []):
                found.append((f"{panel.get('title')} [{t.get('legendFormat', t.get('refId'))}]", t["expr"]))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return found


def substitute(expr: str) -> str:
    """The dashboard's variables as Grafana fills them in for this cluster's namespace."""
    out = expr.replace("$__rate_interval", RATE_INTERVAL).replace("${namespace}", NAMESPACE)
    out = out.replace("$namespace", NAMESPACE)
    assert "$" not in out, f"a dashboard variable this test does not know: {expr}"
    return out


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def numbers(self, expr: str) -> list[float]:
        return [float(s["value"][1]) for s in self.query(expr) if not math.isnan(float(s["value"][1]))]

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.get("/api/v1/alerts")["alerts"]
        return alerts


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_prometheus(
    group: ProcessGroup, base: Path, c: LocalCluster, etcd_endpoint: str
) -> tuple[ManagedProcess, int]:
    binary = _prometheus()
    (base / RULES_FILE).write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    masters = [
        {
            "targets": [f"127.0.0.1:{c.masters[m].http_port}"],
            "labels": {"namespace": NAMESPACE, "pod": f"{MASTER_JOB}-{m}"},
        }
        for m in MASTERS
    ]
    etcd = [{"targets": [etcd_endpoint], "labels": {"namespace": NAMESPACE, "pod": f"{ETCD_JOB}-0"}}]
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(base / RULES_FILE)],
        "scrape_configs": [
            {"job_name": MASTER_JOB, "static_configs": masters},
            {"job_name": ETCD_JOB, "static_configs": etcd},
        ],
    }
    (base / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    argv = [
        binary,
        f"--config.file={base / 'prometheus.yml'}",
        f"--storage.tsdb.path={base / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
    ]
    proc = group.start("prometheus", argv, ready=f"http://127.0.0.1:{port}/-/ready", cwd=base)
    return proc, port


def refused_stream(c: LocalCluster, master: str) -> None:
    """An agent stream that opens with a Report: refused, so the rejections panel has a series."""
    with grpc.insecure_channel(f"127.0.0.1:{c.masters[master].grpc_port}") as channel:
        call = channel.stream_stream(
            "/pdcoord.v1.NodeCoordination/Connect",
            request_serializer=pb.AgentMessage.SerializeToString,
            response_deserializer=pb.MasterMessage.FromString,
        )
        msg = pb.AgentMessage(report=pb.Report(seq=1))
        with pytest.raises(grpc.RpcError) as err:
            for _ in call(iter([msg]), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value


def wait_until(what: str, predicate: Any, timeout: float, interval: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(interval)


def test_every_dashboard_query_returns_data_and_alerts_evaluate(
    cluster: LocalCluster, etcd: Any, proc_group: ProcessGroup, tmp_path: Path
) -> None:
    c = cluster
    for m in MASTERS:
        c.start_master(m, model="sim")
    for name, cap in PREFILL.items():
        c.start_node(name, "prefill", cap, model="sim")
    for name, cap in DECODE.items():
        c.start_node(name, "decode", cap, model="sim")
    c.wait_for(lambda: c.full_capacity_held(list(MASTERS), {**PREFILL, **DECODE}), timeout=30)

    prom_proc, port = start_prometheus(proc_group, tmp_path, c, etcd.endpoint)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    load = cluster_load(lambda: [(m, c.masters[m].url) for m in MASTERS], users=6, request_timeout_s=30)
    load.start()
    try:
        refused_stream(c, "m1")
        load.wait_for_results(20, timeout=60)

        # every scrape target up, with the labels the ServiceMonitors give
        def targets_up() -> bool:
            return sorted(prom.numbers(f'up{{namespace="{NAMESPACE}"}} == 1')) == [1.0] * (len(MASTERS) + 1)

        wait_until("both masters and etcd scraped", targets_up, timeout=30)
        values = prom.get("/api/v1/label/namespace/values", **{"match[]": "pdcoord_master_info"})
        assert values == [NAMESPACE], values  # the dashboard's namespace variable

        # every query of the dashboard returns a number (retried while rates fill their window)
        targets = dashboard_targets()
        assert len(targets) >= 20, targets
        empty = {title: substitute(expr) for title, expr in targets}
        deadline = time.monotonic() + 90
        while empty and time.monotonic() < deadline:
            empty = {title: expr for title, expr in empty.items() if not prom.numbers(expr)}
            if empty:
                time.sleep(2)
        assert not empty, "dashboard queries without data:\n" + "\n".join(
            f"  {t}: {e}" for t, e in empty.items()
        )
        assert prom.numbers(substitute('count(pdcoord_master_info{namespace=~"$namespace"})')) == [
            len(MASTERS)
        ]
        # The masters' shares sum to the fleet's slots; under load the agents move slots between them
        # (demand), and the two masters are scraped at different instants, so one query may count a
        # slot that just moved twice or not at all: polled until a query sees the two agree.
        caps_expr = substitute('sum(pdcoord_decode_capacity_slots{namespace=~"$namespace"})')
        wait_until(
            "the masters' decode shares summing to the fleet's slots",
            lambda: prom.numbers(caps_expr) == [float(sum(DECODE.values()))],
            timeout=60,
        )

        # every alert rule evaluates without error on real series, and none is active on a healthy cluster
        groups = prom.get("/api/v1/rules")["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        assert sorted(rules) == sorted(alert_names(rule_groups())), sorted(rules)
        bad = {n: r.get("lastError") for n, r in rules.items() if r["health"] != "ok"}
        assert not bad, bad
        assert prom.alerts() == [], prom.alerts()

        fleet = f'max(pdcoord_fleet_decode_capacity_slots{{namespace="{NAMESPACE}"}})'
        wait_until(
            "the fleet's decode capacity seen whole",
            lambda: prom.numbers(fleet) == [float(sum(DECODE.values()))],
            30,
        )

        # A decode engine dies under load: the engine-down alert goes pending for that node and no
        # other. Half the decode slots gone under load may also (rightly) make the masters refuse
        # requests; the fleet-capacity alert stays quiet (4 of 8 is not below half).
        c.engines["d2"].proc.kill()
        seen: list[Any] = []
        consequences = {"PdcoordRequestsRefused"}

        def engine_down_pending() -> bool:
            seen[:] = sorted(
                (a["labels"]["alertname"], a["labels"].get("node"), a["state"]) for a in prom.alerts()
            )
            by_node = [a for a in seen if a[1] is not None]
            others = {a[0] for a in seen if a[1] is None}
            return by_node == [("PdcoordNodeEngineDown", "d2", "pending")] and others <= consequences

        try:
            wait_until("PdcoordNodeEngineDown pending for d2 alone", engine_down_pending, 60)
        except AssertionError as exc:
            up = [
                (r["metric"].get("pod"), r["value"][1])
                for r in prom.query('pdcoord_node_engine_up{node="d2"}')
            ]
            raise AssertionError(f"{exc}; last alerts {seen}; pdcoord_node_engine_up for d2: {up}") from None
        wait_until(
            "the fleet's decode capacity seen as 4 slots",
            lambda: prom.numbers(fleet) == [float(DECODE["d1"])],
            30,
        )
    finally:
        outcomes = load.stop()
        pid = prom_proc.pid
        prom_proc.kill()
        assert not listening(port), f"prometheus (pid {pid}) still listening on {port}"
    assert any(o.ok for o in outcomes), summarize(outcomes)


def test_dashboard_substitution_leaves_no_variable() -> None:
    for title, expr in dashboard_targets():
        out = substitute(expr)
        assert not re.search(r"\$\w", out), (title, out)
