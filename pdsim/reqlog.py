"""A bounded log of the generation requests the engine received, for tests to check what a router sent."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

# Headers a router's behaviour shows in; nothing that could carry a credential.
HEADERS_OF_INTEREST = ("X-Request-Id", "Content-Type", "X-Pdsim-Answer-Tokens")
MAX_RAW_CHARS = 4096


class RequestLog:
    def __init__(self, size: int) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=size)
        self.total = 0

    def record(self, path: str, headers: Any, body: object, raw: bytes | None) -> dict[str, Any]:
        """Add one request; the returned entry is updated in place with the answer's status."""
        self.total += 1
        entry: dict[str, Any] = {
            "seq": self.total,
            "time": time.time(),
            "path": path,
            "request_id": headers.get("X-Request-Id"),
            "headers": {h: headers[h] for h in HEADERS_OF_INTEREST if h in headers},
            "body": body,
            "status": None,
        }
        if body is None and raw is not None:
            # Not JSON: keep the start of it, so a test can still see what arrived.
            entry["raw"] = raw[:MAX_RAW_CHARS].decode("utf-8", "replace")
        if self._entries.maxlen:
            self._entries.append(entry)
        return entry

    def snapshot(self, since: int = 0, path: str | None = None) -> dict[str, Any]:
        entries = [e for e in self._entries if e["seq"] > since and (path is None or e["path"] == path)]
        return {
            "total": self.total,
            "capacity": self._entries.maxlen,
            "dropped": self.total - len(self._entries),
            "requests": entries,
        }

    def clear(self) -> None:
        self._entries.clear()
