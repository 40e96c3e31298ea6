"""The priority a request carries to the engines (``--engine-priority``): its admission class, so
that an engine scheduling by priority prefills continuations first.

Why. Admission orders requests only until they are sent. A prefill engine runs the prompts it holds
first come first served, and several masters (or one master's earlier grants) may have filled it with
long cold prompts just before a continuation arrives: the continuation then waits behind them, past
its time-to-first-token target, although every master ranked it first. SGLang
(``--enable-priority-scheduling``) and vLLM (``--scheduling-policy priority``) order their waiting
queue by a request's top-level ``priority`` field; with this flag the master sets that field from the
class, so the engines keep the masters' order among whatever they hold, whoever sent it.

The value follows the engines' direction: ``high-first`` (SGLang's default) sends continuation 2,
probable cache hit 1, cold 0; ``low-first`` (vLLM, or SGLang with
``--schedule-low-priority-values-first``) sends 0, 1, 2. A client's own ``priority`` is replaced.
Off by default: vLLM refuses a non-zero priority (400) unless it schedules by priority.

``auto`` (what ``--ttft-slo`` chooses) asks each engine: a request carries a priority only when its
prefill and its decode engine both say they schedule by priority in the same direction, which their
agents put in the node's start arguments (``priority_scheduling``: ``high-first`` or ``low-first``;
SGLang's ``/get_server_info`` tells, for vLLM the operator passes ``--start-arg``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdmaster.admission import CLASS_ORDER, RequestClass
from pdmaster.engine import append_fields

__all__ = ["ORDERS", "START_ARG", "class_priorities", "node_priorities", "with_priority"]

ORDERS = ("off", "high-first", "low-first", "auto")
START_ARG = "priority_scheduling"  # a node's start argument: how its engine orders by priority


def class_priorities(order: str) -> dict[RequestClass, int] | None:
    """Each class's ``priority`` value for engines that serve ``order``; None for ``off``."""
    if order not in ORDERS:
        raise ValueError(f"--engine-priority must be one of {', '.join(ORDERS)}, got {order!r}")
    if order in ("off", "auto"):
        return None
    rank = {c: i for i, c in enumerate(CLASS_ORDER)}  # 0 = the highest class
    top = len(CLASS_ORDER) - 1
    return {c: (top - r if order == "high-first" else r) for c, r in rank.items()}


_TABLES = {order: class_priorities(order) for order in ("high-first", "low-first")}


def node_priorities(
    prefill: Mapping[str, str], decode: Mapping[str, str]
) -> Mapping[RequestClass, int] | None:
    """``auto``: the class priorities for a request sent to engines with these start arguments, or
    None when either does not schedule by priority (or they disagree on the direction)."""
    order = prefill.get(START_ARG)
    if order is None or order != decode.get(START_ARG):
        return None
    return _TABLES.get(order)


def with_priority(
    body: Mapping[str, Any], raw: bytes | None, value: int
) -> tuple[dict[str, Any], bytes | None]:
    """``body`` with ``priority`` set, and the client's JSON text with it appended
    (:func:`~pdmaster.engine.append_fields`; None when it must be encoded afresh from the body, as
    when the client sent a ``priority`` of its own)."""
    routed = dict(body)
    routed["priority"] = value
    return routed, append_fields(raw, bool(body), b'"priority":%d' % value, b'"priority"')
