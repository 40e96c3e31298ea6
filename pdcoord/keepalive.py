"""The masters' keep-alive on agent streams: the defaults both sides rely on.

A master pings an idle agent stream after ``--keepalive`` seconds and drops it when the answer takes
longer than ``--keepalive-timeout``, so it notices a silently cut stream within their sum. It says
both in its etcd key (``keepalive_s``, ``detect_s``), and its agents let strict handover wait that
long (plus a little slack) before engine samples may hand its slots on.

The defaults are 2 s + 1 s: a cut link is noticed within 3 s. Pings are most of an idle master's CPU
(about 90 µs each), and a killed master is noticed at once anyway (its address refuses connections);
the keep-alive only finds hung peers and cut links, which etcd's lease bounds too.

Masters of earlier releases pinged after 0.65 s and allowed 1 s for the answer, and their keys say
neither: an agent assumes those times (``UNADVERTISED_*``) for a key without the fields, because
that is what such a master really does. Agents of earlier releases read neither field and allow
every master 1.65 s (plus slack), which a master at today's defaults exceeds: upgrade the agents
before the masters, or run the new masters with ``--keepalive 0.65`` until the last old agent is gone
(README, "Upgrading").
"""

from __future__ import annotations

DEFAULT_KEEPALIVE_S = 2.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 1.0
DEFAULT_DETECT_S = DEFAULT_KEEPALIVE_S + DEFAULT_KEEPALIVE_TIMEOUT_S  # 3 s

# What a master whose etcd key carries no ``keepalive_s``/``detect_s`` does (a master of a release
# before they were advertised): its fixed 0.65 s ping and 1 s answer time. Also the detection time
# an agent of such a release allows every master.
UNADVERTISED_KEEPALIVE_S = 0.65
UNADVERTISED_KEEPALIVE_TIMEOUT_S = 1.0
UNADVERTISED_DETECT_S = UNADVERTISED_KEEPALIVE_S + UNADVERTISED_KEEPALIVE_TIMEOUT_S  # 1.65 s
