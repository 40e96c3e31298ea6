"""The node ledger of admission: shares, full capacity, active slots and the free-room heap."""

from __future__ import annotations

from pdmaster.placement import Placement


def test_top_free_is_the_node_with_the_most_free_slots_and_follows_leases() -> None:
    pl = Placement()
    assert pl.apply({"a": 4, "b": 2}, None)
    assert pl.capacity == 6 and pl.max_share == 4
    assert pl.top_free() == (4, "a")
    pl.take("a", 3)
    assert pl.top_free() == (2, "b")
    assert pl.active_on("a") == 3 and pl.active_total == 3
    pl.give_back("a", 3)
    assert pl.top_free() == (4, "a") and pl.active_total == 0


def test_avoiding_skips_only_the_avoided_nodes() -> None:
    pl = Placement()
    pl.apply({"a": 4, "b": 3, "c": 1}, None)
    assert pl.top_free_avoiding(frozenset({"a"})) == (3, "b")
    assert pl.top_free_avoiding(frozenset({"a", "b", "c"})) == (0, None)
    assert pl.top_free() == (4, "a")  # skipped entries were put back


def test_full_capacity_defaults_to_the_share_and_never_below_it() -> None:
    pl = Placement()
    pl.apply({"a": 4, "b": 2}, {"a": 8, "b": 1})
    assert pl.max_full == 8 and pl.full["b"] == 2 and pl.full_total == 10
    assert pl.fits_a_share(4) and not pl.fits_a_share(5)
    assert pl.refusal_code(4) is None
    assert pl.refusal_code(8) == "cannot_fit_now" and pl.refusal_code(9) == "unsatisfiable"


def test_a_node_without_share_or_lease_leaves_the_ledger() -> None:
    pl = Placement()
    pl.apply({"a": 2}, None)
    pl.take("a", 1)
    assert not pl.apply({"a": 2}, None)  # the same share: no change
    assert pl.apply({"a": 0}, None)
    assert pl.holds("a") and pl.top_free() == (-1, "a")  # the lease runs on past the shrink
    pl.give_back("a", 1)
    assert not pl.holds("a") and pl.top_free() == (0, None)
    assert pl.nodes_view() == {}


def test_the_heap_stays_bounded_by_the_nodes() -> None:
    pl = Placement()
    pl.apply({"a": 2, "b": 2}, None)
    for _ in range(1000):
        pl.take("a", 1)
        pl.give_back("a", 1)
    assert len(pl.free_heap) <= 4 * 2 + 64 + 1
