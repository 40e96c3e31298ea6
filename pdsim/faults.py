"""Injected engine faults: the settings, their validation, and the seeded error draw.

The settings are set at start by flags and changed at run time through ``/admin/faults``; a request
reads them once, when it arrives, so changing them affects new requests only (a stream that has
stalled stays stalled until its client goes away).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any


class FaultError(ValueError):
    """A fault update that is not valid; the message says why."""


@dataclass(frozen=True, slots=True)
class Faults:
    refuse: bool = False  # the main port stops listening
    error_rate: float = 0.0  # fraction of generation requests answered with error_status
    error_status: int = 503
    seed: int = 0  # seeds the error draw, so a given sequence of requests fails the same way
    hang: bool = False  # generation requests are accepted and never answered
    hang_after_chunks: int | None = None  # streams stop after this many tokens, connection kept
    slow: float = 1.0  # multiplier on every prefill and decode delay
    health_fail: bool = False  # /health answers 503

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def generation_stalls(self) -> bool:
        """Whether a one-token generation would produce no output (what SGLang's /health runs)."""
        return self.hang or self.hang_after_chunks == 0


FIELDS = tuple(f.name for f in dataclasses.fields(Faults))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(name: str, value: Any) -> Any:
    if name in ("refuse", "hang", "health_fail"):
        if not isinstance(value, bool):
            raise FaultError(f"'{name}' must be a boolean")
        return value
    if name == "error_rate":
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
            raise FaultError("'error_rate' must be a number between 0 and 1")
        return float(value)
    if name == "error_status":
        if not _is_int(value) or not 500 <= value <= 599:
            raise FaultError("'error_status' must be an integer between 500 and 599")
        return value
    if name == "seed":
        if not _is_int(value):
            raise FaultError("'seed' must be an integer")
        return value
    if name == "hang_after_chunks":
        if value is not None and (not _is_int(value) or value < 0):
            raise FaultError("'hang_after_chunks' must be null or an integer >= 0")
        return value
    if name == "slow":
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 1000:
            raise FaultError("'slow' must be a number in (0, 1000]")
        return float(value)
    raise AssertionError(name)


def updated(current: Faults, body: object, *, replace: bool) -> Faults:
    """``current`` with the fields of ``body`` set (``replace``: the others back to their defaults)."""
    if not isinstance(body, dict):
        raise FaultError("the body must be a JSON object of fault settings")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise FaultError(f"unknown fault setting(s) {unknown}; known: {list(FIELDS)}")
    changes: dict[str, Any] = {k: _check(k, v) for k, v in body.items()}
    base = Faults() if replace else current
    return dataclasses.replace(base, **changes)


class ErrorDraw:
    """Decides which requests get an injected error: a seeded stream, reset when the rate or seed is set."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def reset(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def fails(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        return self._rng.random() < rate
