"""Riding out transient faults: capped, jittered exponential backoff and one log line per outage.

Masters and agents never exit because etcd or a peer is unreachable for a while (DESIGN §11): they
retry with :class:`Backoff` and exit only on a configuration error (:data:`FATAL_ETCD_ERRORS`).
Jitter matters at fleet scale: a thousand agents that lost etcd together must not come back in
lock-step.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from pdcoord.etcd import EtcdAuthError, EtcdClient, EtcdError, EtcdTLSError
from pdcoord.registration import AlreadyRegistered, Registration

# Retrying does not heal these: a wrong certificate or wrong credentials.
FATAL_ETCD_ERRORS: tuple[type[EtcdError], ...] = (EtcdTLSError, EtcdAuthError)


class Backoff:
    """Delays ``initial, 2·initial, …`` capped at ``maximum``, each scaled by a random ±``jitter``."""

    def __init__(
        self,
        initial: float = 0.2,
        maximum: float = 5.0,
        jitter: float = 0.5,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < initial <= maximum or not 0 <= jitter < 1:
            raise ValueError(f"bad backoff: initial {initial}, maximum {maximum}, jitter {jitter}")
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self._rng = rng
        self._current = initial

    def next(self) -> float:
        delay = self._current * (1.0 + self.jitter * (2.0 * self._rng() - 1.0))
        self._current = min(self._current * 2.0, self.maximum)
        return delay

    def reset(self) -> None:
        self._current = self.initial


class Outage:
    """Logs the first failure of an outage and its end; the tries in between only at DEBUG."""

    def __init__(self, logger: logging.Logger, what: str, level: int = logging.WARNING) -> None:
        self.log = logger
        self.what = what
        self.level = level
        self.failures = 0
        self._since = 0.0

    @property
    def ongoing(self) -> bool:
        return self.failures > 0

    def failed(self, exc: object, level: int | None = None) -> None:
        if self.failures == 0:
            self._since = time.monotonic()
            self.log.log(self.level if level is None else level, "%s: %s; retrying", self.what, exc)
        else:
            self.log.debug("%s: still failing (try %d): %s", self.what, self.failures + 1, exc)
        self.failures += 1

    def recovered(self) -> None:
        if self.failures:
            self.log.info(
                "%s: recovered after %d failed tries (%.1f s)",
                self.what,
                self.failures,
                time.monotonic() - self._since,
            )
        self.failures = 0


async def register_with_retry(
    etcd: EtcdClient,
    registration: Registration,
    logger: logging.Logger,
    *,
    held_wait: float = 0.0,
    before: Callable[[], Awaitable[None]] | None = None,
    backoff: Backoff | None = None,
) -> None:
    """Connect to etcd and register, for as long as etcd is unreachable.

    Raises only on a configuration error: TLS or credentials (:data:`FATAL_ETCD_ERRORS`), or the key
    still held by another live process after ``held_wait`` seconds of etcd saying so
    (:class:`AlreadyRegistered`). ``before`` runs after each successful connect (e.g. reading the
    stored epoch) and is retried with the rest.
    """
    backoff = backoff or Backoff()
    outage = Outage(logger, f"{etcd.where}: cannot register {registration.key}")
    held_since: float | None = None
    while True:
        try:
            await etcd.connect()
            if before is not None:
                await before()
            await registration.start(wait=0)
            outage.recovered()
            return
        except AlreadyRegistered as exc:
            outage.recovered()
            now = time.monotonic()
            if held_since is None:
                held_since = now
                if held_wait > 0:
                    logger.warning("%s; retrying for up to %.1f s", exc, held_wait)
            left = held_since + held_wait - now
            if left <= 0:
                raise
            await asyncio.sleep(min(0.5, max(0.01, left)))
            continue
        except FATAL_ETCD_ERRORS:
            raise
        except EtcdError as exc:
            outage.failed(exc)
        await asyncio.sleep(backoff.next())
