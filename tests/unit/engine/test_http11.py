"""The sans-I/O HTTP/1.1 response parser, fed without sockets: whole, byte by byte, at any split."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmaster.engine.http11 import END, Event, Head, ParseError, ResponseParser

BODY = (b"data: one\n\n", b"data: two\n\n", b"x" * 300, b"data: [DONE]\n\n")


def chunked(trailer: bytes = b"") -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    out += b"Transfer-Encoding: chunked\r\n\r\n"
    for i, part in enumerate(BODY):
        out += b"%x%s\r\n%s\r\n" % (len(part), b";ext=1" if i == 1 else b"", part)
    return out + b"0\r\n" + trailer + b"\r\n"


def feed_all(pieces: list[bytes], eof: bool = False) -> tuple[ResponseParser, list[Event]]:
    p = ResponseParser()
    p.start()
    events: list[Event] = []
    for piece in pieces:
        events += p.feed(piece)
    if eof:
        events += p.feed_eof()
    return p, events


def summary(events: list[Event]) -> tuple[list[int], bytes, int]:
    heads = [e.status for e in events if isinstance(e, Head)]
    body = b"".join(e for e in events if isinstance(e, bytes))
    return heads, body, sum(1 for e in events if e is END)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@pytest.mark.parametrize("trailer", [b"", b"X-Trailer: 1\r\n"])
def test_chunked_byte_by_byte(trailer: bytes) -> None:
    data = chunked(trailer)
    p, events = feed_all([data[i : i + 1] for i in range(len(data))])
    assert summary(events) == ([200], b"".join(BODY), 1)
    assert p.done and p.reusable
    head = next(e for e in events if isinstance(e, Head))
    assert head.content_type == "text/event-stream" and head.keep_alive


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=20))
def test_chunked_at_any_split(cuts: list[int]) -> None:
    p, events = feed_all(split(chunked(), cuts))
    assert summary(events) == ([200], b"".join(BODY), 1)
    assert events[-1] is END and p.reusable


def test_content_length_and_bytes_after_it_make_the_connection_unusable() -> None:
    data = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    p, events = feed_all([data[i : i + 1] for i in range(len(data))])
    assert summary(events) == ([200], b"hello", 1) and p.reusable
    p, events = feed_all([data + b"EXTRA"])
    assert summary(events) == ([200], b"hello", 1) and not p.reusable


def test_body_until_close_ends_with_eof() -> None:
    p, events = feed_all([b"HTTP/1.1 200 OK\r\n\r\npart1", b"part2"])
    assert summary(events) == ([200], b"part1part2", 0) and p.until_eof
    assert p.feed_eof() == [END] and p.done and not p.reusable


def test_interim_heads_are_skipped_and_empty_statuses_end_at_once() -> None:
    _, events = feed_all(
        [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: x\r\n\r\n", b"HTTP/1.1 204 No\r\n\r\n"]
    )
    assert summary(events) == ([204], b"", 1)


def test_connection_close_and_http10_are_not_reusable() -> None:
    p, _ = feed_all([b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"])
    assert p.done and not p.reusable
    p, _ = feed_all([b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx"])
    assert p.done and not p.reusable


def test_a_new_response_after_start() -> None:
    p, _ = feed_all([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx"])
    p.start()
    assert summary(p.feed(b"HTTP/1.1 500 Oops\r\nContent-Length: 2\r\n\r\nno")) == ([500], b"no", 1)


@pytest.mark.parametrize(
    "data",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabcd",
        b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * 70_000,
    ],
)
def test_malformed_responses_raise(data: bytes) -> None:
    p = ResponseParser()
    p.start()
    with pytest.raises(ParseError):
        p.feed(data)


def test_a_cut_response_is_an_error_at_eof() -> None:
    p, _ = feed_all([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"])
    with pytest.raises(ParseError):
        p.feed_eof()
