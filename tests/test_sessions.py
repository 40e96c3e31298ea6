from __future__ import annotations

from pdmaster.sessions import SessionTracker


def test_ttl_and_lru_bound() -> None:
    now = [0.0]
    t = SessionTracker(ttl_s=10, max_sessions=3, clock=lambda: now[0])
    assert not t.is_continuation("a")
    assert t.observe_output("a") is True
    assert t.observe_output("a") is False
    assert t.is_continuation("a")
    now[0] = 11
    assert not t.is_continuation("a")
    for s in "bcde":
        t.observe_output(s)
    assert len(t) == 3 and not t.is_continuation("b") and t.is_continuation("e")
    assert not t.is_continuation(None) and not t.observe_output("")
