"""The "released" word in a master's etcd key, as the agent reads it (nodeagent.agent.released_word)."""

from __future__ import annotations

import json

import pytest

from nodeagent.agent import released_word


def test_the_word_for_this_node_is_read() -> None:
    doc = json.loads(
        '{"grpc": "h:1", "released": {"d1": {"stream": 7, "running": 2}, "d2": {"stream": 9, "running": 0}}}'
    )
    assert released_word(doc, "d1") == (7, 2)
    assert released_word(doc, "d2") == (9, 0)
    assert released_word(doc, "d3") == (None, 0)  # another node's word is not ours


@pytest.mark.parametrize(
    "released",
    [
        None,
        [],
        "d1",
        {"d1": None},
        {"d1": [7, 2]},
        {"d1": {"stream": 7}},  # no running count
        {"d1": {"running": 0}},  # no stream
        {"d1": {"stream": 0, "running": 0}},  # 0: an agent of an earlier release, never named
        {"d1": {"stream": -3, "running": 0}},
        {"d1": {"stream": 7, "running": -1}},
        {"d1": {"stream": True, "running": 0}},  # a bool is an int to Python, not to the protocol
        {"d1": {"stream": 7, "running": False}},
        {"d1": {"stream": 7.0, "running": 0}},
        {"d1": {"stream": "7", "running": 0}},
    ],
)
def test_anything_else_is_ignored(released: object) -> None:
    assert released_word({"grpc": "h:1", "released": released}, "d1") == (None, 0)


def test_a_key_that_is_not_an_object_names_nothing() -> None:
    assert released_word([1, 2], "d1") == (None, 0)
    assert released_word({"grpc": "h:1"}, "d1") == (None, 0)
