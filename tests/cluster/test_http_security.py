"""The master's HTTP surface under hostile input: API keys, the admin listener, size limits, and a
hypothesis fuzz of headers and bodies that must never produce a 5xx. Real master, agents and
simulated engines on loopback."""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcoord.dev.cluster import LocalCluster, Master
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.netutil import free_port
from pdmaster.main import build_parser
from tests.conftest import EtcdEndpoint

pytestmark = pytest.mark.cluster

KEY_FLAG, KEY_FILE = "key-from-flag-0123456789", "key-from-file-abcdef"
MAX_BODY = 64 * 1024


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    port: int,
    method: str,
    path: str,
    *,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    read_body: bool = True,
) -> Reply:
    """One request over a fresh socket, bytes exactly as given (no client-side validation)."""
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers or []]
    if body or method in ("POST", "PUT"):
        head.append(f"Content-Length: {len(body)}")
    raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        if read_body:
            while chunk := s.recv(65536):
                data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if hdrs.get("transfer-encoding") == "chunked":
        rest = _unchunk(rest)
    return Reply(status, hdrs, rest)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def bearer(key: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}"), ("Content-Type", "application/json")]


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


@dataclass
class Stack:
    master: Master
    admin_port: int

    @property
    def port(self) -> int:
        return self.master.http_port


@pytest.fixture(scope="module")
def stack(etcd: EtcdEndpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("http-security")
    keys_file = base / "api-keys"
    keys_file.write_text(f"# API keys, one per line\n\n{KEY_FILE}\n")
    group = ProcessGroup(base / "logs", handle_signals=False)
    try:
        cluster = LocalCluster(group, etcd.endpoint, f"httpsec-{os.getpid()}-{random.randrange(1 << 30)}")
        admin_port = free_port()
        master = cluster.start_master(
            "m1",
            api_key=KEY_FLAG,
            api_keys_file=str(keys_file),
            admin_host="127.0.0.1",
            admin_port=admin_port,
            max_body_bytes=MAX_BODY,
            max_tokens=64,
            max_n=2,
            max_header_bytes=4096,
        )
        cluster.start_node("p1", "prefill", 4)
        cluster.start_node("d1", "decode", 4)
        cluster.wait_for(lambda: http(master.http_port, "GET", "/readiness").status == 200, timeout=20)
        yield Stack(master, admin_port)
        log = Path(master.proc.log_path).read_text(errors="replace")
        assert "Traceback" not in log and "Error handling request" not in log, log[-4000:]
    finally:
        group.close()


def _assert_openai_401(r: Reply, code: str) -> None:
    assert r.status == 401, (r.status, r.body[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert err["code"] == code and err["type"] == "authentication_error" and err["param"] is None
    assert r.headers.get("www-authenticate") == "Bearer"


def test_api_keys(stack: Stack) -> None:
    p = stack.port
    _assert_openai_401(http(p, "POST", "/v1/chat/completions", body=CHAT), "missing_api_key")
    _assert_openai_401(
        http(p, "POST", "/v1/chat/completions", headers=bearer("nope"), body=CHAT), "invalid_api_key"
    )
    # a prefix or an extension of a real key is not the key
    for near in (KEY_FLAG[:-1], KEY_FLAG + "x", KEY_FLAG.upper(), ""):
        r = http(p, "POST", "/v1/chat/completions", headers=bearer(near), body=CHAT)
        _assert_openai_401(r, "invalid_api_key")
    basic = [("Authorization", f"Basic {KEY_FLAG}")]
    _assert_openai_401(http(p, "GET", "/v1/models", headers=basic), "invalid_api_key")
    _assert_openai_401(http(p, "GET", "/v1/models"), "missing_api_key")

    for key in (KEY_FLAG, KEY_FILE):
        r = http(p, "POST", "/v1/chat/completions", headers=bearer(key), body=CHAT)
        assert r.status == 200, (r.status, r.body[:300])
        assert r.json()["choices"][0]["message"]["content"]
    lower = [("authorization", f"bearer {KEY_FILE}")]  # scheme and header name are case-insensitive
    assert http(p, "GET", "/v1/models", headers=lower).status == 200

    # probes stay open
    assert http(p, "GET", "/health").status == 200
    assert http(p, "GET", "/readiness").status == 200


def test_admin_listener(stack: Stack) -> None:
    p, a = stack.port, stack.admin_port
    # gone from the public port (with or without a key)
    assert http(p, "GET", "/metrics", headers=bearer(KEY_FLAG)).status == 404
    assert http(p, "GET", "/admission", headers=bearer(KEY_FLAG)).status == 404
    _assert_openai_401(http(p, "GET", "/metrics"), "missing_api_key")
    # served on the admin port, which carries no data plane
    assert b"pdcoord_" in http(a, "GET", "/metrics").body
    snap = http(a, "GET", "/admission").json()
    assert snap["capacity"] == 4 and {n["node_id"] for n in snap["nodes"]} == {"p1", "d1"}
    assert http(a, "POST", "/v1/chat/completions", headers=bearer(KEY_FLAG), body=CHAT).status == 404
    assert http(a, "GET", "/health").status == 200


def test_size_limits(stack: Stack) -> None:
    p = stack.port
    big = json.dumps({"messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode()
    r = http(p, "POST", "/v1/chat/completions", headers=bearer(KEY_FLAG), body=big)
    assert r.status == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    r = http(p, "GET", "/health", headers=[("X-Big", "y" * 5000)])
    assert r.status in (400, 431), r.status
    r = http(p, "GET", "/health", headers=[(f"X-H{i}", "v") for i in range(200)])
    assert r.status in (400, 431), r.status
    r = http(p, "GET", "/health?" + "q" * 5000)
    assert r.status in (400, 414), r.status

    def chat(**kw: Any) -> Reply:
        body = {"messages": [{"role": "user", "content": "hi"}], **kw}
        return http(
            p, "POST", "/v1/chat/completions", headers=bearer(KEY_FLAG), body=json.dumps(body).encode()
        )

    for field, value in (("n", 3), ("max_tokens", 65), ("max_completion_tokens", 10**12)):
        r = chat(**{field: value})
        assert r.status == 400 and r.json()["error"]["param"] == field, r.body
    assert chat(n=2, max_tokens=2).status == 200
    assert http(p, "GET", "/health").status == 200


def test_malformed_headers_get_4xx(stack: Stack) -> None:
    # a non-UTF-8 Expect value used to make aiohttp answer 500 (found by the fuzz below)
    for path in ("/v1/chat/completions", "/no-such-route"):
        r = http(stack.port, "POST", path, headers=[*bearer(KEY_FLAG), ("Expect", "\x80\xff")], body=CHAT)
        assert r.status == 417, (path, r.status, r.body)
    r = http(stack.port, "GET", "/health", headers=[("Bad Header", "x")])
    assert r.status == 400
    # a body that is not the gzip it claims to be
    gz = [*bearer(KEY_FLAG), ("Content-Encoding", "gzip")]
    r = http(stack.port, "POST", "/v1/chat/completions", headers=gz, body=b"not gzip at all")
    assert r.status == 400, (r.status, r.body)


def test_api_keys_from_environment_and_help_hides_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDMASTER_API_KEY", "env-key-1, env-key-2")
    monkeypatch.setenv("PDMASTER_ETCD_PASSWORD", "env-password")
    parser = build_parser()
    args = parser.parse_args(["--master-id", "m"])
    assert args.api_key == ["env-key-1", "env-key-2"] and args.etcd_password == "env-password"
    assert build_parser().parse_args(["--master-id", "m", "--api-key", "k3"]).api_key == [
        "env-key-1",
        "env-key-2",
        "k3",
    ]
    text = parser.format_help()
    assert "PDMASTER_API_KEY" in text and "env-key-1" not in text and "env-password" not in text


# -- fuzz ---------------------------------------------------------------------------------------

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_HEADER_NAMES = [
    "Content-Type",
    "Accept",
    "X-Session-Id",
    "X-Request-Id",
    "Content-Encoding",
    "Accept-Encoding",
    "Authorization",
    "Expect",
    "Cookie",
    "Origin",
    "Range",
    "Upgrade",
]
header_names = st.one_of(st.sampled_from(_HEADER_NAMES), st.text(TOKEN_CHARS, min_size=1, max_size=30))
header_values = st.one_of(
    st.sampled_from(["application/json", "gzip", "deflate, br", "text/event-stream", "*/*", "100-continue",
                     "multipart/form-data; boundary=x", "websocket", "bytes=0-10", "null"]),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=300),
)  # fmt: skip
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
small_ints = st.one_of(st.integers(-3, 70), st.integers(), st.floats(), st.text(max_size=5), st.none())
content_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": json_values}))
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), json_values)},
    optional={"content": st.one_of(st.text(max_size=200), json_values, content_parts)},
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("m"), json_values),
        "messages": st.one_of(st.lists(message, max_size=3), json_values),
        "prompt": st.one_of(st.text(max_size=100), st.lists(st.integers(-5, 2**32), max_size=5), json_values),
        "text": st.one_of(st.text(max_size=100), json_values),
        "input_ids": st.one_of(st.lists(st.integers(-5, 2**32), max_size=5), json_values),
        "sampling_params": st.one_of(
            st.fixed_dictionaries({}, optional={"max_new_tokens": small_ints, "n": small_ints,
                                                "temperature": json_values}), json_values),
        "n": small_ints,
        "max_tokens": small_ints,
        "max_completion_tokens": small_ints,
        "stream": st.one_of(st.booleans(), json_values),
        "stream_options": json_values,
        "temperature": st.one_of(st.floats(), json_values),
        "top_p": st.one_of(st.floats(), json_values),
    },
)  # fmt: skip
bodies = st.one_of(
    st.binary(max_size=400),
    json_values.map(lambda v: json.dumps(v).encode()),
    request_like.map(lambda v: json.dumps(v).encode()),
    request_like.map(lambda v: json.dumps(v).encode()[: max(1, len(json.dumps(v)) // 2)]),
)
auth = st.sampled_from([KEY_FLAG, KEY_FLAG, KEY_FILE, "wrong", None])
paths = st.one_of(
    st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate", "/v1/models", "/health",
                     "/readiness", "/metrics", "/admission", "/", "/v1/chat/completions?x=1", "//v1/models"]),
    st.text("abcdefghijklmnopqrstuvwxyz0123456789/%._-~?=&", max_size=60).map(lambda s: "/" + s),
)  # fmt: skip


@settings(
    max_examples=1000 if os.environ.get("CI") else 150,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]),
    path=paths,
    key=auth,
    extra=st.lists(st.tuples(header_names, header_values), max_size=6),
    body=bodies,
)
def test_fuzz_http_api_never_5xx(
    stack: Stack, method: str, path: str, key: str | None, extra: list[tuple[str, str]], body: bytes
) -> None:
    headers = ([("Authorization", f"Bearer {key}")] if key else []) + [
        (k, v.strip()) for k, v in extra if k.lower() not in ("content-length", "transfer-encoding", "host")
    ]
    r = http(stack.port, method, path, headers=headers, body=body, read_body=method != "HEAD")
    assert r.status < 500, (r.status, r.body[:500])
