"""Assembles one master: etcd registration, the gRPC NodeCoordination server, the HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import time
from collections.abc import Mapping
from typing import Any

import grpc
import grpc.aio
from aiohttp import http_exceptions, web, web_protocol, web_urldispatcher
from aiohttp.http import HttpVersion11
from prometheus_client import CollectorRegistry

from pdcoord import __version__
from pdcoord.etcd import EtcdClient
from pdcoord.keys import Keys
from pdcoord.registration import AlreadyRegistered, Registration
from pdcoord.tls import etcd_options_from_args, server_tls_from_args
from pdcoord.v1 import coordination_pb2_grpc as pb_grpc
from pdmaster.admission_controller import AdmissionController, policy_from_args
from pdmaster.coordination import CoordinationService
from pdmaster.dataplane import DataPlane
from pdmaster.dispatch import Dispatcher
from pdmaster.http_api import ControlRoutes, api_key_middleware, load_api_keys
from pdmaster.metrics import MasterMetrics
from pdmaster.registry import DECODE, NodeRegistry
from pdmaster.validation import Limits

log = logging.getLogger(__name__)

# Keep-alive so a dead or cut-off agent stream is noticed within ~0.75 s even when it sends
# nothing: below the agents' default --grace (1 s), so a master stops using a node before the
# agent hands its share to others (strict handover relies on this ordering).
GRPC_SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 250),
    ("grpc.keepalive_timeout_ms", 500),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 1 << 20),
    ("grpc.max_send_message_length", 1 << 20),
]


class _MalformedRequestFilter(logging.Filter):
    """aiohttp logs every unparsable request (a 400 it already answered) with a traceback at ERROR;
    from hostile or broken clients that is noise an attacker controls. Keep one line at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, http_exceptions.HttpProcessingError) and (exc.code or 400) < 500:
            detail = exc.message
        elif isinstance(exc, web_protocol.RequestPayloadError):  # e.g. a body that is not the gzip it claims
            detail = str(exc).replace("\n", " ")
        else:
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args, record.exc_info = "refused malformed HTTP request: %s", (detail,), None
        return True


_MALFORMED_FILTER = _MalformedRequestFilter()


async def _expect_handler(request: web.Request) -> None:
    """aiohttp's default, except that an unknown Expect value is not echoed: aiohttp 3.14 echoes it
    into its 417 text and a non-UTF-8 value then fails the encode, answering 500."""
    if request.version == HttpVersion11:
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        else:
            raise web.HTTPExpectationFailed(text="unsupported Expect header (only 100-continue)")


# Routes, including the router's own 404/405 routes, look this default up when they are created.
web_urldispatcher._default_expect_handler = _expect_handler


class StartupError(Exception):
    """A reason the master cannot start, phrased for the operator."""


class MasterServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.master_id: str = args.master_id
        self.keys = Keys.for_cluster(args.cluster, args.etcd_prefix)
        self.metrics_registry = CollectorRegistry()
        self.metrics = MasterMetrics(self.metrics_registry, self.master_id)
        if args.admin_host is not None and args.admin_port is None:
            raise StartupError("--admin-host needs --admin-port")
        # Credentials are read and checked before anything listens: a bad file fails the start.
        self.grpc_tls = server_tls_from_args(args)
        try:
            self.api_keys = load_api_keys(args.api_key, args.api_keys_file)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        etcd_options = etcd_options_from_args(args)
        self.registry = NodeRegistry(
            max_node_capacity=args.max_node_capacity,
            max_nodes=args.max_nodes,
            max_start_args=args.max_start_args,
            max_start_arg_bytes=args.max_start_arg_bytes,
        )
        self.admission = AdmissionController(
            policy_from_args(args), registry=self.metrics_registry, master_id=self.master_id
        )
        self.registry.subscribe(self._on_shares)
        self.coordination = CoordinationService(
            self.master_id,
            self.registry,
            self.metrics,
            slots=self._slots,
            max_reports_per_s=args.max_reports_per_s,
        )
        self.dataplane = DataPlane(
            registry=self.registry,
            admission=self.admission,
            dispatcher_factory=lambda pool: Dispatcher(args.engine_protocol, pool),
            limits=Limits(max_n=args.max_n, max_tokens=args.max_tokens, model=args.model),
            metrics_registry=self.metrics_registry,
            is_draining=lambda: self.draining,
            round_robin=args.prefill_selection == "round-robin",
        )
        self.draining = False
        self.etcd = EtcdClient(args.etcd, **etcd_options)
        self.registration: Registration | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.http_runner: web.AppRunner | None = None
        self.admin_runner: web.AppRunner | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.admin_port = 0
        self._stop = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------
    def _on_shares(self, shares: Mapping[str, int]) -> None:
        caps = {
            nid: self.registry.nodes[nid].running_max_req_size for nid in shares if nid in self.registry.nodes
        }
        self.admission.set_shares(shares, caps)

    def _slots(self, node_id: str) -> tuple[int, int]:
        # The queue can be served by any decode node: spread its demand over them, so agents that
        # follow demand hand this master about what it is missing in all, not that much per node.
        wanted = self.admission.wanted_slots()
        if wanted:
            nodes = max(1, len(self.registry.live(DECODE)))
            wanted = -(-wanted // nodes)
        return self.admission.active_on(node_id), wanted

    def admission_snapshot(self) -> dict[str, Any]:
        return self.admission.snapshot()

    def in_flight(self) -> int:
        return self.dataplane.inflight

    def _control_routes(self) -> ControlRoutes:
        return ControlRoutes(
            master_id=self.master_id,
            registry=self.registry,
            metrics_registry=self.metrics_registry,
            admission_snapshot=self.admission_snapshot,
            is_draining=lambda: self.draining,
        )

    @property
    def separate_admin(self) -> bool:
        return self.args.admin_port is not None

    def build_app(self) -> web.Application:
        middlewares = []
        if self.api_keys:
            # Probes carry no credentials; everything else on the public port needs a key.
            middlewares.append(api_key_middleware(self.api_keys, open_paths={"/health", "/readiness"}))
        app = web.Application(client_max_size=self.args.max_body_bytes, middlewares=middlewares)
        self._control_routes().install(app, admin=not self.separate_admin)
        self.dataplane.install(app)
        return app

    def build_admin_app(self) -> web.Application:
        """/metrics and /admission (and /health) for the admin listener: meant for a private network."""
        app = web.Application(client_max_size=64 * 1024)
        routes = self._control_routes()
        routes.install(app, probes=False)
        app.router.add_get("/health", routes.health)
        return app

    def _runner(self, app: web.Application) -> web.AppRunner:
        return web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,  # a client that goes away cancels its handler: lease released
            shutdown_timeout=2.0,  # the drain already waited for in-flight requests
            max_line_size=self.args.max_header_bytes,
            max_field_size=self.args.max_header_bytes,
            max_headers=self.args.max_headers,
        )

    async def _listen(self, runner: web.AppRunner, host: str, port: int, flag: str) -> int:
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            raise StartupError(f"{flag}: cannot listen on {host}:{port}: {exc}") from exc
        sockets = getattr(site._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def start(self) -> None:
        args = self.args
        self.grpc_server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        pb_grpc.add_NodeCoordinationServicer_to_server(self.coordination, self.grpc_server)
        address = f"{args.grpc_host}:{args.grpc_port}"
        if self.grpc_tls is not None:
            self.grpc_port = self.grpc_server.add_secure_port(address, self.grpc_tls.credentials())
        else:
            self.grpc_port = self.grpc_server.add_insecure_port(address)
        if self.grpc_port == 0:
            raise StartupError(f"--grpc-port: cannot listen on {args.grpc_host}:{args.grpc_port}")
        await self.grpc_server.start()

        logging.getLogger("aiohttp.server").addFilter(_MALFORMED_FILTER)  # idempotent
        self.http_runner = self._runner(self.build_app())
        self.http_port = await self._listen(self.http_runner, args.http_host, args.http_port, "--http-port")
        if self.separate_admin:
            admin_host = args.admin_host or args.http_host
            self.admin_runner = self._runner(self.build_admin_app())
            self.admin_port = await self._listen(
                self.admin_runner, admin_host, args.admin_port, "--admin-port"
            )

        await self.etcd.connect()
        advertise = args.advertise_host or args.grpc_host
        value = json.dumps(
            {
                "master_id": self.master_id,
                "grpc": f"{advertise}:{self.grpc_port}",
                "http": f"http://{advertise}:{self.http_port}",
                "version": __version__,
                "started_at": time.time(),
            }
        ).encode()
        self.registration = Registration(
            self.etcd, self.keys.master(self.master_id), value, ttl=args.lease_ttl
        )
        try:
            await self.registration.start()
        except AlreadyRegistered as exc:
            raise StartupError(
                f"--master-id {self.master_id!r} is live in etcd under another lease; "
                f"refusing to start a second master with the same id ({exc})"
            ) from exc
        log.info(
            "master %s ready: http %s:%d grpc %s:%d (advertised %s, %s), cluster %s, %s",
            self.master_id,
            args.http_host,
            self.http_port,
            args.grpc_host,
            self.grpc_port,
            advertise,
            "plaintext" if self.grpc_tls is None else ("mTLS" if self.grpc_tls.mutual else "TLS"),
            args.cluster,
            f"{len(self.api_keys)} API key(s)" if self.api_keys else "open API (no API keys)",
        )
        print(
            f"pdmaster ready master_id={self.master_id} "
            f"http_port={self.http_port} grpc_port={self.grpc_port}"
            + (f" admin_port={self.admin_port}" if self.separate_admin else ""),
            flush=True,
        )

    async def drain(self) -> None:
        """Stop taking new work, let in-flight requests finish, then give the shares back."""
        if self.draining:
            return
        self.draining = True
        self.coordination.draining = True
        try:
            await asyncio.wait_for(self.dataplane.idle.wait(), self.args.drain_timeout)
        except TimeoutError:
            pass
        left = self.in_flight()
        if left:
            log.warning("drain timeout: %d requests still in flight", left)
        if self.registration is not None:
            # Revoking deletes masters/<id> at once: agents re-slice without waiting for a TTL.
            await self.registration.stop(revoke=True)
            self.registration = None

    async def close(self) -> None:
        try:
            await self.drain()
        except Exception:  # etcd may be gone; the lease then expires by itself
            log.exception("drain failed")
        # Keep answering (503 "draining", Connection: close) a little longer, so clients and load
        # balancers that have not yet noticed the shutdown get an explicit answer, not a reset.
        await asyncio.sleep(self.args.shutdown_linger)
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=0.5)
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        await self.etcd.close()

    def request_stop(self) -> None:
        self._stop.set()

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            await self._stop.wait()
            log.info("master %s: stop requested, draining", self.master_id)
        finally:
            await self.close()
