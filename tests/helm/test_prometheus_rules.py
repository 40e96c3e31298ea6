"""The chart's PrometheusRule as Prometheus reads it: ``promtool check rules`` on the rule groups that
``helm template`` renders, and ``promtool test rules`` with one unit test per alert
(tests/helm/promtool/*.test.yaml): each alert fires on the series that should fire it, after its
``for:``, with its labels and annotations, and not on the healthy series beside them.

promtool comes with Debian's ``prometheus`` package (.ci/run installs it). In CI (``$CI`` set) a
missing helm or promtool is a failure; elsewhere these tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdcoord"
UNIT_TESTS = Path(__file__).resolve().parent / "promtool"
# The unit tests' series carry this namespace and the default etcd job <release>-pdcoord-etcd.
RELEASE, NAMESPACE = "pd", "inference"
RULES_FILE = "pdcoord-rules.yaml"  # the name the unit tests' rule_files refer to


def _required(tool: str, found: str | None, how: str) -> str:
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is required in CI: {how}")
        pytest.skip(f"{tool} not found: {how}")
    return found


def _helm() -> str:
    for candidate in (ROOT / ".venv" / "bin" / "helm", Path(sys.executable).parent / "helm"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return _required("helm", shutil.which("helm"), "scripts/get-helm.sh installs it into .venv/bin")


def _promtool() -> str:
    return _required("promtool", shutil.which("promtool"), "apt-get install prometheus (.ci/run installs it)")


def rule_groups(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The PrometheusRule's ``spec.groups`` as rendered by ``helm template`` with *values*."""
    values = {"monitoring": {"prometheusRule": {"enabled": True}}, **(values or {})}
    proc = subprocess.run(
        [_helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values", "-"],
        input=json.dumps(values),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (rule,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def write_rules(directory: Path, groups: list[dict[str, Any]]) -> Path:
    path = directory / RULES_FILE
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def alert_names(groups: list[dict[str, Any]]) -> list[str]:
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r]


UNIT_TEST_FILES = sorted(UNIT_TESTS.glob("*.test.yaml"))


def alerts_tested_in(path: Path) -> set[str]:
    doc = yaml.safe_load(path.read_text())
    return {t["alertname"] for test in doc["tests"] for t in test.get("alert_rule_test", [])}


@pytest.mark.parametrize(
    "values",
    [
        None,
        # every knob of the rules away from its default, and a custom etcd job name
        {
            "monitoring": {
                "prometheusRule": {
                    "enabled": True,
                    "refusedRatio": 0.2,
                    "capacityDropRatio": 0.75,
                    "etcdJob": "etcd-main",
                    "labels": {"release": "kube-prometheus-stack"},
                }
            }
        },
    ],
    ids=["defaults", "custom"],
)
def test_rendered_rules_pass_promtool_check(values: dict[str, Any] | None, tmp_path: Path) -> None:
    groups = rule_groups(values)
    path = write_rules(tmp_path, groups)
    proc = promtool("check", "rules", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = len(alert_names(groups))
    assert re.search(rf"SUCCESS: {n} rules found", proc.stdout), proc.stdout


def test_every_alert_has_a_unit_test() -> None:
    alerts = set(alert_names(rule_groups()))
    assert len(alerts) >= 6, alerts
    tested = {p.name: alerts_tested_in(p) for p in UNIT_TEST_FILES}
    untested = alerts - set().union(*tested.values())
    assert not untested, f"alerts without a promtool unit test in {UNIT_TESTS}: {sorted(untested)}"
    unknown = {name: names - alerts for name, names in tested.items() if names - alerts}
    assert not unknown, f"unit tests of alerts the chart no longer has: {unknown}"


@pytest.mark.parametrize("unit_test", UNIT_TEST_FILES, ids=[p.name.split(".")[0] for p in UNIT_TEST_FILES])
def test_alert_fires_only_where_it_should(unit_test: Path, tmp_path: Path) -> None:
    """Each file checks, at several evaluation times, that nothing fires before the alert's ``for:``
    has passed, and that afterwards exactly the expected alerts fire (not the healthy series)."""
    write_rules(tmp_path, rule_groups())
    shutil.copy(unit_test, tmp_path / unit_test.name)
    proc = promtool("test", "rules", unit_test.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout
    # an empty expectation passes vacuously; every file must also expect its alert to fire
    doc = yaml.safe_load(unit_test.read_text())
    fired = [t for test in doc["tests"] for t in test.get("alert_rule_test", []) if t.get("exp_alerts")]
    assert fired, f"{unit_test.name} never expects its alert to fire"
