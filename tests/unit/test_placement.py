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


def _pooled(nodes: int, slots: int, tokens: int) -> Placement:
    pl = Placement()
    names = [f"n{i}" for i in range(nodes)]
    pl.apply(dict.fromkeys(names, slots), None, dict.fromkeys(names, tokens))
    return pl


def test_a_miss_is_exact_when_no_node_has_the_room() -> None:
    pl = _pooled(3, 4, 1000)
    for n in ("n0", "n1", "n2"):
        pl.take(n, 1, 900)
    assert pl.fit(1, 500) is None and pl.exact
    seen = pl.raises
    # taking room never makes a lease fit: nothing to look at
    pl.take("n1", 1, 50)
    assert pl.still_none(1, 500, seen)
    # a release that does not cover the lease on its node changes nothing
    pl.give_back("n0", 1, 300)
    assert pl.still_none(1, 500, seen) and pl.fit(1, 500) is None
    # one that does: ask fit again
    pl.give_back("n2", 1, 900)
    assert not pl.still_none(1, 500, seen) and pl.fit(1, 500) == "n2"


def test_a_miss_past_the_lookahead_is_not_exact() -> None:
    # five nodes with the tokens and no slot, five with slots and too few tokens, and one that
    # has both but comes after them in either order: both walks give up before reaching it
    pl = Placement()
    a = [f"a{i}" for i in range(5)]
    b = [f"b{i}" for i in range(5)]
    shares = {**dict.fromkeys(a, 1), **dict.fromkeys(b, 2), "c": 2}
    pl.apply(shares, None, dict.fromkeys(shares, 1000))
    for n in a:
        pl.take(n, 1, 100)  # 0 slots, 900 tokens free
    for n in b:
        pl.take(n, 0, 950)  # 2 slots, 50 tokens free
    pl.take("c", 1, 800)  # 1 slot, 200 tokens free
    assert pl.fit(1, 100) is None and not pl.exact


def test_still_none_forgets_across_share_changes_and_many_releases() -> None:
    pl = _pooled(2, 2, 1000)
    pl.take("n0", 2, 100)
    pl.take("n1", 2, 100)
    seen = pl.raises
    pl.apply({"n0": 4}, None, {"n0": 1000})  # room changed in a way not noted per node
    assert not pl.still_none(1, 1, seen)
    seen = pl.raises
    assert pl.still_none(1, 1, seen)
    for _ in range(40):
        pl.take("n1", 1, 0)
        pl.give_back("n1", 1, 0)
    assert pl.raises - seen == 40 and pl.still_none(3, 1, seen)
    for _ in range(40):
        pl.take("n1", 1, 0)
        pl.give_back("n1", 1, 0)
    assert len(pl.raised) <= 64 and not pl.still_none(3, 1, seen)  # no longer all known
