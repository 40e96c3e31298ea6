"""A small process launcher for the demo, the tests and the benchmarks (stdlib only).

``ProcessGroup`` starts commands with their output in ``<log_dir>/<name>.log``, waits until each is
ready, and tears everything it started down on exit, at interpreter exit and on SIGINT/SIGTERM —
in reverse start order, so that e.g. masters still reach etcd while they drain. Children run in
their own session: a Ctrl-C in the terminal reaches only the launcher, which then stops them in
order. Signals go only to the PIDs we started, never to a process group or by name.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

Ready = Callable[[], bool] | str | None

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# strong references: a group that was dropped without close() must still be torn down at exit
_all_processes: set[ManagedProcess] = set()
_all_groups: set[ProcessGroup] = set()


class ProcessError(RuntimeError):
    """A managed process failed to start or to become ready."""


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True when GET *url* answers 200 (proxies ignored: everything we poll is local)."""
    try:
        with _NO_PROXY.open(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _read_tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _dies_with_us(argv: Sequence[str]) -> list[str]:
    """``argv`` run under ``setpriv --pdeathsig TERM`` (Linux, util-linux): the child gets SIGTERM when
    this process dies, so a test run or a demo that is killed outright (SIGKILL, a CI timeout, a test
    runner stopped from outside) leaves nothing running; the clean paths still stop children by PID.
    Only from the main thread: the signal follows the thread that started the child, and a worker
    thread may end long before the process."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if setpriv is None or threading.current_thread() is not threading.main_thread() or not argv:
        return list(argv)
    if shutil.which(argv[0]) is None:
        return list(argv)  # let Popen say that it cannot run it, as without the wrapper
    return [setpriv, "--pdeathsig", "TERM", "--", *argv]


class ManagedProcess:
    """One started process. Created by :meth:`ProcessGroup.start`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None,
        log_path: Path,
        ready: Ready,
        ready_timeout: float,
        cwd: str | Path | None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.env = dict(env) if env is not None else None
        self.log_path = log_path
        self.ready = ready
        self.ready_timeout = ready_timeout
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # ------------------------------------------------------------ state

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise ProcessError(f"{self.name} has not been started")
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def tail(self, n: int = 20) -> str:
        """The last *n* lines of the log."""
        return _read_tail(self.log_path, n)

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc is not None else None
        state = "alive" if self.alive else f"exited {self.returncode}"
        return f"<ManagedProcess {self.name} pid={pid} {state}>"

    # ------------------------------------------------------------ lifecycle

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # so the log (and tail()) is current
        if self.env is not None:
            env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"--- {stamp} start #{self.starts + 1}: {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    _dies_with_us(self.argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ProcessError(f"{self.name}: cannot run {self.argv[0]!r}: {exc}") from exc
        self.starts += 1
        _all_processes.add(self)

    def _wait_ready(self) -> None:
        ready = self.ready
        if ready is None:
            return
        check: Callable[[], bool] = (lambda: http_ok(ready)) if isinstance(ready, str) else ready
        what = ready if isinstance(ready, str) else getattr(ready, "__name__", "readiness check")
        deadline = time.monotonic() + self.ready_timeout
        last_error: BaseException | None = None
        while True:
            if not self.alive:
                raise ProcessError(
                    f"{self.name} exited with code {self.returncode} before it was ready ({what}); "
                    f"last lines of {self.log_path}:\n{self.tail()}"
                )
            try:
                if check():
                    return
            except Exception as exc:  # a readiness probe that raises just means "not yet"
                last_error = exc
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self.terminate(timeout=2.0)
        hint = f" (last probe error: {last_error!r})" if last_error is not None else ""
        raise ProcessError(
            f"{self.name} was not ready after {self.ready_timeout:.1f} s ({what}){hint}; it was stopped; "
            f"last lines of {self.log_path}:\n{self.tail()}"
        )

    def start(self) -> ManagedProcess:
        """Spawn (if not running) and wait until ready."""
        if not self.alive:
            self._spawn()
        self._wait_ready()
        return self

    def send_signal(self, sig: int) -> None:
        """Send *sig* to our PID (no-op if it already exited)."""
        if self.alive and self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for exit and return the exit status (negative: killed by that signal)."""
        if self._proc is None:
            raise ProcessError(f"{self.name} has not been started")
        return self._proc.wait(timeout)

    def terminate(self, timeout: float = 5.0) -> int:
        """SIGTERM, wait up to *timeout* s, then SIGKILL; returns the exit status."""
        if self._proc is None:
            raise ProcessError(f"{self.name} has not been started")
        if self._proc.poll() is None:
            self.send_signal(signal.SIGTERM)
            try:
                return self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return self.kill()
        return self._proc.returncode

    def kill(self) -> int:
        """SIGKILL and reap; returns the exit status."""
        if self._proc is None:
            raise ProcessError(f"{self.name} has not been started")
        self.send_signal(signal.SIGKILL)
        return self._proc.wait(10)

    def restart(self, timeout: float = 5.0) -> ManagedProcess:
        """Terminate (if running), start the same command again and wait until ready."""
        if self.alive:
            self.terminate(timeout)
        return self.start()


class ProcessGroup:
    """Starts processes and guarantees they are all stopped at the end.

    ``with ProcessGroup(log_dir) as g: g.start("etcd", [...], ready="http://...")``.
    """

    def __init__(
        self,
        log_dir: str | Path | None = None,
        *,
        handle_signals: bool = True,
        stop_timeout: float = 5.0,
    ) -> None:
        self.log_dir = (
            Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="pdcoord-logs-"))
        )
        self.stop_timeout = stop_timeout
        self.processes: list[ManagedProcess] = []
        self._handle_signals = handle_signals
        self._previous_handlers: dict[int, Any] = {}
        self._closed = False
        _all_groups.add(self)

    def __getitem__(self, name: str) -> ManagedProcess:
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise KeyError(name)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_dir: str | Path | None = None,
        ready: Ready = None,
        ready_timeout: float = 20.0,
        cwd: str | Path | None = None,
    ) -> ManagedProcess:
        """Start *argv* as *name*, logging to ``<log_dir>/<name>.log``; wait until *ready*.

        *ready* is a URL (polled until it answers HTTP 200), a callable (polled until true) or None.
        On failure the process is stopped and ProcessError carries the last lines of its log.
        """
        if self._closed:
            raise ProcessError("this ProcessGroup has been stopped")
        if not name or "/" in name:
            raise ValueError(f"process name {name!r} must be non-empty and contain no '/'")
        if not argv:
            raise ValueError(f"{name}: empty command line")
        if any(p.name == name and p.alive for p in self.processes):
            raise ValueError(f"a process named {name!r} is already running in this group")
        self.processes = [p for p in self.processes if p.name != name]
        self._install_signal_handlers()
        directory = Path(log_dir) if log_dir is not None else self.log_dir
        proc = ManagedProcess(
            name,
            argv,
            env=env,
            log_path=directory / f"{name}.log",
            ready=ready,
            ready_timeout=ready_timeout,
            cwd=cwd,
        )
        self.processes.append(proc)
        proc.start()
        return proc

    def alive(self) -> list[ManagedProcess]:
        return [p for p in self.processes if p.alive]

    def stop_all(self, timeout: float | None = None) -> None:
        """Terminate every process, last started first (SIGKILL after *timeout* each)."""
        limit = self.stop_timeout if timeout is None else timeout
        for proc in reversed(self.processes):
            if proc.alive:
                with contextlib.suppress(Exception):
                    proc.terminate(limit)

    def close(self) -> None:
        self.stop_all()
        self._closed = True
        self._restore_signal_handlers()
        _all_groups.discard(self)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if not self._handle_signals or self._previous_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_handlers.get(signum)
        self.close()  # stops the children and restores the previous handlers
        if callable(previous):
            previous(signum, frame)  # e.g. KeyboardInterrupt for SIGINT
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def live_processes() -> list[ManagedProcess]:
    """Every process started by any ProcessGroup of this interpreter that is still running."""
    for proc in [p for p in _all_processes if not p.alive]:
        _all_processes.discard(proc)
    return [p for p in _all_processes if p.alive]


@atexit.register
def _stop_everything_at_exit() -> None:
    for group in list(_all_groups):
        with contextlib.suppress(Exception):
            group.stop_all(timeout=2.0)
