"""pdcoord.status: what one look at a fleet calls inconsistent, and how it is shown."""

from __future__ import annotations

from typing import Any

from pdcoord.status import Fleet, Problem, check, confirm, render, report


def node(node_id: str, share: int, epoch: int, *, connected: bool = True, **kw: Any) -> dict[str, Any]:
    load = {"running": 1, "waiting": 0, "kv_usage": 0.5, "probe_ok": True}
    return {"node_id": node_id, "role": "decode", "share": share, "epoch": epoch, "connected": connected,
            "effective_share": share if connected else 0, "legacy": False, "engine_down": False,
            "engine_reason": "", "breaker_state": "closed", "load": load, **kw}  # fmt: skip


def admission(*nodes: dict[str, Any], draining: bool = False) -> dict[str, Any]:
    cap = sum(n["effective_share"] for n in nodes)
    classes = {k: {"queued_requests": 0} for k in ("continuation", "probable_cache_hit", "cold")}
    return {"capacity": cap, "draining": draining, "active": 0, "queued_requests": 0, "queued_slots": 0,
            "classes": classes, "nodes": list(nodes)}  # fmt: skip


def fleet(**admissions: dict[str, Any]) -> Fleet:
    f = Fleet(cluster="c", taken_at=0.0)
    for m in ("m1", "m2"):
        f.masters[m] = {
            "master_id": m,
            "grpc": f"10.0.0.1:5005{m[-1]}",
            "http": f"http://10.0.0.1:800{m[-1]}",
        }
    f.nodes["d1"] = {"node_id": "d1", "role": "decode", "running_max_req_size": 4, "last_epoch": 5}
    for m, adm in admissions.items():
        f.admission[m] = adm
    for m in f.masters:
        if m not in f.admission:
            f.errors[m] = "cannot connect: Connection refused"
    return f


def kinds(problems: list[Problem]) -> list[tuple[str, str]]:
    return [p.key for p in problems]


def test_a_consistent_fleet_has_no_problem_and_renders_each_share() -> None:
    f = fleet(m1=admission(node("d1", 2, 7)), m2=admission(node("d1", 2, 7)))
    assert check(f) == []
    doc = report(f, [])
    assert doc["ok"] and doc["decode_capacity"] == doc["decode_held"] == 4
    text = render(doc)
    assert "status: ok" in text and "d1" in text and "1/0/50%" in text


def test_shares_above_capacity_and_below_it() -> None:
    f = fleet(m1=admission(node("d1", 3, 7)), m2=admission(node("d1", 2, 7)))
    (p,) = check(f)
    assert p.key == ("over_capacity", "node d1") and "5 slots, above its capacity 4" in p.message
    f = fleet(m1=admission(node("d1", 1, 7)), m2=admission(node("d1", 2, 7)))
    assert kinds(check(f)) == [("unheld", "node d1")]


def test_a_master_behind_on_the_epoch_and_one_without_a_stream() -> None:
    f = fleet(m1=admission(node("d1", 2, 7)), m2=admission(node("d1", 2, 6)))
    assert kinds(check(f)) == [("stale_epoch", "node d1 / master m2")]
    f = fleet(m1=admission(node("d1", 4, 7)), m2=admission(node("d1", 0, 6, connected=False)))
    assert kinds(check(f)) == [("no_stream", "node d1 / master m2")]
    text = render(report(f, check(f)))
    assert "no stream" in text and "node d1 has no stream to master m2" in text
    # a draining master hands its shares back: no stream to it is expected
    f = fleet(m1=admission(node("d1", 4, 7)), m2=admission(draining=True))
    assert check(f) == []


def test_an_unreachable_master_is_a_problem_and_its_shares_are_unknown() -> None:
    f = fleet(m1=admission(node("d1", 2, 7)))
    # what m2 holds is unknown, so the 2 of 4 slots m1 holds are not called unheld
    assert kinds(check(f)) == [("unreachable", "master m2")]
    assert "http://10.0.0.1:8002 does not answer /admission (cannot connect" in check(f)[0].message
    assert "?" in render(report(f, check(f)))


def test_engine_down_wildcard_and_empty_fleets() -> None:
    down = node("d1", 2, 7, engine_down=True, engine_reason="connection refused")
    f = fleet(m1=admission(down), m2=admission(dict(down)))
    assert kinds(check(f)) == [("engine_down", "node d1")]  # once, whichever master said it
    f.masters["m1"]["grpc"] = "0.0.0.0:50051"
    assert ("wildcard", "master m1") in kinds(check(f))
    empty = Fleet(cluster="c")
    assert kinds(check(empty)) == [("no_masters", "cluster"), ("no_nodes", "cluster")]


def test_admin_address_wins_over_http() -> None:
    f = fleet()
    f.masters["m1"]["admin"] = "http://10.0.0.1:9001"
    assert f.endpoint("m1") == "http://10.0.0.1:9001" and f.endpoint("m2") == "http://10.0.0.1:8002"


def test_confirm_keeps_only_what_two_looks_show() -> None:
    a, b = Problem("unheld", "node d1", "x"), Problem("no_stream", "node d2 / master m1", "y")
    b2 = Problem("no_stream", "node d2 / master m1", "y, later")
    assert confirm(None, [a, b]) == ([a, b], [])
    assert confirm([b], [a, b2]) == ([b2], [a])


def test_nodes_show_their_kv_pool_or_slots_only() -> None:
    f = fleet(m1=admission(node("d1", 2, 7)), m2=admission(node("d1", 2, 7)))
    f.nodes["d1"]["kv_tokens"] = 480000
    f.nodes["d2"] = {"node_id": "d2", "role": "decode", "running_max_req_size": 4, "kv_tokens": None}
    doc = report(f, [])
    rows = {r["node_id"]: r for r in doc["nodes"]}
    assert (rows["d1"]["kv_tokens"], rows["d1"]["capacity_unit"]) == (480000, "slots and kv tokens")
    assert (rows["d2"]["kv_tokens"], rows["d2"]["capacity_unit"]) == (None, "slots only")
    text = render(doc)
    assert "kv tokens" in text and "480000" in text and "slots only" in text
    # an older agent's key says nothing of a pool
    del f.nodes["d1"]["kv_tokens"]
    assert report(f, [])["nodes"][0]["capacity_unit"] is None


def test_token_shares_are_shown_and_more_than_the_pool_is_a_problem() -> None:
    half = admission(node("d1", 2, 7, token_share=300))
    f = fleet(m1=half, m2=half)
    f.nodes["d1"]["kv_tokens"] = 600
    assert check(f) == []
    assert "300 tok" in render(report(f, []))
    f.admission["m2"] = admission(node("d1", 2, 7, token_share=400))
    problems = check(f)
    assert kinds(problems) == [("over_pool", "node d1")]
    assert "700 KV tokens, above its pool 600" in problems[0].message
    # a master that takes no token share (an earlier release) holds none
    f.admission["m2"] = admission(node("d1", 2, 7, token_share=None))
    assert check(f) == []
