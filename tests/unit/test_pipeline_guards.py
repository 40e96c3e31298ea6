"""The request path's guards for strict handover: no decode request to a node this master lost."""

from __future__ import annotations

from pdmaster.engine import EngineError
from pdmaster.engine.health import counts_as_failure
from pdmaster.pipeline import _retryable, _still_held
from pdmaster.registry import DECODE, NodeRegistry


def test_a_decode_node_counts_as_held_only_over_the_stream_it_was_routed_on() -> None:
    r = NodeRegistry()
    node, stream = r.register(
        node_id="d1", role=DECODE, endpoint="http://127.0.0.1:1", running_max_req_size=4, grant=(4, 10)
    )
    held = _still_held(node, lambda: False)
    assert held()
    r.disconnect("d1", stream)
    assert not held()  # the stream is gone: the agent may hand the slot on
    again, _ = r.register(
        node_id="d1", role=DECODE, endpoint="http://127.0.0.1:1", running_max_req_size=4, grant=(4, 11)
    )
    assert again.connected and not held()  # a new stream: the slot may be another master's by now
    assert _still_held(again, lambda: False)()


def test_a_decode_node_counts_as_not_held_while_placement_is_held_after_a_pause() -> None:
    """After this process stood still, a stream the agent cut meanwhile may not be read yet: until the
    hold ends the node counts as lost (the request goes round again), then as held again."""
    r = NodeRegistry()
    node, _ = r.register(
        node_id="d1", role=DECODE, endpoint="http://127.0.0.1:1", running_max_req_size=4, grant=(4, 10)
    )
    paused = [True]
    held = _still_held(node, lambda: paused[0])
    assert not held()
    paused[0] = False
    assert held()


def test_a_lost_decode_node_is_retried_elsewhere_without_counting_as_an_engine_failure() -> None:
    lost = EngineError("decode d1: lost", status=503, kind="lost", node="d1")
    assert _retryable(lost)
    assert not counts_as_failure(lost.kind, lost.engine_status)  # the engine did nothing wrong
    assert not _retryable(EngineError("bad request", status=400, kind="status", node="d1", engine_status=400))
