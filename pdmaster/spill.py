"""Spill: a request that would wait at this master, or that it refuses at once, is offered to peers.

Each master holds part of every node and admits against its own queue and completion rate, so a
burst that lands on one master waits or is refused there while another holds slots with nothing
queued (four masters behind a 70/20/5/5 balancer: 1.4 of 16 slots, bench/README.md, Overload). A
balancer that passes every 429 on cannot tell an immediate refusal from one after a wait, and sends
the next master a request that is already late. The master can tell: with ``--spill-peers N`` a
request that would wait here for room (``RequestPipeline.serve``; not one behind its own session's
turn, which waits for that turn wherever it goes), or that is refused here with
``expected_wait`` (nothing done for it yet), is offered to up to N other masters in turn, marked with
``X-Pdcoord-Spilled``. A peer takes such a request only into room it has free now (``at_once`` in
``AdmissionCore.submit``: it never waits beside the peer's own clients, so it cannot be late there
for want of a slot) and never passes it on. The first answer that is not a refusal (429/503) goes
back to the client as the peer gave it, streamed, with ``X-Spilled-To``; otherwise the request queues
or is refused here as it would have been. The peers are the masters registered in etcd (their
advertised HTTP addresses), read as the master already reads them to count them, tried in random
order so that a burst spreads. ``X-Pdcoord-Cached`` carries what this master's prefix index knows of
the prompt (blocks per prefill node): the peer's index has not seen this master's traffic, and without
it routed spilled prompts as cold, away from the engine holding their prefix. The client's
``Authorization`` goes along (masters of one deployment share their API keys). A client that sets
``X-Pdcoord-Spilled`` itself only restricts its own request. Continuations spill too: their prefix is
cached in the engines, which every master shares, and the hint routes them there; a peer's answer
counts as the session's output here, so the next turn is a continuation here as well.

Spilling on arrival moves only what arrives while a peer has room; a request already queued here would
never learn that a peer's slot came free a moment later. So while requests wait here (first-time ones,
not behind their own session's turn), the master asks up to N peers every ``HANDOFF_POLL_S`` how much
room they have free now (``GET /spill/room``, one number, with this deployment's first API key), and
hands the waiters closest to their deadline that fit to a peer that has some
(``AdmissionController.hand_off``): each leaves the queue and is forwarded there as above. Should that
peer have filled in the meantime, the request comes back here as a resubmission with its deadline (it
goes first, as a retried request does), so a hand-off never costs a request its place.

Masters that hand waiters to each other serve one queue in effect, so they judge arrivals as one
master over their slots would. The room report carries each master's load (``PeerLoad``: free room,
queued slots per class, the slots per second it serves itself, the slots it holds); while the last
round of reports is fresh (``PEER_LOAD_TTL_S``), an arrival's expected wait counts the peers' queues
ahead of it and their free room and turnover behind this queue, and a first-time arrival's queue bound
is a wave of the pooled slots less what the peers queue. Without that, a clump at one master was
refused against that master's turnover alone while its peers' slots were about to take the queue.
A request whose prefill alone breaks its time-to-first-token target is never offered to a peer: a
peer's free slot would serve it late (one master runs it only if it can start at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections.abc import Callable, Mapping
from typing import Protocol

import aiohttp
from aiohttp import web
from prometheus_client import Counter

from pdmaster.admission import CLASS_ORDER, PeerLoad, RequestClass
from pdmaster.prefix_index import PrefixEstimate

log = logging.getLogger(__name__)

RESULTS = ("taken", "refused", "unreachable")
# A master's load now, for its peers (``PeerLoad``): {"free": slots, "queued": {class: slots},
# "rate": slots/s, "capacity": slots held}; "free" alone (an earlier release) is room without a load.
ROOM_PATH = "/spill/room"
# How often a master with waiting requests asks its peers for room: a slot that comes free at a peer
# idles at most about this long before a waiter here takes it (decode leases last seconds).
HANDOFF_POLL_S = 0.05
_ROOM_TIMEOUT = aiohttp.ClientTimeout(total=0.5)


class HandsOff(Protocol):
    """What the hand-off loop needs of the admission controller."""

    def has_handoffs(self) -> bool: ...

    def hand_off(self, peer: str, free_slots: int) -> int: ...

    def set_peer_load(self, load: PeerLoad | None) -> None: ...


# What the spilling master's prefix index knows of the prompt: "node=blocks,..." per prefill node. A
# peer's index has not seen this master's traffic; with it the peer routes the prompt to the engine
# that holds its prefix (and counts that prefill as short) instead of taking it for cold.
CACHED_HEADER = "X-Pdcoord-Cached"
MAX_CACHED_NODES = 64
SPILLED_HEADER = "X-Pdcoord-Spilled"
SPILLED_TO_HEADER = "X-Spilled-To"  # on the answer: the master that served it
WAIT_HEADER = "X-Admission-Wait-Ms"
# Request headers a peer needs to treat the request as the client's own.
_FORWARDED = ("Authorization", "Content-Type", "X-Session-Id", "X-Request-Id")
# Response headers that describe the connection, not the answer: aiohttp sets its own.
_HOP = frozenset(
    h.lower() for h in ("Connection", "Content-Length", "Transfer-Encoding", "Keep-Alive", "Date", "Server")
)


def peers_from_etcd(values: Mapping[str, bytes], own_id: str) -> list[tuple[str, str]]:
    """The other masters' ids and HTTP base URLs from their etcd keys and values (``{"http": ...}``),
    sorted."""
    out = []
    for key, raw in values.items():
        mid = key.rstrip("/").rsplit("/", 1)[-1]
        if mid == own_id:
            continue
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            continue
        url = doc.get("http") if isinstance(doc, dict) else None
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            out.append((mid, url.rstrip("/")))
    return sorted(out)


class Spill:
    """Offers requests to peer masters (see the module); ``peers`` is kept current by the master."""

    def __init__(
        self,
        master_id: str,
        max_peers: int,
        *,
        timeout_s: float = 300.0,
        metric: Counter | None = None,
        load_now: Callable[[], PeerLoad] | None = None,
        api_key: bytes | None = None,
    ) -> None:
        if max_peers < 0:
            raise ValueError("max_peers must be >= 0")
        self.metric = metric  # pdcoord_spilled_requests{result}
        self.master_id = master_id
        self.load_now = load_now  # this master's room and load for its peers (GET /spill/room)
        self._probe_headers = {"Authorization": "Bearer " + api_key.decode()} if api_key else {}
        self.max_peers = max_peers
        self.peers: list[tuple[str, str]] = []  # (master id, HTTP base URL)
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        # Offers to peers by result: taken (the peer answered), refused (429/503), unreachable.
        self.results: dict[str, int] = dict.fromkeys(RESULTS, 0)

    def wanted(self, request: web.Request) -> bool:
        """Whether ``request`` may go to a peer: spilling is on, there is a peer, and it did not come
        from one."""
        return bool(self.max_peers and self.peers) and SPILLED_HEADER not in request.headers

    def _count(self, result: str) -> None:
        self.results[result] += 1
        if self.metric is not None:
            self.metric.labels(result=result).inc()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, auto_decompress=False)
        return self._session

    async def forward(
        self,
        request: web.Request,
        raw: bytes,
        cached: Mapping[str, int] | None = None,
        *,
        to: str | None = None,
        waited_s: float | None = None,
        on_output: Callable[[], None] | None = None,
    ) -> web.StreamResponse | None:
        """The first peer answer that is not a refusal (429/503), streamed to the client; None when
        every peer tried refused or could not be reached (the caller sends its own refusal).
        ``cached``: the prompt's blocks this master's prefix index sees on each prefill node. ``to``:
        that peer only (a hand-off); ``waited_s``: what the request waited here (its answer's
        ``X-Admission-Wait-Ms`` then says so rather than the peer's 0). ``on_output``: called once
        when a 200 answer's first bytes arrive, before the client sees them (so that the session's
        next turn, sent the moment the client has read this one, already counts as a continuation)."""
        headers = {h: request.headers[h] for h in _FORWARDED if h in request.headers}
        headers[SPILLED_HEADER] = self.master_id
        top = sorted(((n, b) for n, b in (cached or {}).items() if b > 0), key=lambda kv: -kv[1])
        if top:
            headers[CACHED_HEADER] = ",".join(f"{node}={blocks}" for node, blocks in top[:MAX_CACHED_NODES])
        if to is not None:
            peers = [p for p in self.peers if p[0] == to]
        else:
            peers = list(self.peers)
            random.shuffle(peers)
        for peer_id, base in peers[: self.max_peers]:
            try:
                resp = await self._client().post(base + request.path, data=raw, headers=headers)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.info("spill to %s failed: %s", base, exc)
                self._count("unreachable")
                continue
            try:
                if resp.status in (429, 503):
                    await resp.read()
                    self._count("refused")
                    continue
                self._count("taken")
                return await self._relay(request, resp, peer_id, waited_s, on_output)
            finally:
                resp.release()
        return None

    @staticmethod
    async def _relay(
        request: web.Request,
        resp: aiohttp.ClientResponse,
        peer_id: str,
        waited_s: float | None = None,
        on_output: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, reason=resp.reason)
        for k, v in resp.headers.items():
            if k.lower() not in _HOP:
                out.headers.add(k, v)
        out.headers[SPILLED_TO_HEADER] = peer_id  # as X-Retries: the client may want to know
        if waited_s is not None and WAIT_HEADER in out.headers:
            try:
                there = float(out.headers[WAIT_HEADER])
            except ValueError:
                there = 0.0
            out.headers[WAIT_HEADER] = f"{waited_s * 1000 + there:.1f}"  # here, then there
        await out.prepare(request)
        if resp.status != 200:
            on_output = None  # an error body is no output
        try:
            async for chunk in resp.content.iter_any():
                if on_output is not None:
                    on_output()
                    on_output = None
                await out.write(chunk)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # Headers are out: the client sees the stream end early, as when an engine dies mid-answer.
            log.info("spilled answer cut off: %s", exc)
            return out
        await out.write_eof()
        return out

    # -- hand-offs of waiting requests ------------------------------------------------------------
    async def room(self, _request: web.Request) -> web.Response:
        """``GET /spill/room``: the slots a peer's waiter could start here now, what waits here and
        what this master serves (see ``ROOM_PATH``)."""
        load = self.load_now() if self.load_now is not None else PeerLoad()
        return web.json_response(
            {
                "free": load.free,
                "queued": {c.value: n for c, n in load.queued.items() if n > 0},
                "rate": round(load.rate, 4),
                "capacity": load.capacity,
            }
        )

    async def _peer_room(self, base: str) -> PeerLoad | None:
        """A peer's ``/spill/room``; None when it cannot be read (it counts as no room)."""
        try:
            async with self._client().get(
                base + ROOM_PATH, headers=self._probe_headers, timeout=_ROOM_TIMEOUT
            ) as r:
                if r.status != 200:
                    return None
                doc = await r.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None
        return parse_load(doc)

    async def hand_off_once(self, admission: HandsOff) -> int:
        """Ask up to N peers for their room (only while something waits here that could move), tell
        admission their summed load (its expected wait judges arrivals over them too) and hand the
        waiters closest to their deadline that fit to those with room; returns how many were handed
        off."""
        if not (self.max_peers and self.peers) or not admission.has_handoffs():
            return 0
        peers = list(self.peers)
        random.shuffle(peers)
        peers = peers[: self.max_peers]
        loads = await asyncio.gather(*(self._peer_room(base) for _, base in peers))
        known = [load for load in loads if load is not None]
        admission.set_peer_load(sum(known, PeerLoad()) if known else None)
        moved = 0
        for (peer_id, _), load in zip(peers, loads, strict=True):
            if load is not None and load.free and admission.has_handoffs():
                moved += admission.hand_off(peer_id, load.free)
        return moved

    async def run_handoffs(self, admission: HandsOff, poll_s: float = HANDOFF_POLL_S) -> None:
        """Until cancelled: :meth:`hand_off_once` every ``poll_s``."""
        while True:
            await asyncio.sleep(poll_s)
            try:
                await self.hand_off_once(admission)
            except Exception:  # a bug here must not stop spilling for the master's lifetime
                log.exception("handing waiters to peers failed")


def _slots_of(x: object) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else 0


def parse_load(doc: object) -> PeerLoad | None:
    """A peer's ``/spill/room`` answer as a :class:`PeerLoad`; None unless it is a JSON object. Fields
    that are missing or malformed count as nothing (no room, nothing queued, no rate)."""
    if not isinstance(doc, dict):
        return None
    raw_q = doc.get("queued")
    queued: dict[RequestClass, int] = {}
    if isinstance(raw_q, dict):
        for c in CLASS_ORDER:
            if n := _slots_of(raw_q.get(c.value)):
                queued[c] = n
    raw_rate = doc.get("rate")
    rate = float(raw_rate) if isinstance(raw_rate, (int, float)) and not isinstance(raw_rate, bool) else 0.0
    return PeerLoad(
        _slots_of(doc.get("free")),
        queued,
        rate if math.isfinite(rate) and rate > 0 else 0.0,
        _slots_of(doc.get("capacity")),
    )


def parse_cached(header: str, total_blocks: int) -> dict[str, int]:
    """``X-Pdcoord-Cached`` as {node: blocks}: well-formed entries only, each at most ``total_blocks``
    (what the prompt has), at most MAX_CACHED_NODES; anything else is ignored (it only steers routing)."""
    out: dict[str, int] = {}
    for item in header.split(",")[:MAX_CACHED_NODES]:
        node, sep, blocks = item.strip().partition("=")
        if sep and node and blocks.isascii() and blocks.isdigit() and len(blocks) <= 9:
            out[node] = min(int(blocks), total_blocks)
    return out


def with_cached(estimate: PrefixEstimate[str], cached: Mapping[str, int]) -> PrefixEstimate[str]:
    """``estimate`` with what the spilling master saw cached: per node the larger of the two."""
    matches = dict(estimate.matches)
    for node, blocks in cached.items():
        if blocks > matches.get(node, 0):
            matches[node] = blocks
    if not matches:
        return estimate
    best = max(sorted(matches), key=lambda n: matches[n])
    return PrefixEstimate(estimate.total_blocks, matches, best, matches[best])
