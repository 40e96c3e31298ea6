"""Relaying D's answer to the client: whole, or as a stream with back-pressure.

A streamed answer is written to the client's transport from the engine socket's callback: no task
wakes per event. When more than :data:`WRITE_HIGH` bytes wait for a slow client, the engine socket
stops being read until the client catches up. An engine failure after the first byte cannot change
the status any more: it becomes an SSE error event and the stream ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

from aiohttp import web

from pdmaster.api import error_body
from pdmaster.engine import EngineError, EngineResponse
from pdmaster.fanout import Part, StreamMerger, merge_bodies
from pdmaster.metrics import EndpointMetrics

__all__ = ["WRITE_HIGH", "relay_body", "relay_parts_body", "relay_parts_stream", "relay_stream", "sse_error"]

# Stop reading the engine above this many bytes queued for the client.
WRITE_HIGH = 256 * 1024


def sse_error(message: str, type_: str = "upstream_error", code: str = "upstream_failed") -> bytes:
    return (
        b"data: " + json.dumps(error_body(message, type_=type_, code=code)).encode() + b"\n\ndata: [DONE]\n\n"
    )


async def relay_body(
    answer: EngineResponse,
    headers: dict[str, str],
    metrics: EndpointMetrics,
    arrived: float,
    first_output: Callable[[], None],
) -> web.Response:
    body = await answer.read()
    metrics.ttft.observe(time.perf_counter() - arrived)
    first_output()
    metrics.ok.inc()
    return web.Response(body=body, content_type="application/json", headers=headers)


async def relay_stream(
    request: web.Request,
    answer: EngineResponse,
    headers: dict[str, str],
    metrics: EndpointMetrics,
    arrived: float,
    first_output: Callable[[], None],
) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)  # a StreamResponse sends its head here
    out = request.transport
    if out is None or out.is_closing():
        return resp  # the client is gone; closing the answer tells the engine
    # aiohttp chose the framing in prepare(): chunked for HTTP/1.1, until-close for HTTP/1.0.
    chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
    first = True
    events = 0

    # The head went out through aiohttp, and write_eof() below ends the body.
    def sink(data: bytes) -> None:
        nonlocal first, events
        if first:
            first = False
            metrics.ttft.observe(time.perf_counter() - arrived)
            first_output()
        if out.is_closing():
            answer.abort(EngineError("the client went away", kind="aborted"))
            return
        events += data.count(b"data:")
        out.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
        if out.get_write_buffer_size() > WRITE_HIGH:
            answer.pause()

    answer.relay(sink)
    try:
        while True:
            await answer.wait()
            if not answer.paused:
                break
            # The client reads slower than the engine writes: stop reading the engine.
            await request.writer.drain()  # returns once the transport has room again
            answer.resume()
    except (EngineError, OSError) as exc:
        if out.is_closing():
            return resp
        # Headers are gone already: the error becomes an SSE event and the stream ends.
        await resp.write(sse_error(f"decode stream failed: {exc}"))
    metrics.tokens.inc(events)
    metrics.ok.inc()
    if not out.is_closing():
        await resp.write_eof()
    return resp


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
    metrics.ttft.observe(time.perf_counter() - arrived)
    first_output()
    metrics.ok.inc()
    return web.Response(body=body, content_type="application/json", headers=headers)


async def relay_parts_stream(
    request: web.Request,
    kind: str,
    parts: list[Part],
    answers: Sequence[EngineResponse],
    headers: dict[str, str],
    metrics: EndpointMetrics,
    arrived: float,
    first_output: Callable[[], None],
) -> web.StreamResponse:
    """The streams of a split request as one stream: events rewritten by a ``StreamMerger``."""
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    out = request.transport
    if out is None or out.is_closing():
        return resp
    chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
    merger = StreamMerger(kind, parts)
    first = True
    events = 0

    def write(data: bytes) -> None:
        nonlocal events
        if data:
            events += data.count(b"data:")
            out.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)

    def sink_for(index: int) -> Callable[[bytes], None]:
        def sink(data: bytes) -> None:
            nonlocal first
            if first:
                first = False
                metrics.ttft.observe(time.perf_counter() - arrived)
                first_output()
            if out.is_closing():
                for a in answers:
                    a.abort(EngineError("the client went away", kind="aborted"))
                return
            write(merger.feed(index, data))
            if out.get_write_buffer_size() > WRITE_HIGH:
                for a in answers:
                    a.pause()

        return sink

    for i, answer in enumerate(answers):
        answer.relay(sink_for(i))
    try:
        for answer in answers:
            while True:
                await answer.wait()
                if not answer.paused:
                    break
                await request.writer.drain()
                for a in answers:
                    a.resume()
    except (EngineError, OSError) as exc:
        for a in answers:
            a.abort(EngineError("another part of the request failed", kind="aborted"))
        if out.is_closing():
            return resp
        await resp.write(sse_error(f"decode stream failed: {exc}"))
        return resp
    write(merger.finish())
    metrics.tokens.inc(events)
    metrics.ok.inc()
    if not out.is_closing():
        await resp.write_eof()
    return resp
