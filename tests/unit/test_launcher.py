"""The process launcher: readiness, logs, stopping by PID, teardown on exit and on signals."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdcoord.dev.launcher import ProcessError, ProcessGroup, http_ok, live_processes
from pdcoord.dev.netutil import free_port, port_open, wait_port

PY = sys.executable


def http_server(port: int) -> list[str]:
    return [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_ready_on_url_log_and_terminate(proc_group: ProcessGroup) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = proc_group.start("web", http_server(port), ready=url, ready_timeout=15)
    assert proc.alive and proc.pid > 0 and proc.name == "web"
    assert proc.argv[-3:] == [str(port), "--bind", "127.0.0.1"]
    assert http_ok(url)
    assert proc.log_path == proc_group.log_dir / "web.log"
    deadline = time.monotonic() + 5
    while '"GET / HTTP/1.1" 200' not in proc.tail(50):  # the server logs each request to stderr
        assert time.monotonic() < deadline, proc.tail(50)
        time.sleep(0.05)

    code = proc.terminate(timeout=5)
    assert code == -signal.SIGTERM
    assert not proc.alive and not pid_exists(proc.pid)
    assert not port_open("127.0.0.1", port)


def test_not_ready_raises_with_log_tail(proc_group: ProcessGroup) -> None:
    port = free_port()  # nothing will ever listen here
    argv = [PY, "-c", "print('starting up, config looks odd', flush=True); import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(ProcessError, match=r"not ready after 1\.0 s") as info:
        proc_group.start("stuck", argv, ready=f"http://127.0.0.1:{port}/health", ready_timeout=1.0)
    assert time.monotonic() - t0 < 6
    assert "config looks odd" in str(info.value)
    proc = proc_group["stuck"]
    assert not proc.alive and not pid_exists(proc.pid)


def test_exit_before_ready_raises_at_once(proc_group: ProcessGroup) -> None:
    argv = [PY, "-c", "import sys; print('bad flag --frob', file=sys.stderr); sys.exit(3)"]
    t0 = time.monotonic()
    with pytest.raises(ProcessError, match="exited with code 3") as info:
        proc_group.start("bad", argv, ready=lambda: False, ready_timeout=30)
    assert time.monotonic() - t0 < 10
    assert "bad flag --frob" in str(info.value)


def test_callable_ready_and_env(proc_group: ProcessGroup, tmp_path: Path) -> None:
    marker = tmp_path / "ready"
    argv = [
        PY,
        "-c",
        "import os, time, pathlib; time.sleep(0.3); print('value', os.environ['PDCOORD_TEST_VALUE']); "
        "pathlib.Path(os.environ['MARKER']).touch(); time.sleep(60)",
    ]
    env = {"PDCOORD_TEST_VALUE": "42", "MARKER": str(marker)}
    proc = proc_group.start("env", argv, env=env, ready=marker.exists, ready_timeout=10)
    assert marker.exists()
    assert "value 42" in proc.tail()


def test_terminate_escalates_to_sigkill(proc_group: ProcessGroup, tmp_path: Path) -> None:
    marker = tmp_path / "armed"
    argv = [
        PY,
        "-c",
        "import signal, time, pathlib, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(marker)!r}).touch(); time.sleep(60)",
    ]
    proc = proc_group.start("stubborn", argv, ready=marker.exists)
    t0 = time.monotonic()
    assert proc.terminate(timeout=0.5) == -signal.SIGKILL
    assert 0.4 < time.monotonic() - t0 < 5
    assert not pid_exists(proc.pid)


def test_kill_and_restart(proc_group: ProcessGroup) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = proc_group.start("web", http_server(port), ready=url)
    first = proc.pid
    assert proc.kill() == -signal.SIGKILL
    assert not proc.alive and not http_ok(url)
    proc.restart()
    assert proc.alive and proc.pid != first and http_ok(url)
    assert proc.tail(200).count("start #") == 2  # one log, both runs
    with pytest.raises(ValueError, match="already running"):
        proc_group.start("web", http_server(free_port()))


def test_group_teardown_stops_everything_in_reverse_order(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    with ProcessGroup(tmp_path / "logs", handle_signals=False) as group:
        procs = [
            group.start(f"web{i}", http_server(p), ready=f"http://127.0.0.1:{p}/")
            for i, p in enumerate(ports)
        ]
        pids = [p.pid for p in procs]
        assert all(pid_exists(pid) for pid in pids)
    assert not any(p.alive for p in procs)
    assert not any(pid_exists(pid) for pid in pids)
    assert not any(port_open("127.0.0.1", p) for p in ports)
    assert not [p for p in live_processes() if p in procs]
    with pytest.raises(ProcessError, match="stopped"):
        group.start("late", [PY, "-c", "pass"])


def test_start_rejects_bad_arguments(proc_group: ProcessGroup) -> None:
    with pytest.raises(ValueError):
        proc_group.start("a/b", [PY])
    with pytest.raises(ValueError):
        proc_group.start("empty", [])
    with pytest.raises(ProcessError, match="cannot run"):
        proc_group.start("missing", ["/nonexistent/binary"])


DRIVER = textwrap.dedent(
    """
    import signal, sys, time
    from pdcoord.dev.launcher import ProcessGroup
    # As an interactive launcher has it, whatever this test runs under (a shell runs a background
    # job with SIGINT ignored, and an ignored signal is inherited).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    group = ProcessGroup(sys.argv[1])
    child = group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)  # no close(): the atexit hook must stop the child
    time.sleep(120)
    """
)


def _run_driver(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    driver = subprocess.Popen(
        [PY, "-c", DRIVER, str(tmp_path / "logs"), mode],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert driver.stdout is not None
    line = driver.stdout.readline()
    assert line.strip().isdigit(), f"driver did not report a child pid: {line!r}"
    return driver, int(line)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_stops_children(tmp_path: Path, sig: signal.Signals) -> None:
    driver, child = _run_driver(tmp_path, "wait")
    try:
        assert pid_exists(child)
        driver.send_signal(sig)
        code = driver.wait(60)  # generous: a loaded machine can take long to schedule its cleanup
        assert code != 0  # it died of the signal / KeyboardInterrupt after cleaning up
        deadline = time.monotonic() + 5
        while pid_exists(child):
            assert time.monotonic() < deadline, f"child {child} survived {sig.name} to its launcher"
            time.sleep(0.05)
    finally:
        for pid in (driver.pid, child):
            if pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
        driver.wait(5)
        if driver.stdout:
            driver.stdout.close()


def test_atexit_stops_children(tmp_path: Path) -> None:
    driver, child = _run_driver(tmp_path, "exit")
    try:
        assert driver.wait(15) == 0
        deadline = time.monotonic() + 5
        while pid_exists(child):
            assert time.monotonic() < deadline, "child survived its launcher's exit"
            time.sleep(0.05)
    finally:
        if pid_exists(child):
            os.kill(child, signal.SIGKILL)
        if driver.stdout:
            driver.stdout.close()


def test_wait_port() -> None:
    port = free_port()
    with pytest.raises(TimeoutError, match=str(port)):
        wait_port("127.0.0.1", port, timeout=0.3)
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", port))
        srv.listen()
        wait_port("127.0.0.1", port, timeout=2)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_children_die_when_the_starter_is_killed_outright(tmp_path: Path) -> None:
    """A test run killed with SIGKILL runs no cleanup: the children must go by themselves."""
    script = (
        "import sys, time\n"
        "from pdcoord.dev.launcher import ProcessGroup\n"
        f"g = ProcessGroup({str(tmp_path)!r})\n"
        "p = g.start('sleeper', ['sleep', '300'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    child = int(starter.stdout.readline())
    # The death signal is armed by setpriv just before it becomes ``sleep``: kill the starter only
    # after that, or the test races the arming instead of testing it.
    deadline = time.monotonic() + 10
    while _comm(child) != "sleep":
        assert time.monotonic() < deadline, f"child {child} never became sleep ({_comm(child)!r})"
        time.sleep(0.01)
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"child {child} outlived its killed starter"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def test_free_ports_are_distinct_bindable_and_never_ephemeral() -> None:
    """An outgoing connection's source port comes from the ephemeral range: a port picked there can
    be taken before the server binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if low > 21_000:
        assert all(p < low for p in ports), sorted(p for p in ports if p >= low)
    for port in ports[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
