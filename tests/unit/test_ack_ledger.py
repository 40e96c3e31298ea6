"""Strict-handover bookkeeping for the Acks: in decode, unseen, kept."""

from __future__ import annotations

from pdmaster.ack_ledger import AckLedger
from pdmaster.ticket import CLASS_ORDER, Ticket


def _lease(tid: int, slots: int = 1) -> Ticket:
    return Ticket(tid, slots, CLASS_ORDER[0], None, 0.0)


def test_kept_counts_what_was_in_decode_at_both_acks() -> None:
    lg = AckLedger()
    a, b = _lease(1, 2), _lease(2, 1)
    lg.decode_sent(a, "n")
    kept, _, gen = lg.kept_since("n", None)
    assert kept == 0 and gen == 1
    lg.decode_sent(b, "n")  # after the Ack: not kept by the next one
    kept, _, gen = lg.kept_since("n", gen)
    assert kept == 2 and gen == 2
    lg.released(a, "n")
    kept, _, gen = lg.kept_since("n", gen)
    assert kept == 1  # b only


def test_an_unseen_lease_is_not_kept_and_a_stale_mark_keeps_nothing() -> None:
    lg = AckLedger()
    a = _lease(1, 3)
    lg.decode_sent(a, "n")
    _, _, gen = lg.kept_since("n", None)
    lg.end_unseen(a, "n")
    assert lg.in_decode["n"] == 0 and lg.unseen_total() == 3
    assert lg.kept_since("n", gen)[0] == 0
    assert lg.kept_since("n", 0)[0] == 0  # not the latest Ack's number
    lg.released(a, "n")
    assert lg.unseen_total() == 0
    lg.forget("n")
    assert "n" not in lg.ack_gen and "n" not in lg.in_decode


def test_kept_tokens_are_those_of_the_kept_leases() -> None:
    lg = AckLedger()
    a, b = _lease(1, 1), _lease(2, 1)
    a.tokens, b.tokens = 100, 30
    lg.decode_sent(a, "n")
    _, _, gen = lg.kept_since("n", None)
    lg.decode_sent(b, "n")
    assert lg.in_decode_tokens["n"] == 130
    assert lg.kept_since("n", gen)[:2] == (1, 100)
    lg.end_unseen(b, "n")
    lg.released(a, "n")
    assert lg.in_decode_tokens["n"] == 0
    assert lg.kept_since("n", gen + 1)[:2] == (0, 0)
