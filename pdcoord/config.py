"""Command-line helpers shared by every entry point.

Every flag is also settable through an environment variable named ``<PREFIX>_<FLAG>`` (upper case,
dashes as underscores), e.g. ``--http-port`` of ``pdmaster`` is ``PDMASTER_HTTP_PORT``. The command
line wins over the environment, the environment over the default.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcoord.tls import TLSConfigError, check_ca, check_pair, read_pem_file


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    # A secret's default may come from the environment: --help must not print it.
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if getattr(action, "secret", False):
            return action.help
        return super()._get_help_string(action)


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to ``$PREFIX_OPTION`` when that variable is set.

    ``secret=True`` on an option keeps its (environment) default out of ``--help``. A repeatable
    (``append``) option reads a comma-separated list from its variable.
    """

    def __init__(self, *args: Any, env_prefix: str, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix.upper()

    def env_name(self, option: str) -> str:
        return f"{self.env_prefix}_{option.lstrip('-').replace('-', '_').upper()}"

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Any:
        # Groups add actions through their own add_argument; route it through the env logic too.
        group = super().add_argument_group(*args, **kwargs)
        plain = group.add_argument

        def add(*a: Any, secret: bool = False, **kw: Any) -> argparse.Action:
            action = plain(*a, **kw)
            action.secret = secret  # type: ignore[attr-defined]
            return self._apply_env(action)

        group.add_argument = add  # type: ignore[method-assign]
        return group

    def add_argument(self, *args: Any, secret: bool = False, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        action.secret = secret  # type: ignore[attr-defined]
        return self._apply_env(action)

    def _apply_env(self, action: argparse.Action) -> argparse.Action:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or isinstance(action, argparse._HelpAction):
            return action
        env = self.env_name(longs[0])
        action.help = f"{action.help or ''} [env {env}]".strip()
        raw = os.environ.get(env)
        if raw is not None:
            if isinstance(action, argparse._StoreTrueAction):
                action.default = raw.strip().lower() in {"1", "true", "yes", "on"}
            elif isinstance(action, argparse._StoreFalseAction):
                action.default = raw.strip().lower() not in {"1", "true", "yes", "on"}
            elif isinstance(action, argparse._AppendAction):
                try:
                    convert = action.type if callable(action.type) else str
                    action.default = [convert(x.strip()) for x in raw.split(",") if x.strip()]
                except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                    self.error(f"environment variable {env} (for {longs[0]}): invalid value: {exc}")
            else:
                try:
                    action.default = action.type(raw) if callable(action.type) else raw
                except (TypeError, ValueError) as exc:
                    self.error(f"environment variable {env} (for {longs[0]}): invalid value {raw!r}: {exc}")
            action.required = False
        return action


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {text}")
    return value


def etcd_endpoints(text: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT…]`` (an ``http://`` prefix is tolerated) → ``["host:port", …]``."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
        if not part:
            continue
        host, sep, p = part.rpartition(":")
        if not sep or not host or not p.isdigit():
            raise argparse.ArgumentTypeError(f"expected HOST:PORT[,HOST:PORT...], got {text!r}")
        out.append(f"{host}:{int(p)}")
    if not out:
        raise argparse.ArgumentTypeError("at least one etcd endpoint is required")
    return out


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def add_common_flags(parser: EnvArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    return parser.parse_args(list(argv) if argv is not None else None)


# -- the flags both binaries share: etcd and its security ------------------------------------------
def add_etcd_flags(parser: EnvArgumentParser) -> Any:
    """``--etcd``, ``--cluster``, ``--etcd-prefix``, ``--lease-ttl`` (in a "cluster" group, returned so
    the binary can add its own id flag to it) and the etcd security flags."""
    g = parser.add_argument_group("cluster")
    g.add_argument(
        "--etcd", type=etcd_endpoints, default=["127.0.0.1:2379"], help="etcd HOST:PORT[,HOST:PORT...]"
    )
    g.add_argument("--cluster", default="default", help="cluster name; keys live under /pdcoord/<cluster>/")
    g.add_argument("--etcd-prefix", default=None, help="override the etcd key prefix")
    g.add_argument("--lease-ttl", type=positive_int, default=5, help="etcd lease TTL in seconds")
    _add_etcd_security_flags(parser)
    return g


@dataclass(frozen=True)
class EtcdSettings:
    """Where etcd is and how to talk to it, from :func:`add_etcd_flags`."""

    endpoints: list[str]
    cluster: str = "default"
    prefix: str | None = None
    lease_ttl: int = 5
    options: dict[str, Any] = field(default_factory=dict)  # EtcdClient TLS / auth keywords

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EtcdSettings:
        """TLSConfigError (naming the flag) for unreadable or inconsistent security flags."""
        return cls(args.etcd, args.cluster, args.etcd_prefix, args.lease_ttl, etcd_options_from_args(args))


def _add_etcd_security_flags(parser: EnvArgumentParser) -> None:
    g = parser.add_argument_group("etcd security")
    g.add_argument("--etcd-ca", default=None, help="PEM CA bundle of etcd's server certificate (enables TLS)")
    g.add_argument("--etcd-cert", default=None, help="PEM client certificate for etcd (client-cert-auth)")
    g.add_argument("--etcd-key", default=None, help="PEM private key of --etcd-cert")
    g.add_argument("--etcd-user", default=None, help="etcd user name (auth enabled on etcd)")
    g.add_argument(
        "--etcd-password",
        default=None,
        secret=True,
        help="etcd password (prefer the environment variable or --etcd-password-file)",
    )
    g.add_argument("--etcd-password-file", default=None, help="file whose first line is the etcd password")


def etcd_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for :class:`pdcoord.etcd.EtcdClient` from the etcd security flags."""
    if (args.etcd_cert is None) != (args.etcd_key is None):
        raise TLSConfigError("--etcd-cert and --etcd-key must be given together")
    if args.etcd_cert is not None and args.etcd_ca is None:
        raise TLSConfigError("--etcd-cert needs --etcd-ca (client certificates are only sent over TLS)")
    opts: dict[str, Any] = {}
    if args.etcd_ca is not None:
        opts["ca_cert"] = read_pem_file(args.etcd_ca, "--etcd-ca")
        check_ca(args.etcd_ca, "--etcd-ca")
    if args.etcd_cert is not None:
        opts["cert_chain"] = read_pem_file(args.etcd_cert, "--etcd-cert")
        opts["cert_key"] = read_pem_file(args.etcd_key, "--etcd-key")
        check_pair(args.etcd_cert, args.etcd_key, "--etcd-cert", "--etcd-key")
    password = args.etcd_password
    if args.etcd_password_file is not None:
        if password is not None:
            raise TLSConfigError("give --etcd-password or --etcd-password-file, not both")
        try:
            lines = Path(args.etcd_password_file).read_text().splitlines()
        except OSError as exc:
            raise TLSConfigError(
                f"--etcd-password-file {args.etcd_password_file}: cannot read: {exc.strerror or exc}"
            ) from exc
        password = lines[0] if lines else ""
    if args.etcd_user is None and password is not None:
        raise TLSConfigError("an etcd password was given without --etcd-user")
    if args.etcd_user is not None:
        if not password:
            raise TLSConfigError(
                "--etcd-user needs a password (--etcd-password, its environment variable, "
                "or --etcd-password-file)"
            )
        opts["username"] = args.etcd_user
        opts["password"] = password
    return opts
