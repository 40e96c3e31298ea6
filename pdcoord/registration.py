"""Keys held under a lease: a master's or a node agent's membership in etcd.

:class:`LeaseKeeper` renews one lease in its own loop, which keeps retrying through an etcd outage
and reports a lost lease (etcd3aio's ``LeaseKeepalive`` stops silently). :class:`Registration`
creates a key under its own lease with a create-if-absent transaction (:class:`AlreadyRegistered`
when someone else holds it) and re-creates it when the lease is lost. Everything here talks to etcd
through :class:`pdcoord.etcd.EtcdClient`.

What the holder can prove (:class:`LeaseClock`, pure). etcd says a lease is gone only when it answers;
a holder cut from etcd hears nothing and would believe itself registered forever, while etcd expires
its key after the TTL and everyone watching re-arranges around its absence. So the keeper also counts
for itself: etcd restarts a lease's TTL when a renewal reaches it, which is after the renewal was
sent, so the key lives at least until ``sent + TTL`` of the last renewal etcd confirmed (its send
time, not its answer's arrival: a late answer proves nothing about when etcd acted on it). A margin
before that moment the holder stops counting on its key (``held`` turns False) until a renewal is
confirmed again or, if etcd answers that the lease is gone, until the key is re-created.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdcoord.etcd import EtcdClient, EtcdError, EtcdUnavailable, KeyValue, LeaseNotFound, LeaseRenewer

_log = logging.getLogger(__name__)


class AlreadyRegistered(EtcdError):
    """The key is live under another holder's lease."""

    def __init__(self, key: str, holder: KeyValue | None, holder_ttl: int = -1) -> None:
        value = holder.text() if holder is not None else "?"
        if len(value) > 300:
            value = value[:300] + "..."
        expiry = f", its lease expires in {holder_ttl} s unless renewed" if holder_ttl >= 0 else ""
        lease = f" under lease {holder.lease:x}" if holder is not None and holder.lease else ""
        if holder is not None and not holder.lease:
            expiry = ", without a lease (it will not expire; delete it by hand if it is stale)"
        super().__init__(f"{key} is already registered{lease}{expiry}; current holder: {value}")
        self.key = key
        self.holder = holder
        self.holder_ttl = holder_ttl


def _to_bytes(data: bytes | str) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else data


async def _call_back(callback: Callable[[], object] | None, what: str) -> None:
    """Run a sync or async callback, logging (not raising) its failure."""
    if callback is None:
        return
    try:
        result = callback()
        if inspect.isawaitable(result):
            await result
    except Exception:
        _log.exception("%s callback failed", what)


Callback = Callable[[], object]


def _fire(callback: Callable[[bool], object] | None, value: bool, what: str) -> None:
    """Call a sync or async callback from a sync context (an async one runs as a task)."""
    if callback is None:
        return
    try:
        result = callback(value)
    except Exception:
        _log.exception("%s callback failed", what)
        return
    if inspect.isawaitable(result):

        async def wait() -> None:
            try:
                await result
            except Exception:
                _log.exception("%s callback failed", what)

        task = asyncio.get_running_loop().create_task(wait())
        _background.add(task)
        task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()


# Told whether the key can still be counted on (held), each time that flips.
HeldCallback = Callable[[bool], object]

# How long before the earliest moment etcd could expire a lease its holder stops counting on it: it
# covers a timer that fires late on a busy event loop and what is decided between the check and its
# effect. At most a quarter of the TTL, so that renewals every TTL/3 still leave room for a late answer.
MAX_LEASE_MARGIN_S = 0.5


def lease_margin(ttl: float) -> float:
    """The default margin for a lease of ``ttl`` seconds: ``min(0.5 s, ttl / 4)``."""
    return min(MAX_LEASE_MARGIN_S, ttl / 4)


@dataclass
class LeaseClock:
    """Until when a lease is surely alive in etcd, from the holder's side alone (pure, no clock of
    its own: the caller passes times from one monotonic clock).

    ``confirm(sent_at, ttl)``: a renewal (or the grant) sent at ``sent_at`` was answered with a TTL of
    ``ttl`` seconds. etcd acted on it after ``sent_at``, so the lease lives at least until
    ``expires_at = sent_at + ttl``; the holder counts on it until ``held_until = expires_at - margin``.
    A confirmation of a renewal sent before the latest one confirmed never moves ``confirmed_at`` back.
    """

    ttl: float
    margin: float
    confirmed_at: float = -math.inf
    # The TTL of the latest answer (etcd may grant more than was asked for, its minimum TTL, never
    # less): the smaller of it and ``ttl`` counts, which is never wrong.
    answered_ttl: float | None = None

    def __post_init__(self) -> None:
        if not self.ttl > 0:
            raise ValueError(f"lease TTL must be positive, got {self.ttl}")
        if not 0 <= self.margin < self.ttl:
            raise ValueError(f"lease margin must be in [0, ttl), got {self.margin} for ttl {self.ttl}")

    def confirm(self, sent_at: float, ttl: float | None = None) -> None:
        """A renewal sent at ``sent_at`` was answered with ``ttl`` (None: the TTL asked for)."""
        if ttl is not None and ttl > 0:
            self.answered_ttl = ttl
        if sent_at > self.confirmed_at:
            self.confirmed_at = sent_at

    @property
    def expires_at(self) -> float:
        """The earliest moment etcd may expire the lease (-inf before the first confirmation)."""
        ttl = self.ttl if self.answered_ttl is None else min(self.ttl, self.answered_ttl)
        return self.confirmed_at + ttl

    @property
    def held_until(self) -> float:
        """Until when the holder counts on the lease."""
        return self.expires_at - self.margin

    def held(self, now: float) -> bool:
        return now < self.held_until


class LeaseKeeper:
    """Keeps one lease alive in the background, renewing every ttl/3 seconds.

    Renewal failures (etcd down) are retried every few hundred milliseconds; when etcd answers that
    the lease is gone (TTL <= 0, e.g. it expired during an outage or was revoked) ``on_lost`` is
    called (sync or async) and the keeper stops.

    It also keeps a :class:`LeaseClock`: ``held`` is True only while the last confirmed renewal (or
    ``confirmed_at``, when the lease was granted) proves the lease alive with ``margin`` to spare.
    When that runs out without a renewal confirmed, ``on_held(False)`` is called at once (etcd may
    say nothing for a long time: it may be unreachable); when a renewal is confirmed again,
    ``on_held(True)``. The renewals go on throughout.
    """

    def __init__(
        self,
        client: EtcdClient,
        lease_id: int,
        ttl: int,
        *,
        on_lost: Callback | None = None,
        on_held: HeldCallback | None = None,
        interval: float | None = None,
        margin: float | None = None,
        confirmed_at: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``confirmed_at``: when the grant of the lease was sent (default: now, which is later than
        that and so gives the first renewal a little less room than it has). ``clock``: monotonic
        seconds (default ``time.monotonic``); the watchdog's timer runs on the event loop's clock."""
        if ttl <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl}")
        self.client = client
        self.lease_id = lease_id
        self.ttl = ttl
        self.interval = interval if interval is not None else ttl / 3
        self._clock = clock = clock or time.monotonic
        self.lease_clock = LeaseClock(float(ttl), lease_margin(ttl) if margin is None else margin)
        self.lease_clock.confirm(clock() if confirmed_at is None else confirmed_at)
        self._on_lost = on_lost
        self._on_held = on_held
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._alive = True
        self._held_reported = True  # what on_held was last told (True until told otherwise)
        self.last_renewed = clock()
        self.renewals = 0
        self.unconfirmed_spells = 0  # times the margin ran out before a renewal was confirmed

    @property
    def alive(self) -> bool:
        """False once etcd reported the lease gone."""
        return self._alive

    @property
    def held(self) -> bool:
        """The lease can still be counted on: etcd has not reported it gone and the last confirmed
        renewal proves it alive for at least ``margin`` more seconds."""
        return self._alive and self.lease_clock.held(self._clock())

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> LeaseKeeper:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"lease-keeper-{self.lease_id:x}")
            self._arm()
        return self

    async def stop(self) -> None:
        self._disarm()
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> LeaseKeeper:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the watchdog: the moment the last confirmation stops covering the lease ----------------
    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _arm(self) -> None:
        self._disarm()
        if not self._alive:
            return
        delay = self.lease_clock.held_until - self._clock()
        self._watchdog = asyncio.get_running_loop().call_later(max(0.0, delay), self._check_held)

    def _check_held(self) -> None:
        self._watchdog = None
        if not self._alive or self._task is None:
            return
        if self.lease_clock.held(self._clock()):
            self._arm()  # a renewal moved the deadline after this timer was set
            return
        if self._held_reported:
            self._held_reported = False
            self.unconfirmed_spells += 1
            _log.warning(
                "lease %x: no renewal confirmed for %.1f s (TTL %d s): not counting on it until etcd "
                "confirms it again",
                self.lease_id,
                self._clock() - self.lease_clock.confirmed_at,
                self.ttl,
            )
            _fire(self._on_held, False, f"lease {self.lease_id:x} on_held")

    def _confirmed(self, sent_at: float, ttl: int) -> None:
        self.lease_clock.confirm(sent_at, ttl)
        now = self._clock()
        self.last_renewed = now
        self.renewals += 1
        if self.lease_clock.held(now):
            if not self._held_reported:
                self._held_reported = True
                _log.warning("lease %x: renewal confirmed again; counting on it", self.lease_id)
                _fire(self._on_held, True, f"lease {self.lease_id:x} on_held")
            self._arm()

    # -- the renewals ---------------------------------------------------------------------------
    async def _run(self) -> None:
        renewer = self.client.renewer(self.lease_id)
        try:
            await self._renew_forever(renewer)
        finally:
            renewer.close()

    async def _renew_forever(self, renewer: LeaseRenewer) -> None:
        failures = 0
        retry = min(self.interval, 0.25)
        while True:
            started = self._clock()
            try:
                ttl = await renewer.renew()
            except EtcdError as exc:
                failures += 1
                if failures == 1:
                    _log.warning("lease %x: keep-alive failed (%s); retrying", self.lease_id, exc)
                await asyncio.sleep(retry)
                continue
            except Exception:
                _log.exception("lease %x: unexpected keep-alive failure; retrying", self.lease_id)
                await asyncio.sleep(retry)
                continue
            if ttl <= 0:
                self._alive = False
                self._disarm()
                _log.warning("lease %x is gone (expired or revoked)", self.lease_id)
                await _call_back(self._on_lost, f"lease {self.lease_id:x} on_lost")
                return
            if failures:
                _log.info("lease %x: keep-alive recovered after %d failed attempts", self.lease_id, failures)
                failures = 0
            self._confirmed(started, ttl)
            # Every interval from the last renewal's start, not its answer: a late answer (a busy
            # etcd or host) must not stretch the gap between renewals towards the TTL.
            await asyncio.sleep(max(0.0, started + self.interval - self.last_renewed))


class Registration:
    """A key held under its own lease and kept alive: a master's or a node agent's membership.

    ``start()`` creates the key with a create-if-absent transaction, so a live key of someone else
    is never overwritten (:class:`AlreadyRegistered`; with ``wait`` > 0 it retries until the other
    lease expires). When the lease is lost (etcd down longer than the TTL, or revoked) the key is
    re-created under a new lease automatically, retrying with backoff until etcd answers.

    ``held`` says whether the key can be counted on now (see :class:`LeaseKeeper`): it turns False
    as soon as the last confirmed renewal no longer proves the lease alive with a margin to spare,
    before etcd could expire it, and True again when etcd confirms the lease or the key is re-created
    under a new one. ``on_held(held)`` hears every flip after ``start()``.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        value: bytes | str | Callable[[], bytes | str],
        ttl: int,
        *,
        wait: float = 0.0,
        on_lost: Callback | None = None,
        on_restored: Callback | None = None,
        on_held: HeldCallback | None = None,
        retry_max_backoff: float = 2.0,
        margin: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl}")
        self.client = client
        self.key = key
        self.ttl = ttl
        self.wait = wait
        self._value = value
        self._on_lost = on_lost
        self._on_restored = on_restored
        self._on_held = on_held
        self._held_state = False  # what on_held was last told (the start is no flip)
        self._margin = margin
        self._clock = clock or time.monotonic
        self._retry_max_backoff = retry_max_backoff
        self._lease_id = 0
        self._keeper: LeaseKeeper | None = None
        self._regrant: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._stopped = False
        self.kv: KeyValue | None = None
        self.reregistrations = 0
        # Leases granted by this process whose create transaction's outcome is unknown.
        self._unsure: set[int] = set()

    @property
    def lease_id(self) -> int:
        """The current lease (0 when not registered)."""
        return self._lease_id

    @property
    def alive(self) -> bool:
        """True while the key is held under a lease that etcd has not reported lost."""
        return self._lease_id != 0 and self._keeper is not None and self._keeper.alive

    @property
    def held(self) -> bool:
        """Registered, and the lease proven alive by a confirmed renewal with a margin to spare."""
        return self._lease_id != 0 and self._keeper is not None and self._keeper.held

    @property
    def keeper(self) -> LeaseKeeper | None:
        return self._keeper

    def _report_held(self, held: bool) -> None:
        if self._stopped or held == self._held_state:
            return
        self._held_state = held
        _fire(self._on_held, held, f"registration {self.key} on_held")

    def _keeper_held(self, lease: int, held: bool) -> None:
        if lease == self._lease_id:  # not a keeper this registration has replaced
            self._report_held(held)

    def _value_bytes(self) -> bytes:
        value = self._value() if callable(self._value) else self._value
        return _to_bytes(value)

    async def _claim(self) -> tuple[bool, KeyValue | None]:
        """One attempt: create the key under a fresh lease. Returns (created, current holder)."""
        existing = await self.client.get(self.key)
        if existing is not None and existing.lease in self._unsure:
            # Our own earlier attempt did create the key, but its answer was lost (etcd slow or
            # restarting) and the lease could not be revoked then. It is not another live holder:
            # revoking it deletes the key, and this attempt claims it afresh.
            await self.client.revoke_lease(existing.lease)
            self._unsure.discard(existing.lease)
            existing = await self.client.get(self.key)
        if existing is not None:
            return False, existing
        sent = self._clock()  # etcd starts the lease's TTL after this
        lease = await self.client.grant_lease(self.ttl)
        try:
            ok, kv = await self.client.create_if_absent(self.key, self._value_bytes(), lease=lease)
        except BaseException:
            try:
                await self.client.revoke_lease(lease)
            except EtcdError:
                self._unsure.add(lease)
            raise
        if not ok:
            await self.client.revoke_lease(lease)
            return False, kv
        self._lease_id = lease
        self.kv = kv
        self._keeper = LeaseKeeper(
            self.client,
            lease,
            self.ttl,
            on_lost=self._lost,
            on_held=lambda held: self._keeper_held(lease, held),
            margin=self._margin,
            confirmed_at=sent,
            clock=self._clock,
        ).start()
        return True, kv

    async def start(self, *, wait: float | None = None) -> Registration:
        """Register; retry for up to *wait* seconds (default: the constructor's) while the key is held."""
        if self._lease_id:
            raise RuntimeError(f"{self.key} is already registered by this process")
        wait = self.wait if wait is None else wait
        deadline = time.monotonic() + max(0.0, wait)
        self._stopped = False
        announced = False
        while True:
            try:
                async with self._lock:
                    ok, holder = await self._claim()
                if ok:
                    _log.info("registered %s under lease %x (ttl %d s)", self.key, self._lease_id, self.ttl)
                    self._held_state = True
                    return self
                error: EtcdError = AlreadyRegistered(self.key, holder, await self._holder_ttl(holder))
            except EtcdUnavailable as exc:
                error = exc
            if time.monotonic() >= deadline:
                raise error
            if not announced:
                _log.warning("%s; retrying for up to %.1f s", error, max(0.0, deadline - time.monotonic()))
                announced = True
            await asyncio.sleep(min(0.5, max(0.01, deadline - time.monotonic())))

    async def _holder_ttl(self, holder: KeyValue | None) -> int:
        if holder is None or not holder.lease:
            return -1
        try:
            return await self.client.lease_ttl(holder.lease)
        except EtcdError:
            return -1

    def _lost(self) -> None:
        if self._stopped:
            return
        _log.warning("registration %s lost its lease %x; re-registering", self.key, self._lease_id)
        self._lease_id = 0
        self.kv = None
        self._report_held(False)
        if self._regrant is None or self._regrant.done():
            self._regrant = asyncio.create_task(self._reregister(), name=f"reregister-{self.key}")

    async def _reregister(self) -> None:
        await _call_back(self._on_lost, f"registration {self.key} on_lost")
        backoff = 0.1
        failures = 0
        while not self._stopped:
            try:
                async with self._lock:
                    if self._stopped:
                        return
                    if self._keeper is not None:
                        await self._keeper.stop()
                        self._keeper = None
                    ok, holder = await self._claim()
                if ok:
                    self.reregistrations += 1
                    _log.warning("re-registered %s under new lease %x", self.key, self._lease_id)
                    self._report_held(True)
                    await _call_back(self._on_restored, f"registration {self.key} on_restored")
                    return
                failures += 1
                if failures == 1:
                    _log.error("cannot re-register: %s", AlreadyRegistered(self.key, holder))
            except EtcdError as exc:
                failures += 1
                if failures == 1:
                    _log.warning("re-registering %s failed (%s); retrying", self.key, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._retry_max_backoff)

    async def update(self, value: bytes | str | Callable[[], bytes | str]) -> int | None:
        """Replace the value (kept for re-registrations too); re-put it under the current lease.

        Returns the revision of the write, or None when not registered at the moment (the new value
        is used when the key is re-created).
        """
        self._value = value
        async with self._lock:
            if not self.alive:
                return None
            data = self._value_bytes()
            try:
                rev = await self.client.put(self.key, data, lease=self._lease_id)
            except LeaseNotFound:
                lost = True
            else:
                lost = False
                old = self.kv
                created = old.create_revision if old else rev
                self.kv = KeyValue(
                    self.key, data, created, rev, old.version + 1 if old else 0, self._lease_id
                )
        if lost:
            self._lost()
            return None
        return rev

    async def stop(self, revoke: bool = True) -> None:
        """Stop keeping the key alive; with *revoke*, revoke the lease so the key disappears at once."""
        self._stopped = True
        regrant, self._regrant = self._regrant, None
        if regrant is not None and regrant is not asyncio.current_task():
            regrant.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await regrant
        async with self._lock:
            if self._keeper is not None:
                await self._keeper.stop()
                self._keeper = None
            lease, self._lease_id = self._lease_id, 0
            if revoke and lease:
                try:
                    await self.client.revoke_lease(lease)
                    _log.info("revoked lease %x of %s", lease, self.key)
                except EtcdError as exc:
                    _log.warning("could not revoke lease %x of %s (it will expire): %s", lease, self.key, exc)

    async def __aenter__(self) -> Registration:
        if not self._lease_id:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


__all__ = ["AlreadyRegistered", "LeaseKeeper", "Registration"]
