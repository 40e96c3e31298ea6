"""Notice that this master's process did not run for a while, and say when it ran again.

Why it matters. Shares assume a master learns that an agent cut its stream within its keep-alive
time (``detect_s``), and the agents wait that long before engine samples may hand its slots on
(strict handover). A process that is frozen (SIGSTOP, a paused VM, a cgroup starved of CPU) learns
nothing while frozen: its peers cut its streams, hand its slots on as its decodes end, and when it
runs again, whichever callback comes first may place a request on a share that is no longer its
own, before the stream ends waiting in its sockets are read. The engine then runs more than its
``running_max_req_size``. The admission core therefore places nothing for ``detect_s`` after a pause
(``AdmissionCore.watch_pauses``): every stream its agents closed is read by then, and one that died
silently is found by the keep-alive. Nor does a decode request placed before the pause go out during
that hold (``pipeline._still_held``, asked with the decode connection in hand): the request goes round
again once the streams are read.

How a pause is seen. A daemon thread wakes every ``every_s`` and notes the time. A wake-up that
comes more than ``gap_s`` after the previous one means the whole process stood still: the thread
needs no event loop, so a busy loop does not trip it (a loop that holds the GIL lets it in within
the interpreter's switch interval), and a process that is merely slow keeps answering gRPC's
keep-alive from its C threads, which is all the agents look at. The main thread may run before the
watch thread after a pause, so ``resumed_at`` also reports a pause that the thread has not noticed
yet: the last beat is too old.

``gap_s`` (1 s) is below the shortest pause after which an agent can have cut a stream: it pings a
silent master at most 0.65 s after its last ping (the shortest master keep-alive it allows for is
the default) plus 0.35 s, and waits 1 s for the answer.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

__all__ = ["PAUSE_GAP_S", "PauseWatch"]

log = logging.getLogger(__name__)

PAUSE_GAP_S = 1.0
BEAT_S = 0.25


class PauseWatch:
    """``resumed_at(now)``: when the latest pause of this process ended (-inf: none seen)."""

    def __init__(
        self,
        gap_s: float = PAUSE_GAP_S,
        every_s: float = BEAT_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_pause: Callable[[float], None] | None = None,
    ) -> None:
        if not 0 < every_s < gap_s:
            raise ValueError(f"need 0 < every_s < gap_s, got every_s={every_s!r}, gap_s={gap_s!r}")
        self.gap_s = gap_s
        self.every_s = every_s
        self._clock = clock
        self._on_pause = on_pause  # called with the pause's length, on the watch thread
        self._beat = clock()
        self._resumed = -math.inf
        self.pauses = 0
        self.longest_s = 0.0
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._beat = self._clock()
        self._thread = threading.Thread(target=self._run, name="pause-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self._thread.join(2 * self.every_s + 1.0)
            self._thread = None

    def resumed_at(self, now: float) -> float:
        if now - self._beat > self.gap_s:
            return now  # stood still until just now; the thread has not run since
        return self._resumed

    def beat(self, now: float) -> None:
        """One wake-up of the thread (called by it; directly in tests)."""
        gap = now - self._beat
        if gap > self.gap_s:
            self._resumed = now
            self.pauses += 1
            self.longest_s = max(self.longest_s, gap)
            log.warning(
                "this process did not run for %.2f s (stopped, paused or starved of CPU): new "
                "leases wait until the streams the agents may have cut meanwhile are read",
                gap,
            )
            if self._on_pause is not None:
                self._on_pause(gap)
        self._beat = now

    def _run(self) -> None:
        # A plain sleep: half the CPU of an Event.wait per wake-up (0.025 % of a core at 4 a second).
        while not self._stopping:
            time.sleep(self.every_s)
            if not self._stopping:
                self.beat(self._clock())
