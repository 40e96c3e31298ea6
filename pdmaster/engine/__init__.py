"""The engine client: a sans-I/O HTTP/1.1 response parser (``http11``), the keep-alive connection
pool (``pool``), the SGLang and vLLM PD protocols (``dispatch``), and its one error type."""

from pdmaster.engine.dispatch import (
    Dispatch,
    EngineNode,
    EngineResponse,
    SGLangDispatch,
    VLLMDispatch,
    append_fields,
    make_dispatch,
    with_bootstrap,
)
from pdmaster.engine.errors import EngineError
from pdmaster.engine.pool import EnginePool, Exchange, origin

__all__ = [
    "Dispatch",
    "EngineError",
    "EngineNode",
    "EnginePool",
    "EngineResponse",
    "Exchange",
    "SGLangDispatch",
    "VLLMDispatch",
    "append_fields",
    "make_dispatch",
    "origin",
    "with_bootstrap",
]
