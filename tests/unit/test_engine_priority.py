"""--engine-priority: each admission class's priority value and the engines' request body."""

from __future__ import annotations

import json

import pytest

from pdmaster.admission import RequestClass
from pdmaster.engine_priority import class_priorities, with_priority


def test_values_follow_the_engines_direction() -> None:
    assert class_priorities("off") is None
    high = class_priorities("high-first")
    low = class_priorities("low-first")
    assert high == {RequestClass.CONTINUATION: 2, RequestClass.PROBABLE_CACHE_HIT: 1, RequestClass.COLD: 0}
    assert low == {RequestClass.CONTINUATION: 0, RequestClass.PROBABLE_CACHE_HIT: 1, RequestClass.COLD: 2}
    with pytest.raises(ValueError, match="--engine-priority"):
        class_priorities("fifo")


def test_the_client_text_gets_the_field_appended() -> None:
    body = {"model": "m", "prompt": "hi"}
    raw = json.dumps(body).encode() + b"\n"
    routed, text = with_priority(body, raw, 2)
    assert routed == {**body, "priority": 2} and body == {"model": "m", "prompt": "hi"}
    assert text is not None and json.loads(text) == routed
    assert with_priority({}, b"{}", 0)[1] == b'{"priority":0}'


def test_a_client_priority_is_replaced_by_encoding_afresh() -> None:
    body = {"prompt": "x", "priority": 9}
    routed, text = with_priority(body, json.dumps(body).encode(), 1)
    assert routed["priority"] == 1 and text is None  # the dispatcher encodes the routed body
    # A value that is the word itself is re-encoded too: safe, if not the cheapest path.
    body2 = {"prompt": "priority"}
    assert with_priority(body2, json.dumps(body2).encode(), 0)[1] is None
    assert with_priority(body2, None, 0) == ({**body2, "priority": 0}, None)
