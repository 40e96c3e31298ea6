"""The admission vocabulary: request classes, a ticket and its states, and the outcome codes.

Every admission module speaks these; none of them decides anything. What a code means to a client
(HTTP status, message) is the adapter's business (``pdmaster.admission_controller``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = [
    "CANCELLED",
    "CANNOT_FIT_NOW",
    "CLASS_ORDER",
    "EVICTED",
    "EXPECTED_WAIT",
    "GRANTED",
    "HANDED_OFF",
    "INVALID",
    "NO_CAPACITY",
    "OUTCOMES",
    "QUEUE_FULL",
    "TIMEOUT",
    "TOO_MANY_TOKENS",
    "UNSATISFIABLE",
    "Reason",
    "RequestClass",
    "Ticket",
    "TicketState",
]


class RequestClass(enum.StrEnum):
    """Priority classes, highest first (see CLASS_ORDER)."""

    CONTINUATION = "continuation"
    PROBABLE_CACHE_HIT = "probable_cache_hit"
    COLD = "cold"


CLASS_ORDER: tuple[RequestClass, ...] = (
    RequestClass.CONTINUATION,
    RequestClass.PROBABLE_CACHE_HIT,
    RequestClass.COLD,
)
RANK: dict[RequestClass, int] = {c: i for i, c in enumerate(CLASS_ORDER)}


class TicketState(enum.StrEnum):
    QUEUED = "queued"
    GRANTED = "granted"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    EVICTED = "evicted"


# Outcome codes (also the Prometheus ``outcome`` label values).
GRANTED = "granted"
QUEUE_FULL = "queue_full"
TIMEOUT = "timeout"
EVICTED = "evicted"
CANCELLED = "cancelled"
UNSATISFIABLE = "unsatisfiable"
NO_CAPACITY = "no_capacity"
CANNOT_FIT_NOW = "cannot_fit_now"
INVALID = "invalid"
EXPECTED_WAIT = "expected_wait"  # refused at once: its expected wait exceeds its class's target
HANDED_OFF = "handed_off"  # left the queue for a peer master's free room (pdmaster/spill.py)
TOO_MANY_TOKENS = "too_many_tokens"  # its KV-token charge exceeds every decode node's whole pool
OUTCOMES: tuple[str, ...] = (
    GRANTED,
    QUEUE_FULL,
    TIMEOUT,
    EVICTED,
    CANCELLED,
    UNSATISFIABLE,
    NO_CAPACITY,
    CANNOT_FIT_NOW,
    INVALID,
    EXPECTED_WAIT,
    HANDED_OFF,
    TOO_MANY_TOKENS,
)
# Codes that no retry can change (no retry hint).
FINAL_CODES = frozenset((UNSATISFIABLE, INVALID, TOO_MANY_TOKENS))


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a ticket did not get (or lost) its place: an outcome code and a retry hint (None: never retry)."""

    code: str
    retry_after_s: float | None


# Where a queued ticket lives (``Ticket._loc``).
LOC_NOWHERE = 0
LOC_HEAD = 1  # among its class's eligible heads (pdmaster.admission_queue)
LOC_WAIT = 2  # in its session's deque, behind the session's lease or an older request
LOC_GANG = 3  # the ticket DRR picked that does not fit yet (pdmaster.backfill)
LOC_RETRY = 4  # among the queued resubmissions
NO_AVOID: frozenset[str] = frozenset()


class Ticket:
    """One request's claim on ``slots`` decode slots and ``tokens`` KV tokens (its charge against the
    node's pool, DESIGN §13; 0: none) on a single node. The admission core mutates it in place."""

    __slots__ = (
        "_loc",
        "avoid",
        "deadline",
        "ended_at",
        "enqueued_at",
        "granted_at",
        "id",
        "node",
        "reason",
        "released",
        "request_class",
        "sent",
        "sent_gen",
        "session_id",
        "slots",
        "state",
        "tokens",
        "unseen",
    )

    def __init__(
        self,
        tid: int,
        slots: int,
        request_class: RequestClass,
        session_id: str | None,
        now: float,
        tokens: int = 0,
    ) -> None:
        self.id = tid  # also the arrival order
        self.slots = slots
        self.tokens = tokens
        self.request_class = request_class
        self.session_id = session_id
        self.state = TicketState.QUEUED
        self.node: str | None = None
        self.reason: Reason | None = None
        self.enqueued_at = now
        self.deadline = math.inf
        self.granted_at: float | None = None
        self.ended_at: float | None = None
        self.released = False
        # Its decode request went out to the engine (AdmissionCore.decode_sent), between the node's
        # Acks number sent_gen and sent_gen + 1 (pdmaster.ack_ledger).
        self.sent = False
        self.sent_gen = 0
        # The master no longer sees when this lease's decode ends (see AdmissionCore.end_unseen).
        self.unseen = False
        self.avoid = NO_AVOID  # nodes this ticket is never placed on
        self._loc = LOC_NOWHERE

    @property
    def wait_s(self) -> float | None:
        if self.granted_at is not None:
            return self.granted_at - self.enqueued_at
        if self.ended_at is not None:
            return self.ended_at - self.enqueued_at
        return None

    def __repr__(self) -> str:
        extra = f" node={self.node}" if self.node else (f" reason={self.reason.code}" if self.reason else "")
        tok = f" tokens={self.tokens}" if self.tokens else ""
        return (
            f"Ticket(#{self.id} {self.request_class.name} n={self.slots}{tok} "
            f"session={self.session_id} {self.state.value}{extra})"
        )
