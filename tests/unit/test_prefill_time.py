"""The learned time from grant to first output (``pdmaster.prefill_time``)."""

from __future__ import annotations

import random

import pytest

from pdmaster.prefill_time import MIN_SAMPLES, PrefillTime


def test_nothing_is_predicted_before_enough_requests() -> None:
    pt = PrefillTime()
    for _ in range(MIN_SAMPLES - 1):
        pt.observe(100, 1.0)
    assert pt.line() is None and pt.predict(100) == 0.0  # a pure wait target until then
    pt.observe(100, 1.0)
    assert pt.predict(100) == pytest.approx(1.0)  # one prompt size: the mean
    assert pt.predict(0) == pytest.approx(1.0)


def test_it_fits_a_line_in_the_uncached_blocks() -> None:
    pt = PrefillTime()
    for i in range(200):
        blocks = (i * 37) % 300
        pt.observe(blocks, 0.05 + 0.002 * blocks)
    ab = pt.line()
    assert ab is not None
    assert ab[0] == pytest.approx(0.05, abs=1e-6) and ab[1] == pytest.approx(0.002, rel=1e-6)
    assert pt.predict(250) == pytest.approx(0.55, rel=1e-6)
    assert pt.predict(250) > 5 * pt.predict(10)  # a long prompt leaves less of the budget to wait


def test_it_follows_the_prefill_engines_load() -> None:
    pt = PrefillTime(weight=0.05)
    for i in range(200):
        pt.observe(i % 50, 0.01 * (i % 50))
    before = pt.predict(40)
    for i in range(200):  # the prefill engines queue now: everything takes 0.5 s longer
        pt.observe(i % 50, 0.5 + 0.01 * (i % 50))
    assert pt.predict(40) == pytest.approx(before + 0.5, rel=0.02)


def test_it_never_predicts_less_than_zero_and_ignores_nonsense() -> None:
    pt = PrefillTime()
    for i in range(50):
        pt.observe(100 + i, 1.0 - 0.001 * i)  # longer prompts faster: the slope is clamped at 0
    ab = pt.line()
    assert ab is not None and ab[1] == 0.0 and pt.predict(10_000) >= 0.0
    n = pt.samples
    pt.observe(-1, 1.0)
    pt.observe(10, float("nan"))
    assert pt.samples == n
    with pytest.raises(ValueError):
        PrefillTime(weight=0)


def test_scattered_prefill_times_add_a_margin_for_the_tail() -> None:
    """The SLO is held at a high percentile: where times scatter about the line, the prediction is the
    line plus a margin that most of them stay under; where they fit it, no margin."""
    rng = random.Random(7)
    fitting, mean_only, with_margin = PrefillTime(), PrefillTime(spread=0.0), PrefillTime()
    over_mean = over_margin = 0
    for i in range(3000):
        tokens = rng.randrange(300)
        fitting.observe(tokens, 0.1 + 0.001 * tokens)
        took = 0.1 + 0.001 * tokens + rng.gauss(0.0, 0.2)
        if i >= 500:  # after a warm-up, how often the time exceeds what was predicted for it
            over_mean += took > mean_only.predict(tokens)
            over_margin += took > with_margin.predict(tokens)
        mean_only.observe(tokens, took)
        with_margin.observe(tokens, took)
    assert fitting.miss_s == pytest.approx(0.0, abs=1e-9)
    assert fitting.predict(100) == pytest.approx(0.2, rel=1e-6)  # no margin where the line fits
    assert with_margin.miss_s == pytest.approx(0.2, rel=0.25)
    assert 0.4 < over_mean / 2500 < 0.6  # a mean: half the requests take longer
    assert over_margin / 2500 < 0.15  # with the margin: about one in ten
    with pytest.raises(ValueError):
        PrefillTime(spread=-1)
