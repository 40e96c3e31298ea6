"""``pdcoord``: the fleet's status (``pdcoord status``) and developer utilities (local etcd, the demo)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdcoord.config import port, positive_float, setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcoord", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("etcd", help="run a local single-member etcd in the foreground (development)")
    e.add_argument("--port", type=port, default=2379, help="client port on 127.0.0.1")
    e.add_argument("--peer-port", type=port, default=None, help="peer port (default: port + 1)")
    e.add_argument("--data-dir", required=True, help="etcd data directory (kept across runs)")
    e.add_argument("--cert-file", default=None, help="serve clients over TLS with this certificate (PEM)")
    e.add_argument("--key-file", default=None, help="private key of --cert-file (PEM)")
    e.add_argument(
        "--trusted-ca-file",
        default=None,
        help="with --cert-file: require client certificates signed by this CA (etcd --client-cert-auth)",
    )
    e.add_argument(
        "--metrics-port", type=port, default=None, help="plain-HTTP /health and /metrics port (with TLS)"
    )

    # `pdcoord status` parses its own flags (pdcoord.status, with the binaries' etcd flags and their
    # PDCOORD_* environment variables); listed here for `pdcoord --help`.
    sub.add_parser("status", help="show the fleet: masters, nodes, shares and epochs, and what is wrong",
                   add_help=False)  # fmt: skip

    d = sub.add_parser(
        "demo",
        help="run a local cluster (etcd, 2 masters, engines with agents), load it, kill a master, summarise",
    )
    d.add_argument("--duration", type=positive_float, default=30.0, help="seconds of client load")
    d.add_argument("--keep", action="store_true", help="leave the cluster running and print how to reach it")
    d.add_argument("--seed", type=int, default=1, help="workload random seed")
    d.add_argument("--log-dir", default=None, help="where process logs go (default: a temp dir)")
    d.add_argument(
        "--failover-budget",
        type=positive_float,
        default=2.0,
        help="seconds the survivor may take to hold the full capacity after the kill (an invariant)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["status"]:  # an operator command: its logic is runtime code, not the dev kit
        from pdcoord.status import main as status_main

        sys.exit(status_main(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.command == "etcd":
        from pdcoord.dev.etcd_server import EtcdServerTLS, run_foreground

        tls = None
        if args.cert_file or args.key_file:
            if not (args.cert_file and args.key_file):
                sys.exit("pdcoord etcd: --cert-file and --key-file go together")
            tls = EtcdServerTLS(args.cert_file, args.key_file, args.trusted_ca_file)
        elif args.trusted_ca_file:
            sys.exit("pdcoord etcd: --trusted-ca-file needs --cert-file and --key-file")
        sys.exit(
            run_foreground(
                args.port, args.data_dir, peer_port=args.peer_port, tls=tls, metrics_port=args.metrics_port
            )
        )
    if args.command == "demo":
        setup_logging("warning", "pdcoord-demo")
        from pdcoord.dev.demo import run_demo

        sys.exit(run_demo(args))


if __name__ == "__main__":
    main()
