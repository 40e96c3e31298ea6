"""Spill (``--spill-peers``): a request refused at once for its expected wait goes to a peer master.

Real sockets on 127.0.0.1: an origin app that refuses and spills, and peer apps standing in for the
other masters (what a peer does with the request is the master's ordinary path, tested elsewhere).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer, make_mocked_request
from prometheus_client import CollectorRegistry

from pdmaster.admission import PeerLoad, RequestClass
from pdmaster.api import api_key_middleware
from pdmaster.metrics import RequestMetrics
from pdmaster.prefix_index import PrefixEstimate
from pdmaster.spill import (
    CACHED_HEADER,
    ROOM_PATH,
    SPILLED_HEADER,
    SPILLED_TO_HEADER,
    Spill,
    parse_cached,
    parse_load,
    peers_from_etcd,
    with_cached,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def test_peers_are_the_other_masters_http_addresses() -> None:
    values = {
        "/pdcoord/c/masters/m1": json.dumps({"http": "http://10.0.0.1:8000", "grpc": "x:1"}).encode(),
        "/pdcoord/c/masters/m2": json.dumps({"http": "http://10.0.0.2:8000/"}).encode(),
        "/pdcoord/c/masters/m3": b"not json",
        "/pdcoord/c/masters/m4": json.dumps({"grpc": "only:1"}).encode(),
        "/pdcoord/c/masters/m5": json.dumps(["http://a"]).encode(),
    }
    assert peers_from_etcd(values, "m1") == [("m2", "http://10.0.0.2:8000")]
    assert peers_from_etcd(values, "m9") == [("m1", "http://10.0.0.1:8000"), ("m2", "http://10.0.0.2:8000")]


async def _serve(handler: Handler) -> TestServer:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


class Peer:
    """A peer master that refuses (429) or answers with a streamed body, and records what it got."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.seen: list[tuple[dict[str, str], bytes]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((dict(request.headers), await request.read()))
        if self.status != 200:
            return web.json_response({"error": {"code": "expected_wait"}}, status=self.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Peer": "yes"})
        await resp.prepare(request)
        for part in (b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"):
            await resp.write(part)
        await resp.write_eof()
        return resp


@pytest.fixture
async def servers() -> AsyncIterator[list[TestServer]]:
    started: list[TestServer] = []
    yield started
    for s in started:
        await s.close()


def _spilling(spill: Spill, cached: dict[str, int] | None = None) -> Handler:
    async def refuse_or_spill(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if spill.wanted(request):
            answer = await spill.forward(request, raw, cached)
            if answer is not None:
                return answer
        return web.json_response({"error": {"code": "expected_wait", "from": "origin"}}, status=429)

    return refuse_or_spill


async def _origin(spill: Spill, servers: list[TestServer]) -> TestServer:
    server = await _serve(_spilling(spill))
    servers.append(server)
    return server


async def test_a_refused_request_is_answered_by_the_first_peer_to_take_it(
    servers: list[TestServer],
) -> None:
    full, free = Peer(429), Peer(200)
    for p in (full, free):
        servers.append(await _serve(p.handle))
    spill = Spill("m1", max_peers=2)
    spill.peers = [(f"p{i}", str(s.make_url("")).rstrip("/")) for i, s in enumerate(servers)]
    origin = await _origin(spill, servers)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        aiohttp.ClientSession() as client,
        client.post(
            origin.make_url("/v1/chat/completions"),
            json=body,
            headers={"Authorization": "Bearer k", "X-Session-Id": "s1", "X-Other": "dropped"},
        ) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["X-Peer"] == "yes" and resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers[SPILLED_TO_HEADER] == "p1"  # the peer that took it
        assert await resp.read() == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    assert len(free.seen) == 1 and len(full.seen) <= 1  # random order: the full one may come first
    headers, raw = free.seen[0]
    assert json.loads(raw) == body
    assert headers[SPILLED_HEADER] == "m1"
    assert headers["Authorization"] == "Bearer k" and headers["X-Session-Id"] == "s1"
    assert "X-Other" not in headers
    assert spill.results == {"taken": 1, "refused": len(full.seen), "unreachable": 0}
    await spill.close()


async def test_every_peer_full_or_gone_gives_the_origin_s_own_refusal(servers: list[TestServer]) -> None:
    full = Peer(503)
    servers.append(await _serve(full.handle))
    gone = await _serve(Peer(200).handle)
    gone_url = str(gone.make_url("")).rstrip("/")
    await gone.close()  # nothing listens there any more
    registry = CollectorRegistry()
    metric = RequestMetrics(registry).spilled
    spill = Spill("m1", max_peers=5, metric=metric)
    spill.peers = [("full", str(servers[0].make_url("")).rstrip("/")), ("gone", gone_url)]
    origin = await _origin(spill, servers)
    async with (
        aiohttp.ClientSession() as client,
        client.post(origin.make_url("/v1/chat/completions"), json={"x": 1}) as resp,
    ):
        assert resp.status == 429
        assert (await resp.json())["error"]["from"] == "origin"
    assert len(full.seen) == 1 and spill.results == {"taken": 0, "refused": 1, "unreachable": 1}
    for result, n in spill.results.items():  # the same counts in /metrics
        assert registry.get_sample_value("pdcoord_spilled_requests_total", {"result": result}) == (n or None)
    await spill.close()


async def test_a_spilled_request_is_never_passed_on_again(servers: list[TestServer]) -> None:
    free = Peer(200)
    servers.append(await _serve(free.handle))
    spill = Spill("m2", max_peers=1)
    spill.peers = [("m1", str(servers[0].make_url("")).rstrip("/"))]
    origin = await _origin(spill, servers)
    async with (
        aiohttp.ClientSession() as client,
        client.post(origin.make_url("/v1/chat/completions"), json={}, headers={SPILLED_HEADER: "m1"}) as resp,
    ):
        assert resp.status == 429
    assert free.seen == []
    async with (
        aiohttp.ClientSession() as client,
        client.post(origin.make_url("/v1/chat/completions"), json={}) as resp,
    ):
        assert resp.status == 200  # the same request from a client: the peer takes it
    assert len(free.seen) == 1
    await spill.close()


def test_spilling_needs_the_flag_and_a_peer() -> None:
    request = make_mocked_request("POST", "/v1/chat/completions")
    on = Spill("m", max_peers=3)
    assert not on.wanted(request)  # no peer known yet
    on.peers = [("m2", "http://127.0.0.1:1")]
    assert on.wanted(request)
    assert not on.wanted(make_mocked_request("POST", "/v1/chat/completions", headers={SPILLED_HEADER: "m2"}))
    off = Spill("m", max_peers=0)
    off.peers = [("m2", "http://127.0.0.1:1")]
    assert not off.wanted(request)
    with pytest.raises(ValueError):
        Spill("m", max_peers=-1)


def test_the_cached_hint_is_parsed_defensively_and_merged_per_node() -> None:
    assert parse_cached("p1=12, p2=3,bad,=4,p3=x,p4=-1,p5=99", total_blocks=20) == {
        "p1": 12,
        "p2": 3,
        "p5": 20,
    }
    assert parse_cached("", 10) == {}
    # digits that are not ASCII, or too many of them for int(), are junk like any other
    assert parse_cached("p1=\u00b2,p2=" + "9" * 5000 + ",p3=4", 10) == {"p3": 4}
    own = PrefixEstimate(20, {"p2": 5}, "p2", 5)
    merged = with_cached(own, {"p1": 12, "p2": 3})
    assert merged.matches == {"p1": 12, "p2": 5} and merged.best_node == "p1" and merged.best_blocks == 12
    assert merged.hit_ratio == 12 / 20
    assert with_cached(PrefixEstimate(8), {}) == PrefixEstimate(8)


async def test_the_spilling_master_tells_the_peer_where_the_prompt_is_cached(
    servers: list[TestServer],
) -> None:
    free = Peer(200)
    servers.append(await _serve(free.handle))
    spill = Spill("m1", max_peers=1)
    spill.peers = [("m2", str(servers[0].make_url("")).rstrip("/"))]
    origin = await _serve(_spilling(spill, cached={"p1": 7, "p2": 0, "p3": 2}))
    servers.append(origin)
    async with (
        aiohttp.ClientSession() as client,
        client.post(origin.make_url("/v1/chat/completions"), json={}) as resp,
    ):
        assert resp.status == 200
    assert free.seen[0][0][CACHED_HEADER] == "p1=7,p3=2"  # most first, nothing for an empty node
    await spill.close()


class Waiters:
    """What the hand-off loop sees of admission: ``left`` requests that could move, and the calls."""

    def __init__(self, left: int) -> None:
        self.left = left
        self.calls: list[tuple[str, int]] = []
        self.peer_loads: list[PeerLoad | None] = []

    def set_peer_load(self, load: PeerLoad | None) -> None:
        self.peer_loads.append(load)

    def has_handoffs(self) -> bool:
        return self.left > 0

    def hand_off(self, peer: str, free_slots: int) -> int:
        self.calls.append((peer, free_slots))
        n = min(self.left, free_slots)
        self.left -= n
        return n


async def _room_peer(free: object, keys: list[bytes] | None = None) -> TestServer:
    """A peer master's /spill/room: its own Spill's handler, or a raw answer for junk."""
    middlewares = [api_key_middleware(keys, open_paths=())] if keys else []
    app = web.Application(middlewares=middlewares)
    if isinstance(free, (int, PeerLoad)):
        load = free if isinstance(free, PeerLoad) else PeerLoad(free)
        app.router.add_get(ROOM_PATH, Spill("peer", 0, load_now=lambda: load).room)
    else:

        async def junk(_request: web.Request) -> web.Response:
            return web.json_response(free)

        app.router.add_get(ROOM_PATH, junk)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_waiters_are_handed_to_the_peers_that_report_room(servers: list[TestServer]) -> None:
    """While something waits here, the master asks its peers for room (with this deployment's API
    key) and hands waiters to those that have some; junk, a refusal or a dead peer count as none."""
    roomy = await _room_peer(2, keys=[b"k"])
    full = await _room_peer(0)
    junk = await _room_peer({"free": "lots"})
    locked = await _room_peer(5, keys=[b"other"])  # a key this master does not have: 401
    gone = await _room_peer(9)
    gone_url = str(gone.make_url("")).rstrip("/")
    await gone.close()
    servers += [roomy, full, junk, locked]
    spill = Spill("m1", max_peers=5, api_key=b"k")
    spill.peers = [
        (name, str(s.make_url("")).rstrip("/"))
        for name, s in (("roomy", roomy), ("full", full), ("junk", junk), ("locked", locked))
    ] + [("gone", gone_url)]
    waiting = Waiters(left=3)
    assert await spill.hand_off_once(waiting) == 2
    assert waiting.calls == [("roomy", 2)] and waiting.left == 1
    assert waiting.peer_loads == [PeerLoad(2)]  # the peers that answered, summed
    nothing = Waiters(left=0)  # nothing waits: no peer is asked
    assert await spill.hand_off_once(nothing) == 0 and nothing.calls == []
    spill.max_peers = 0
    assert await spill.hand_off_once(waiting) == 0 and waiting.calls == [("roomy", 2)]
    await spill.close()


async def test_the_peers_loads_reach_admission_summed(servers: list[TestServer]) -> None:
    """Each round of probes tells admission what the peers that answered have queued and serve, so
    that its expected wait is the pooled one; a round no peer answered tells it it knows none."""
    cont, cold = RequestClass.CONTINUATION, RequestClass.COLD
    a = await _room_peer(PeerLoad(1, {cont: 2}, 1.5, 4))
    b = await _room_peer(PeerLoad(0, {cont: 1, cold: 4}, 2.25, 3))
    servers += [a, b]
    spill = Spill("m1", max_peers=2)
    spill.peers = [(n, str(s.make_url("")).rstrip("/")) for n, s in (("a", a), ("b", b))]
    waiting = Waiters(left=5)
    assert await spill.hand_off_once(waiting) == 1
    assert waiting.peer_loads == [PeerLoad(1, {cont: 3, cold: 4}, 3.75, 7)]
    assert waiting.calls == [("a", 1)]
    await a.close()
    await b.close()
    assert await spill.hand_off_once(waiting) == 0
    assert waiting.peer_loads[-1] is None
    await spill.close()


def test_a_peer_load_is_read_leniently() -> None:
    cont = RequestClass.CONTINUATION
    doc = {"free": 2, "queued": {"continuation": 3, "nonsense": 9, "cold": -1}, "rate": 1.5, "capacity": 5}
    assert parse_load(doc) == PeerLoad(2, {cont: 3}, 1.5, 5)
    assert parse_load({"free": 4}) == PeerLoad(4)  # room alone: no load known
    assert parse_load({"free": True, "queued": [1], "rate": float("nan")}) == PeerLoad()
    assert parse_load({"rate": "fast"}) == PeerLoad()
    assert parse_load([1, 2]) is None and parse_load("x") is None


async def test_the_room_a_master_reports_is_its_admission_s(servers: list[TestServer]) -> None:
    server = await _room_peer(3)
    servers.append(server)
    async with aiohttp.ClientSession() as client, client.get(server.make_url(ROOM_PATH)) as resp:
        assert resp.status == 200 and await resp.json() == {
            "free": 3,
            "queued": {},
            "rate": 0.0,
            "capacity": 0,
        }
    app = web.Application()
    app.router.add_get(ROOM_PATH, Spill("m", 0).room)  # no admission wired: no room
    bare = TestServer(app, host="127.0.0.1")
    await bare.start_server()
    servers.append(bare)
    async with aiohttp.ClientSession() as client, client.get(bare.make_url(ROOM_PATH)) as resp:
        assert await resp.json() == {"free": 0, "queued": {}, "rate": 0.0, "capacity": 0}


async def test_a_handed_off_request_goes_to_that_peer_and_says_how_long_it_waited(
    servers: list[TestServer],
) -> None:
    seen: list[str] = []

    def peer(name: str) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            seen.append(name)
            return web.json_response({"ok": name}, headers={"X-Admission-Wait-Ms": "2.5"})

        return handle

    for name in ("a", "b", "c"):
        servers.append(await _serve(peer(name)))
    spill = Spill("m1", max_peers=3)
    spill.peers = [(n, str(s.make_url("")).rstrip("/")) for n, s in zip("abc", servers, strict=True)]

    async def handed(request: web.Request) -> web.StreamResponse:
        answer = await spill.forward(request, await request.read(), to="b", waited_s=0.75)
        assert answer is not None
        return answer

    origin = await _serve(handed)
    servers.append(origin)
    for _ in range(3):
        async with (
            aiohttp.ClientSession() as client,
            client.post(origin.make_url("/v1/chat/completions"), json={}) as resp,
        ):
            assert resp.status == 200 and await resp.json() == {"ok": "b"}
            assert resp.headers[SPILLED_TO_HEADER] == "b"
            assert resp.headers["X-Admission-Wait-Ms"] == "752.5"  # 750 here, then 2.5 there
    assert seen == ["b", "b", "b"]
    await spill.close()


async def test_a_peer_s_answer_marks_the_session_before_the_client_reads_it(
    servers: list[TestServer],
) -> None:
    """The session's next turn may be sent the moment the client has read this one: the origin must
    already count it as a continuation then, so the mark comes with the answer's first bytes."""
    more = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:  # holds its stream open until told
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        await more.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    servers.append(await _serve(Peer(429).handle))
    servers.append(await _serve(slow))
    events: list[str] = []
    spill = Spill("m1", max_peers=2)
    spill.peers = [("full", str(servers[0].make_url("")).rstrip("/"))]

    async def origin_handler(request: web.Request) -> web.StreamResponse:
        answer = await spill.forward(request, await request.read(), on_output=lambda: events.append("output"))
        return answer or web.json_response({"error": {"code": "expected_wait"}}, status=429)

    origin = await _serve(origin_handler)
    servers.append(origin)
    async with aiohttp.ClientSession() as client:
        async with client.post(origin.make_url("/v1/chat/completions"), json={}) as resp:
            assert resp.status == 429
        assert events == []  # a refusal is no output
        spill.peers = [("slow", str(servers[1].make_url("")).rstrip("/"))]
        async with client.post(origin.make_url("/v1/chat/completions"), json={}) as resp:
            assert await resp.content.readline() == b"data: one\n"
            assert events == ["output"]  # marked by the time the client reads the first bytes
            more.set()
            await resp.read()
    assert events == ["output"]  # once
    await spill.close()
