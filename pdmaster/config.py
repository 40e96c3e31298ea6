"""A master's configuration as data: what ``pdmaster``'s flags say, checked and typed once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

from pdcoord.config import EtcdSettings
from pdcoord.keepalive import DEFAULT_KEEPALIVE_S, DEFAULT_KEEPALIVE_TIMEOUT_S
from pdcoord.tls import ServerTLS, server_tls_from_args
from pdmaster.admission import AdmissionPolicy, RequestClass
from pdmaster.admission_controller import policy_from_args
from pdmaster.engine.health import BreakerPolicy
from pdmaster.token_charge import TokenChargePolicy
from pdmaster.validation import Limits

__all__ = ["ConfigError", "MasterConfig", "slo_targets"]

# --ttft-slo: each class's admission target as a fraction of the SLO. The target bounds the wait for
# decode capacity plus the request's expected prefill (``target_includes_prefill``); what is left of
# the SLO covers the error of that estimate, the KV transfer and the first decode step. Measured on
# the conversation trace with 2 s: 1.8 s kept first turns within the SLO, continuations needed 1.5 s
# (1.2 s with four masters) for their p99 (bench/README.md, Overload).
SLO_FRACTIONS = {
    RequestClass.CONTINUATION: 0.75,
    RequestClass.PROBABLE_CACHE_HIT: 0.9,
    RequestClass.COLD: 0.9,
}
SLO_SPILL_PEERS = 3
# What SGLang's PD decode server keeps free per active request (SGLANG_NUM_RESERVED_DECODE_TOKENS).
SGLANG_RESERVED_DECODE_TOKENS = 512


def slo_targets(slo: float) -> dict[RequestClass, float]:
    """The per-class admission targets ``--ttft-slo`` sets."""
    return {c: round(slo * f, 3) for c, f in SLO_FRACTIONS.items()}


# Pings more often than this buy nothing a network can deliver and cost a core per few hundred agents.
MIN_KEEPALIVE_S = 0.1


class ConfigError(ValueError):
    """A flag combination the master refuses; the message names the flag."""


@dataclass(frozen=True)
class MasterConfig:
    master_id: str
    etcd: EtcdSettings
    # listeners
    http_host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_host: str = "0.0.0.0"
    grpc_port: int = 50051
    advertise_host: str | None = None
    admin_host: str | None = None
    admin_port: int | None = None  # None: /metrics and /admission stay on the HTTP API port
    grpc_tls: ServerTLS | None = None
    keepalive: float = DEFAULT_KEEPALIVE_S  # ping an agent's stream after this long without a message
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT_S  # and close it when not answered by then
    # HTTP API authentication
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    # lifecycle
    drain_timeout: float = 10.0
    shutdown_linger: float = 1.0
    # limits
    max_node_capacity: int = 4096
    max_nodes: int = 10_000
    max_reports_per_s: float = 50.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 8190
    max_headers: int = 128
    max_start_args: int = 64
    max_start_arg_bytes: int = 1024
    limits: Limits = field(default_factory=Limits)
    # data plane
    engine_protocol: str = "sglang"
    prefill_selection: str = "earliest-first-token"
    engine_priority: str = "off"  # the class as the engines' request priority (pdmaster/engine_priority.py)
    ttft_slo: float = 0.0  # the SLO the flags above were derived from (0: none; shown in /admission)
    token_charge: TokenChargePolicy = field(default_factory=TokenChargePolicy)
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    event_loop: str = "auto"
    # engine faults
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    max_retries: int = 1
    spill_peers: int = 0  # a request refused at once for its expected wait tries up to this many peers
    engine_connect_timeout: float = 5.0
    engine_first_byte_timeout: float = 300.0
    engine_idle_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.admin_host is not None and self.admin_port is None:
            raise ConfigError("--admin-host needs --admin-port")
        if self.keepalive < MIN_KEEPALIVE_S:
            raise ConfigError(f"--keepalive must be at least {MIN_KEEPALIVE_S:g} s, got {self.keepalive:g}")
        if self.admission.prefill_lookahead > 0 and self.engine_protocol != "vllm":
            raise ConfigError(
                "--prefill-lookahead needs --engine-protocol vllm: with SGLang's protocol the decode "
                "request goes out with the prefill, so its lease cannot wait for it"
            )
        if self.admission.prefill_lookahead > 0 and self.admission.bypass:
            raise ConfigError(
                "--prefill-lookahead needs the decode capacity limit (drop --disable-decode-capacity-limit)"
            )
        if self.admission.target_includes_prefill and not self.admission.target_wait_s:
            raise ConfigError(
                "--admission-target-includes-prefill needs --admission-target-wait (the time-to-first-"
                "token target it turns that into)"
            )
        if self.breaker.backoff > self.breaker.backoff_max:
            raise ConfigError("--breaker-backoff must not exceed --breaker-backoff-max")

    @property
    def separate_admin(self) -> bool:
        return self.admin_port is not None

    @property
    def detect_s(self) -> float:
        """At most how long this master takes to notice a silently cut agent stream (advertised in
        etcd: strict handover makes the agents wait that long before they free its slots)."""
        return self.keepalive + self.keepalive_timeout

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MasterConfig:
        """TLSConfigError for unreadable certificates, ConfigError for other refused flags."""
        slo = float(getattr(args, "ttft_slo", 0.0) or 0.0)
        admission = policy_from_args(args)
        engine_priority = getattr(args, "engine_priority", None)
        spill_peers = getattr(args, "spill_peers", None)
        if slo > 0:
            # What is not set explicitly follows from the SLO (README, "The SLO flag").
            if admission.target_wait_s is None:
                admission = replace(admission, target_wait_s=slo_targets(slo), target_includes_prefill=True)
            elif any(t > slo for t in admission.target_wait_s.values()):
                raise ConfigError(
                    f"--admission-target-wait must not exceed --ttft-slo {slo:g}: a request admitted "
                    "after the SLO has passed misses it whatever the engines do"
                )
            engine_priority = engine_priority or "auto"
            spill_peers = SLO_SPILL_PEERS if spill_peers is None else spill_peers
        protocol = args.engine_protocol
        reserve = getattr(args, "kv_reserve_tokens", None)
        token_charge = TokenChargePolicy(
            chars_per_token=getattr(args, "chars_per_token", 3.0),
            reserve_tokens=(SGLANG_RESERVED_DECODE_TOKENS if protocol == "sglang" else 0)
            if reserve is None
            else reserve,
        )
        return cls(
            ttft_slo=slo,
            token_charge=token_charge,
            master_id=args.master_id,
            etcd=EtcdSettings.from_args(args),
            http_host=args.http_host,
            http_port=args.http_port,
            grpc_host=args.grpc_host,
            grpc_port=args.grpc_port,
            advertise_host=args.advertise_host,
            admin_host=args.admin_host,
            admin_port=args.admin_port,
            grpc_tls=server_tls_from_args(args),
            keepalive=args.keepalive,
            keepalive_timeout=args.keepalive_timeout,
            api_keys=tuple(args.api_key),
            api_keys_file=args.api_keys_file,
            drain_timeout=args.drain_timeout,
            shutdown_linger=args.shutdown_linger,
            max_node_capacity=args.max_node_capacity,
            max_nodes=args.max_nodes,
            max_reports_per_s=args.max_reports_per_s,
            max_body_bytes=args.max_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_headers=args.max_headers,
            max_start_args=args.max_start_args,
            max_start_arg_bytes=args.max_start_arg_bytes,
            limits=Limits(
                max_n=args.max_n, max_tokens=args.max_tokens, model=args.model, max_batch=args.max_batch
            ),
            engine_protocol=args.engine_protocol,
            prefill_selection=args.prefill_selection,
            engine_priority=engine_priority or "off",
            admission=admission,
            event_loop=args.event_loop,
            breaker=_breaker(args),
            max_retries=args.max_retries,
            spill_peers=spill_peers or 0,
            engine_connect_timeout=args.engine_connect_timeout,
            engine_first_byte_timeout=args.engine_first_byte_timeout,
            engine_idle_timeout=args.engine_idle_timeout,
        )


def _breaker(args: argparse.Namespace) -> BreakerPolicy:
    try:
        return BreakerPolicy(args.breaker_failures, args.breaker_backoff, args.breaker_backoff_max)
    except ValueError:
        raise ConfigError(
            f"--breaker-backoff {args.breaker_backoff:g} must not exceed "
            f"--breaker-backoff-max {args.breaker_backoff_max:g}"
        ) from None
