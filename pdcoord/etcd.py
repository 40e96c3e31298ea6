"""A small async etcd adapter (over etcd3aio) with the few operations pdcoord needs.

Everything etcd-specific that masters and agents use goes through :class:`EtcdClient` (keys under
a lease are built on it in :mod:`pdcoord.registration`), so the client library could be swapped by
rewriting this one module. Errors from the library and from gRPC are re-raised as
:class:`EtcdError` (or :class:`EtcdUnavailable` when etcd cannot be reached), naming the endpoints.

Two things are implemented here rather than taken from etcd3aio, on purpose:

* the prefix watch tracks the revision of the last *event* it delivered and resumes from the next
  one, so a reconnect never skips events (etcd3aio resumes from the response header revision, which
  for the creation response and for catch-up batches is ahead of the events actually delivered);
* lease keep-alive is one request and its answer at a time on a long-lived stream that a late
  answer does not end (:class:`LeaseRenewer`), so the keeper in :mod:`pdcoord.registration` can
  retry through an outage and report a lost lease (etcd3aio's ``LeaseKeepalive`` stops silently).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn

import etcd3aio
import grpc
import grpc.aio
from etcd3aio import Etcd3Client, prefix_range_end
from etcd3aio._protobuf import (
    LeaseKeepAliveRequest,
    LeaseStub,
    WatchCreateRequest,
    WatchRequest,
    WatchStub,
)
from etcd3aio.kv import KVService

_log = logging.getLogger(__name__)

# gRPC's default channel reconnect backoff grows to 120 s; after an etcd outage we want the channel
# back within half a second so that watches resume and membership converges quickly.
_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
WATCH_BACKOFF_INITIAL = 0.05
WATCH_BACKOFF_MAX = 0.5
_FATAL_CODES = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
)


_AUTH_FAILURES = (
    "authentication failed",
    "permission denied",
    "user name is empty",
    "invalid auth token",
    "user name not found",
)


class EtcdError(Exception):
    """Any failure talking to etcd."""


class EtcdUnavailable(EtcdError):
    """etcd did not answer (down, unreachable, or timed out)."""


class EtcdTLSError(EtcdError):
    """The TLS handshake with etcd failed (untrusted certificate, wrong name, missing client cert).

    Not an outage: retrying does not help, so this is not an :class:`EtcdUnavailable`.
    """


class EtcdAuthError(EtcdError):
    """etcd refused our credentials or their permissions (auth enabled, wrong user or password)."""


class LeaseNotFound(EtcdError):
    """The lease named in a request no longer exists (expired or revoked)."""


class WatchCompacted(EtcdError):
    """The watch cannot resume: etcd compacted the history past the revision it needs.

    The caller must re-list the prefix (``get_prefix``) and watch again from the returned revision + 1.
    """

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class WatchRevisionReset(WatchCompacted):
    """etcd came back with an older revision than the watch had reached (its data was wiped or
    restored from a snapshot); events below the old revision would never be delivered. Re-list."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def json(self) -> Any:
        """The value decoded as JSON (ValueError with the key named if it is not JSON)."""
        try:
            return json.loads(self.value)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"etcd key {self.key!r} does not hold JSON: {exc}") from exc

    def text(self) -> str:
        return self.value.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int


def _to_bytes(data: bytes | str) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else data


def _decode_key(raw: bytes) -> str:
    return raw.decode("utf-8", errors="surrogateescape")


def _kv(pb: Any) -> KeyValue:
    return KeyValue(
        key=_decode_key(pb.key),
        value=bytes(pb.value),
        create_revision=int(pb.create_revision),
        mod_revision=int(pb.mod_revision),
        version=int(pb.version),
        lease=int(pb.lease),
    )


def _read_pem(data: bytes | str | Path | None) -> bytes | None:
    """TLS material given either as PEM bytes or as a path to a PEM file."""
    if data is None or isinstance(data, bytes):
        return data
    return Path(data).read_bytes()


class EtcdClient:
    """Async etcd client with the operations pdcoord needs. Use as ``async with EtcdClient([...]) as c``."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        timeout: float = 3.0,
        username: str | None = None,
        password: str | None = None,
        ca_cert: bytes | str | Path | None = None,
        cert_key: bytes | str | Path | None = None,
        cert_chain: bytes | str | Path | None = None,
    ) -> None:
        cleaned = [self._normalize_endpoint(e) for e in endpoints if e.strip()]
        if not cleaned:
            raise ValueError("at least one etcd endpoint (host:port) is required")
        if timeout <= 0:
            raise ValueError(f"etcd timeout must be positive, got {timeout}")
        if (username is None) != (password is None):
            raise ValueError("etcd username and password must be given together")
        self.endpoints = cleaned
        self.timeout = timeout
        self._username = username
        self._password = password
        self._tls = {
            "ca_cert": _read_pem(ca_cert),
            "cert_key": _read_pem(cert_key),
            "cert_chain": _read_pem(cert_chain),
        }
        self._client: Etcd3Client | None = None
        self._refresher: Any = None
        self._lease_stub: LeaseStub | None = None
        self._watch_stub: WatchStub | None = None

    @staticmethod
    def _normalize_endpoint(endpoint: str) -> str:
        e = endpoint.strip()
        for scheme in ("http://", "https://"):
            if e.startswith(scheme):
                e = e[len(scheme) :]
        e = e.rstrip("/")
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {endpoint!r} must look like HOST:PORT")
        return e

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)})"

    @property
    def where(self) -> str:
        return "etcd at " + ",".join(self.endpoints)

    # ---------------------------------------------------------------- lifecycle

    async def connect(self) -> None:
        """Open the channel (lazily: no request is sent unless credentials need a token)."""
        if self._client is not None:
            return
        client = Etcd3Client(
            self.endpoints,
            watch_reconnect_backoff_seconds=WATCH_BACKOFF_INITIAL,
            watch_max_reconnect_backoff_seconds=WATCH_BACKOFF_MAX,
            ca_cert=self._tls["ca_cert"],
            cert_key=self._tls["cert_key"],
            cert_chain=self._tls["cert_chain"],
        )
        # etcd3aio builds the channel from these options in connect(); there is no public hook.
        client._manager.grpc_options.extend(_CHANNEL_OPTIONS)
        await client.connect()
        channel = client._channel
        assert channel is not None
        self._lease_stub = LeaseStub(channel)
        self._watch_stub = WatchStub(channel)
        self._client = client
        if self._username is not None and self._password is not None:
            try:
                with self._errors("authenticate"):
                    self._refresher = client.token_refresher(self._username, self._password)
                    await self._refresher.__aenter__()
            except BaseException:
                self._refresher = None
                await self.close()
                raise

    async def close(self) -> None:
        client, self._client = self._client, None
        refresher, self._refresher = self._refresher, None
        self._lease_stub = self._watch_stub = None
        if refresher is not None:
            with contextlib.suppress(Exception):
                await refresher.__aexit__(None, None, None)
        if client is not None:
            await client.close()

    async def __aenter__(self) -> EtcdClient:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._client is not None

    def _c(self) -> Etcd3Client:
        if self._client is None:
            raise EtcdError(f"{self.where}: client is not connected (call connect() first)")
        return self._client

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        client = self._c()
        meta = client.kv._metadata if client.kv is not None else ()
        return meta or None

    # ---------------------------------------------------------------- errors

    def _raise(self, op: str, exc: BaseException) -> NoReturn:
        text = f"{exc.details() or ''}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        low = text.lower()
        if "handshake failed" in low or "certificate_verify_failed" in low or "bad_certificate" in low:
            raise EtcdTLSError(
                f"{self.where}: {op} failed: TLS handshake with etcd failed (check the etcd CA, "
                f"client certificate and key, and that etcd serves TLS): {text}"
            ) from exc
        if any(m in low for m in _AUTH_FAILURES):
            raise EtcdAuthError(
                f"{self.where}: {op} failed: etcd refused the credentials (check the etcd user, "
                f"password and the user's role permissions): {text}"
            ) from exc
        if isinstance(exc, TimeoutError):
            raise EtcdUnavailable(f"{self.where}: {op} timed out after {self.timeout:g} s") from exc
        if isinstance(exc, etcd3aio.EtcdConnectionError | etcd3aio.EtcdTransientError):
            raise EtcdUnavailable(f"{self.where}: {op} failed: {exc}") from exc
        if isinstance(exc, grpc.aio.AioRpcError):
            code, detail = exc.code(), exc.details() or ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise EtcdUnavailable(f"{self.where}: {op} failed: {code.name} ({detail})") from exc
            if "lease not found" in detail:
                raise LeaseNotFound(f"{self.where}: {op} failed: {detail}") from exc
            raise EtcdError(f"{self.where}: {op} failed: {code.name} ({detail})") from exc
        raise EtcdError(f"{self.where}: {op} failed: {type(exc).__name__}: {exc}") from exc

    @contextlib.contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        try:
            yield
        except EtcdError:
            raise
        except (etcd3aio.EtcdError, grpc.aio.AioRpcError, TimeoutError) as exc:
            self._raise(op, exc)

    # ---------------------------------------------------------------- KV

    async def get(self, key: str) -> KeyValue | None:
        with self._errors(f"get {key}"):
            kv = self._c().kv
            assert kv is not None
            resp = await kv.get(key, timeout=self.timeout)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under *prefix*, sorted by key, and the revision they were read at."""
        with self._errors(f"get prefix {prefix}"):
            kv = self._c().kv
            assert kv is not None
            resp = await kv.get(
                prefix,
                range_end=prefix_range_end(prefix),
                sort_order=etcd3aio.SortOrder.ASCEND,
                sort_target=etcd3aio.SortTarget.KEY,
                timeout=self.timeout,
            )
        return [_kv(x) for x in resp.kvs], int(resp.header.revision)

    async def put(self, key: str, value: bytes | str, *, lease: int = 0) -> int:
        """Write *key*; returns the revision of the write."""
        with self._errors(f"put {key}"):
            kv = self._c().kv
            assert kv is not None
            resp = await kv.put(key, _to_bytes(value), lease=lease, timeout=self.timeout)
        return int(resp.header.revision)

    async def create_if_absent(
        self, key: str, value: bytes | str, *, lease: int = 0
    ) -> tuple[bool, KeyValue | None]:
        """Atomically create *key* unless it exists.

        Returns ``(True, created)`` when this call created it, else ``(False, existing)``.
        """
        data = _to_bytes(value)
        with self._errors(f"create {key}"):
            kv = self._c().kv
            assert kv is not None
            resp = await kv.txn(
                compare=[KVService.txn_compare_create_revision(key, 0)],
                success=[KVService.txn_op_put(key, data, lease=lease)],
                failure=[KVService.txn_op_get(key)],
                timeout=self.timeout,
            )
        if resp.succeeded:
            rev = int(resp.header.revision)
            return True, KeyValue(key, data, rev, rev, 1, lease)
        kvs = resp.responses[0].response_range.kvs if resp.responses else []
        return False, (_kv(kvs[0]) if kvs else None)

    # ---------------------------------------------------------------- leases

    async def grant_lease(self, ttl: int) -> int:
        if ttl <= 0:
            raise ValueError(f"lease TTL must be a positive number of seconds, got {ttl}")
        with self._errors(f"grant lease (ttl {ttl} s)"):
            lease = self._c().lease
            assert lease is not None
            resp = await lease.grant(ttl, timeout=self.timeout)
        if resp.error:
            raise EtcdError(f"{self.where}: grant lease failed: {resp.error}")
        return int(resp.ID)

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke *lease_id*, deleting its keys at once. A lease that is already gone is not an error."""
        try:
            with self._errors(f"revoke lease {lease_id:x}"):
                lease = self._c().lease
                assert lease is not None
                await lease.revoke(lease_id, timeout=self.timeout)
        except LeaseNotFound:
            pass

    async def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL in seconds of *lease_id*, -1 if it does not exist any more."""
        with self._errors(f"lease TTL {lease_id:x}"):
            lease = self._c().lease
            assert lease is not None
            resp = await lease.time_to_live(lease_id, timeout=self.timeout)
        return int(resp.TTL) if resp.TTL > 0 else -1

    def renewer(self, lease_id: int) -> LeaseRenewer:
        """A :class:`LeaseRenewer` of *lease_id* on this client."""
        return LeaseRenewer(self, lease_id)

    # ---------------------------------------------------------------- watch & status

    async def watch_prefix(self, prefix: str, *, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Every change under *prefix* from *start_revision* on (0: from now), forever.

        Survives etcd restarts and connection loss: it reconnects (backoff capped at 0.5 s) and
        resumes right after the last event it yielded, so no event is lost or repeated. Raises
        :class:`WatchCompacted` when the history it needs is gone; the caller then re-lists.
        Typical use: ``kvs, rev = await c.get_prefix(p)`` then ``watch_prefix(p, start_revision=rev + 1)``.
        """
        if start_revision < 0:
            raise ValueError(f"start_revision must be >= 0, got {start_revision}")
        key = prefix.encode()
        range_end = prefix_range_end(key)
        next_rev = start_revision
        backoff = WATCH_BACKOFF_INITIAL
        failures = 0
        while True:
            self._c()
            stub = self._watch_stub
            assert stub is not None
            create = WatchCreateRequest(key=key, range_end=range_end, start_revision=next_rev)

            async def requests(req: Any = create) -> AsyncIterator[Any]:
                yield WatchRequest(create_request=req)
                await asyncio.Event().wait()  # keep the request side open until the call is cancelled

            call = stub.Watch(requests(), metadata=self._metadata())
            try:
                async for resp in call:
                    if resp.compact_revision > 0:
                        raise WatchCompacted(
                            f"{self.where}: watch on {prefix} cannot resume at revision {next_rev}: "
                            f"history compacted up to {resp.compact_revision}; re-list and watch again",
                            int(resp.compact_revision),
                        )
                    if resp.canceled:
                        raise EtcdError(f"{self.where}: watch on {prefix} canceled: {resp.cancel_reason}")
                    if resp.created:
                        if failures and 0 < int(resp.header.revision) + 1 < next_rev:
                            raise WatchRevisionReset(
                                f"{self.where}: etcd is at revision {resp.header.revision}, behind the "
                                f"{next_rev - 1} the watch on {prefix} had reached (data reset?); "
                                "re-list and watch again",
                                0,
                            )
                        if failures:
                            _log.info("watch on %s resumed at revision %d", prefix, next_rev)
                        failures, backoff = 0, WATCH_BACKOFF_INITIAL
                        if next_rev == 0:
                            # "from now": pin it so a reconnect does not skip what happened meanwhile
                            next_rev = int(resp.header.revision) + 1
                    for ev in resp.events:
                        kind: Literal["put", "delete"] = "delete" if ev.type == 1 else "put"
                        event = WatchEvent(
                            kind, _decode_key(ev.kv.key), bytes(ev.kv.value), int(ev.kv.mod_revision)
                        )
                        next_rev = event.mod_revision + 1
                        yield event
                reason = "stream closed by the server"
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _FATAL_CODES:
                    self._raise(f"watch {prefix}", exc)
                reason = f"{exc.code().name} ({exc.details()})"
            finally:
                call.cancel()
            failures += 1
            log = _log.warning if failures == 1 else _log.debug
            log("watch on %s interrupted: %s; reconnecting from revision %d", prefix, reason, next_rev)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, WATCH_BACKOFF_MAX)

    async def status(self) -> bool:
        """True when etcd answers a status request within the timeout."""
        try:
            with self._errors("status"):
                maint = self._c().maintenance
                assert maint is not None
                await maint.status(timeout=self.timeout, max_attempts=1)
            return True
        except EtcdError:
            return False


class LeaseRenewer:
    """Renews one lease over one long-lived ``LeaseKeepAlive`` stream: a renewal is one message each
    way. A stream per renewal made etcd set up and tear down a gRPC stream for every agent every
    TTL/3 seconds, its largest steady-state cost at a thousand nodes.

    A renewal whose answer is late fails (``timed out``) but leaves the stream open: a reader takes
    every answer off the stream in order, so the late answer still lands, and the next renewal waits
    for its own. Closing the stream on a late answer lost the requests already written and cost a
    cancelled stream and a new one per late answer, just when a loaded host or etcd is slowest. The
    stream is replaced only when it ends or fails, when a write does not go through, or when
    ``MAX_UNANSWERED`` renewals in a row found no answer (a stream etcd no longer serves).
    """

    MAX_UNANSWERED = 3

    def __init__(self, client: EtcdClient, lease_id: int) -> None:
        self.client = client
        self.lease_id = lease_id
        self._call: Any = None
        self._reader: asyncio.Task[BaseException | None] | None = None
        self._sent = 0  # requests written on the current stream
        self._answered = 0  # answers read on it
        self._ttl = 0  # in the newest answer
        self._progress = asyncio.Event()  # an answer came, or the stream ended

    async def renew(self) -> int:
        """Renew once; the TTL etcd reports (0 or less: the lease is gone)."""
        c = self.client
        c._c()
        op = f"keep-alive lease {self.lease_id:x}"
        with c._errors(op):
            if self._reader is not None and (self._reader.done() or self._call.done()):
                self.close()  # ended under us (etcd restarted, connection reset): a new one
            if self._sent - self._answered >= self.MAX_UNANSWERED:
                self.close()
            if self._call is None:
                stub = c._lease_stub
                assert stub is not None
                self._call = call = stub.LeaseKeepAlive(metadata=c._metadata())
                self._sent = self._answered = 0
                self._reader = asyncio.create_task(self._read(call), name=f"lease-answers-{self.lease_id:x}")
            call, reader = self._call, self._reader
            assert reader is not None
            written = False
            try:
                async with asyncio.timeout(c.timeout):
                    await call.write(LeaseKeepAliveRequest(ID=self.lease_id))
                    written = True
                    self._sent += 1
                    mine = self._sent
                    while self._answered < mine:
                        if reader.done():
                            self.close()
                            if (failure := reader.result()) is not None:
                                raise failure
                            raise EtcdUnavailable(f"{c.where}: {op}: stream closed without an answer")
                        self._progress.clear()
                        await self._progress.wait()
            except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                self.close()  # the stream finished between the check and the write
                raise EtcdUnavailable(f"{c.where}: {op}: stream ended ({exc})") from exc
            except BaseException:
                # A write cut short (a timeout cancels it, and with it the call) leaves no usable
                # stream; a late answer leaves the stream as it is.
                if not written:
                    self.close()
                raise
        return self._ttl

    async def _read(self, call: Any) -> BaseException | None:
        """Take every answer off ``call``; the stream's error when it fails (raised by the renewal
        waiting for an answer), None when it ends."""
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    return None
                self._answered += 1
                self._ttl = int(resp.TTL)
                self._progress.set()
        except grpc.aio.AioRpcError as exc:
            return exc
        finally:
            self._progress.set()

    def close(self) -> None:
        call, self._call = self._call, None
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        if call is not None:
            call.cancel()


__all__ = [
    "EtcdAuthError",
    "EtcdClient",
    "EtcdError",
    "EtcdTLSError",
    "EtcdUnavailable",
    "KeyValue",
    "LeaseNotFound",
    "LeaseRenewer",
    "WatchCompacted",
    "WatchEvent",
    "WatchRevisionReset",
]
