"""The masters' keep-alive on agent streams: the defaults both sides rely on.

A master pings an idle agent stream after ``--keepalive`` seconds and drops it when the answer takes
longer than ``--keepalive-timeout``, so it notices a silently cut stream within their sum. It says
both in its etcd key (``keepalive_s``, ``detect_s``); an older master's key says neither, and its
agents then assume these defaults.
"""

from __future__ import annotations

DEFAULT_KEEPALIVE_S = 0.65
DEFAULT_KEEPALIVE_TIMEOUT_S = 1.0
DEFAULT_DETECT_S = DEFAULT_KEEPALIVE_S + DEFAULT_KEEPALIVE_TIMEOUT_S  # 1.65 s
