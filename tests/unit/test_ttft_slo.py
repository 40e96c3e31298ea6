"""``--ttft-slo``: one flag for what the README asked operators to assemble from four (DESIGN §13)."""

from __future__ import annotations

import pytest

from pdmaster.admission import RequestClass
from pdmaster.config import ConfigError, MasterConfig, slo_targets
from pdmaster.engine_priority import START_ARG, class_priorities, node_priorities
from pdmaster.main import build_parser


def config(*argv: str) -> MasterConfig:
    return MasterConfig.from_args(build_parser().parse_args(["--master-id", "m1", *argv]))


def test_without_an_slo_nothing_changes() -> None:
    cfg = config()
    assert cfg.ttft_slo == 0
    assert cfg.admission.target_wait_s is None and not cfg.admission.target_includes_prefill
    assert (cfg.engine_priority, cfg.spill_peers) == ("off", 0)


def test_the_slo_sets_targets_prefill_priority_and_spilling() -> None:
    cfg = config("--ttft-slo", "2")
    assert cfg.ttft_slo == 2
    assert cfg.admission.target_wait_s == {
        RequestClass.CONTINUATION: 1.5,
        RequestClass.PROBABLE_CACHE_HIT: 1.8,
        RequestClass.COLD: 1.8,
    }
    assert slo_targets(2) == cfg.admission.target_wait_s
    assert cfg.admission.target_includes_prefill
    assert (cfg.engine_priority, cfg.spill_peers) == ("auto", 3)


def test_explicit_flags_win_over_the_slo() -> None:
    cfg = config(
        "--ttft-slo", "2", "--admission-target-wait", "1.2:1.8:1.8", "--engine-priority", "off",
        "--spill-peers", "0",
    )  # fmt: skip
    assert cfg.admission.target_wait_s is not None
    assert cfg.admission.target_wait_s[RequestClass.CONTINUATION] == 1.2
    assert (cfg.engine_priority, cfg.spill_peers) == ("off", 0)


def test_a_target_beyond_the_slo_is_refused() -> None:
    with pytest.raises(ConfigError, match="--admission-target-wait must not exceed --ttft-slo 2"):
        config("--ttft-slo", "2", "--admission-target-wait", "3")


def test_a_bad_slo_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--master-id", "m1", "--ttft-slo", "-1"])
    assert "--ttft-slo" in capsys.readouterr().err


def test_auto_priority_only_where_both_engines_schedule_by_it() -> None:
    high = {START_ARG: "high-first"}
    low = {START_ARG: "low-first"}
    assert node_priorities(high, high) == class_priorities("high-first")
    assert node_priorities(low, low) == class_priorities("low-first")
    assert node_priorities(high, {}) is None
    assert node_priorities({}, {}) is None
    assert node_priorities(high, low) is None
    assert class_priorities("auto") is None


def test_the_charge_follows_the_engines_reserve() -> None:
    assert config().token_charge.reserve_tokens == 512  # SGLang's protocol by default
    assert config("--engine-protocol", "vllm").token_charge.reserve_tokens == 0
    assert config("--kv-reserve-tokens", "64").token_charge.reserve_tokens == 64
    assert config("--chars-per-token", "4").token_charge.chars_per_token == 4.0
