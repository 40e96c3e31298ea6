"""Relaying D's answer to the client: whole, or as a stream with back-pressure; and the answers of a
request split into parts (``fanout``), merged.

A streamed answer is written to the client's transport from the engine socket's callback: no task
wakes per event. When more than :data:`WRITE_HIGH` bytes wait for a slow client, the engine socket
stops being read until the client catches up. An engine failure after the first byte cannot change
the status any more: it becomes an SSE error event and the stream ends.

The decode lease follows the engine, not the client (strict handover compares the leases a master
reports with the engine's own count): it is released as soon as the engine's answer has been read
whole, before the last bytes reach a slow client; and once the engine socket stops being read, the
engine may finish unseen, so the lease stops counting as surely running (``DecodeLease``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from aiohttp import web

from pdmaster.engine import EngineError, EngineResponse
from pdmaster.errors import error_body
from pdmaster.fanout import Part, StreamMerger, merge_bodies
from pdmaster.metrics import EndpointMetrics

__all__ = [
    "NO_LEASE",
    "WRITE_HIGH",
    "DecodeLease",
    "relay_body",
    "relay_parts_body",
    "relay_parts_stream",
    "relay_stream",
    "sse_error",
]

# Stop reading the engine above this many bytes queued for the client.
WRITE_HIGH = 256 * 1024


class DecodeLease(Protocol):
    """What a streamed relay tells the admission lease of its answer (``admission_controller.Lease``)."""

    def release(self) -> None:
        """The engine's answer was read whole: its decode no longer runs."""

    def end_unseen(self) -> None:
        """The engine socket stopped being read for a slow client: the decode may end unseen."""


class _NoLease:
    def release(self) -> None:
        pass

    def end_unseen(self) -> None:
        pass


NO_LEASE: DecodeLease = _NoLease()


def sse_error(message: str, type_: str = "upstream_error", code: str = "upstream_failed") -> bytes:
    return (
        b"data: " + json.dumps(error_body(message, type_=type_, code=code)).encode() + b"\n\ndata: [DONE]\n\n"
    )


async def _whole(
    body: bytes,
    headers: dict[str, str],
    metrics: EndpointMetrics,
    arrived: float,
    first_output: Callable[[], None],
) -> web.Response:
    metrics.ttft.observe(time.perf_counter() - arrived)
    first_output()
    metrics.ok.inc()
    return web.Response(body=body, content_type="application/json", headers=headers)


async def relay_body(
    answer: EngineResponse,
    headers: dict[str, str],
    metrics: EndpointMetrics,
    arrived: float,
    first_output: Callable[[], None],
    on_body: Callable[[bytes], None] | None = None,
) -> web.Response:
    """``on_body(body)``: the engine's whole answer (where its token counts are)."""
    body = await answer.read()
    if on_body is not None:
        on_body(body)
    return await _whole(body, headers, metrics, arrived, first_output)


async def relay_parts_body(
    kind: str,
    parts: list[Part],
    answers: Sequence[EngineResponse],
    headers: dict[str, str],
    metrics: EndpointMetrics,
    arrived: float,
    first_output: Callable[[], None],
) -> web.Response:
    """The whole answers of a split request, merged into one (see ``fanout``)."""
    bodies = await asyncio.gather(*(a.read() for a in answers))
    try:
        body = merge_bodies(kind, parts, list(bodies))
    except (ValueError, TypeError, AttributeError) as exc:
        why = f"an engine answered a part with something that is not the expected JSON: {exc}"
        raise EngineError(why, kind="protocol") from None
    return await _whole(body, headers, metrics, arrived, first_output)


class _Stream:
    """A streamed answer on its way to the client. Its head goes out through aiohttp; events are then
    written to the client's transport from the engine sockets' callbacks (no task wakes per event),
    and the engine sockets stop being read while more than WRITE_HIGH bytes wait for a slow client."""

    __slots__ = (
        "answers",
        "arrived",
        "chunked",
        "events",
        "first_output",
        "lease",
        "metrics",
        "on_events",
        "out",
        "request",
        "resp",
        "tail",
    )

    def __init__(
        self,
        request: web.Request,
        answers: Sequence[EngineResponse],
        metrics: EndpointMetrics,
        arrived: float,
        first_output: Callable[[], None] | None,
        lease: DecodeLease,
        on_events: Callable[[int, bytes], None] | None = None,
    ) -> None:
        self.request = request
        self.lease = lease
        self.on_events = on_events  # told the answer's event count and tail once it was read whole
        self.tail = b""  # the last block of events other than a lone [DONE]: where usage counts are
        self.answers = answers
        self.metrics = metrics
        self.arrived = arrived
        self.first_output = first_output  # None once the first event went out
        self.events = 0
        self.resp = web.StreamResponse(status=200)
        self.out: asyncio.Transport | None = None
        self.chunked = False

    async def start(self, headers: dict[str, str]) -> bool:
        """Send the head; False when the client is gone already (closing the answers tells the engines)."""
        self.resp.headers.update(
            {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await self.resp.prepare(self.request)
        out = self.request.transport
        if out is None or out.is_closing():
            return False
        self.out = out
        # aiohttp chose the framing in prepare(): chunked for HTTP/1.1, until-close for HTTP/1.0.
        self.chunked = self.resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        return True

    def write(self, data: bytes) -> None:
        """Write events (from an engine socket's callback)."""
        out = self.out
        assert out is not None
        if self.first_output is not None:
            self.metrics.ttft.observe(time.perf_counter() - self.arrived)
            self.first_output()
            self.first_output = None
        if out.is_closing():
            for a in self.answers:
                a.abort(EngineError("the client went away", kind="aborted"))
            return
        if data:
            self.events += data.count(b"data:")
            out.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
            if out.get_write_buffer_size() > WRITE_HIGH:
                for a in self.answers:
                    a.pause()
                self.lease.end_unseen()

    async def finish(self, tail: Callable[[], bytes] = lambda: b"") -> web.StreamResponse:
        """Until every answer is complete (waiting for a slow client when asked to), then the end of
        the stream; an engine failure on the way becomes an SSE error event."""
        out = self.out
        assert out is not None
        try:
            for answer in self.answers:
                while True:
                    await answer.wait()
                    if not answer.paused:
                        break
                    # The client reads slower than the engines write: stop reading the engines.
                    await self.request.writer.drain()  # returns once the transport has room again
                    for a in self.answers:
                        a.resume()
        except (EngineError, OSError) as exc:
            for a in self.answers:
                a.abort(EngineError("another part of the answer failed", kind="aborted"))
            if out.is_closing():
                return self.resp
            # Headers are gone already: the error becomes an SSE event and the stream ends.
            await self.resp.write(sse_error(f"decode stream failed: {exc}"))
        else:
            # Every engine answer is complete: release the lease before the end drains to the client.
            self.lease.release()
            if self.on_events is not None:
                self.on_events(self.events, self.tail)
            self.write(tail())
        self.metrics.tokens.inc(self.events)
        self.metrics.ok.inc()
        if not out.is_closing():
            await self.resp.write_eof()
        return self.resp


async def relay_stream(
    request: web.Request,
    answer: EngineResponse,
    headers: dict[str, str],
    metrics: EndpointMetrics,
    arrived: float,
    first_output: Callable[[], None],
    lease: DecodeLease = NO_LEASE,
    on_events: Callable[[int, bytes], None] | None = None,
) -> web.StreamResponse:
    """``on_events(n, tail)``: the engine's whole answer was relayed in ``n`` SSE events (one per token
    and choice, plus a few) ending with ``tail`` (its last block but a lone ``[DONE]``, where the
    engines put their token counts): what the token charge learns from."""
    stream = _Stream(request, (answer,), metrics, arrived, first_output, lease, on_events)
    if not await stream.start(headers):
        return stream.resp
    out = stream.out
    assert out is not None
    chunked = stream.chunked
    first = True

    # The hot path of a streamed answer, so its own closure: one engine, no merging.
    def sink(data: bytes) -> None:
        nonlocal first
        if first:
            first = False
            metrics.ttft.observe(time.perf_counter() - arrived)
            first_output()
        if out.is_closing():
            answer.abort(EngineError("the client went away", kind="aborted"))
            return
        stream.events += data.count(b"data:")
        if len(data) > 16:  # not "data: [DONE]" alone
            stream.tail = data
        out.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
        if out.get_write_buffer_size() > WRITE_HIGH:
            answer.pause()
            lease.end_unseen()

    stream.first_output = None
    answer.relay(sink)
    return await stream.finish()


async def relay_parts_stream(
    request: web.Request,
    kind: str,
    parts: list[Part],
    answers: Sequence[EngineResponse],
    headers: dict[str, str],
    metrics: EndpointMetrics,
    arrived: float,
    first_output: Callable[[], None],
    lease: DecodeLease = NO_LEASE,
) -> web.StreamResponse:
    """The streams of a split request as one: events rewritten by a ``StreamMerger``."""
    stream = _Stream(request, answers, metrics, arrived, first_output, lease)
    if not await stream.start(headers):
        return stream.resp
    merger = StreamMerger(kind, parts)

    def sink(index: int) -> Callable[[bytes], None]:
        return lambda data: stream.write(merger.feed(index, data))

    for i, answer in enumerate(answers):
        answer.relay(sink(i))
    return await stream.finish(merger.finish)
