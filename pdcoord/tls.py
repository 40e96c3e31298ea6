"""Transport security: gRPC TLS / mTLS credentials and etcd TLS + auth options, with their flags.

Every file is read and checked once at startup (``ssl`` loads the certificate, the key and the CA
the way a TLS stack would), so a wrong path, a key that does not match its certificate or a file
that is not PEM stops the process with an error naming the flag, instead of failing every
handshake later.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

if TYPE_CHECKING:
    from pdcoord.config import EnvArgumentParser


class TLSConfigError(ValueError):
    """A TLS / credential setting that cannot work, phrased for the operator (names the flag)."""


def read_pem_file(path: str | Path, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise TLSConfigError(f"{flag} {path}: not a PEM file")
    return data


def check_pair(cert: str | Path, key: str | Path, cert_flag: str, key_flag: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        raise TLSConfigError(
            f"{cert_flag} {cert} / {key_flag} {key}: not a usable certificate and matching key ({exc.reason})"
        ) from exc


def check_ca(ca: str | Path, flag: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=str(ca))
    except ssl.SSLError as exc:
        raise TLSConfigError(f"{flag} {ca}: not a usable CA bundle ({exc.reason})") from exc


@dataclass(frozen=True)
class ServerTLS:
    """The master's gRPC server identity; with ``client_ca`` every agent must present a certificate
    signed by it (mutual TLS)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None

    @classmethod
    def load(
        cls,
        cert: str | Path,
        key: str | Path,
        client_ca: str | Path | None = None,
        *,
        flags: tuple[str, str, str] = ("--grpc-tls-cert", "--grpc-tls-key", "--grpc-tls-client-ca"),
    ) -> ServerTLS:
        cert_b, key_b = read_pem_file(cert, flags[0]), read_pem_file(key, flags[1])
        check_pair(cert, key, flags[0], flags[1])
        ca_b = None
        if client_ca is not None:
            ca_b = read_pem_file(client_ca, flags[2])
            check_ca(client_ca, flags[2])
        return cls(cert_b, key_b, ca_b)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class ClientTLS:
    """The agent's view of a master: the CA that must have signed it, optionally our own identity
    (for mTLS) and the name the master's certificate must carry when it differs from the address."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None

    @classmethod
    def load(
        cls,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> ClientTLS:
        if (cert is None) != (key is None):
            raise TLSConfigError("--grpc-tls-cert and --grpc-tls-key must be given together")
        ca_b = None
        if ca is not None:
            ca_b = read_pem_file(ca, "--grpc-tls-ca")
            check_ca(ca, "--grpc-tls-ca")
        cert_b = key_b = None
        if cert is not None and key is not None:
            cert_b, key_b = read_pem_file(cert, "--grpc-tls-cert"), read_pem_file(key, "--grpc-tls-key")
            check_pair(cert, key, "--grpc-tls-cert", "--grpc-tls-key")
        return cls(ca_b, cert_b, key_b, server_name or None)

    def credentials(self) -> grpc.ChannelCredentials:
        # ca None: the system roots (a master certificate from a public CA).
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def options(self) -> list[tuple[str, Any]]:
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def grpc_channel(
    address: str, tls: ClientTLS | None, options: list[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """A channel to a master: plaintext without ``tls``, otherwise verified TLS (mTLS with a cert)."""
    opts = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, tls.credentials(), options=opts + tls.options())


_TLS_FAILURE_MARKERS = ("ssl", "tls", "handshake", "certificate", "verification", "tsi_", "x509", "alpn")


def looks_like_tls_failure(details: str | None) -> bool:
    """True when a gRPC error text reports a TLS handshake / verification problem (not an outage)."""
    text = (details or "").lower()
    return any(m in text for m in _TLS_FAILURE_MARKERS)


# -- flags --------------------------------------------------------------------------------------


def add_grpc_server_tls_flags(parser: EnvArgumentParser) -> None:
    g = parser.add_argument_group("gRPC TLS (agents → this master)")
    g.add_argument("--grpc-tls-cert", default=None, help="PEM certificate (chain) of the gRPC server")
    g.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    g.add_argument(
        "--grpc-tls-client-ca",
        default=None,
        help="PEM CA bundle; when set, agents must present a client certificate signed by it (mTLS)",
    )


def server_tls_from_args(args: argparse.Namespace) -> ServerTLS | None:
    cert, key, ca = args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_client_ca
    if cert is None and key is None:
        if ca is not None:
            raise TLSConfigError("--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key")
        return None
    if cert is None or key is None:
        raise TLSConfigError("--grpc-tls-cert and --grpc-tls-key must be given together")
    return ServerTLS.load(cert, key, ca)


def add_grpc_client_tls_flags(parser: EnvArgumentParser) -> None:
    g = parser.add_argument_group("gRPC TLS (this agent → masters)")
    g.add_argument(
        "--grpc-tls",
        action="store_true",
        help="use TLS to masters with the system CA roots (implied by --grpc-tls-ca/--grpc-tls-cert)",
    )
    g.add_argument("--grpc-tls-ca", default=None, help="PEM CA bundle that must have signed the masters")
    g.add_argument("--grpc-tls-cert", default=None, help="PEM client certificate for mTLS")
    g.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    g.add_argument(
        "--grpc-tls-server-name",
        default=None,
        help="name the masters' certificates must carry (default: the host of their advertised address)",
    )


def client_tls_from_args(args: argparse.Namespace) -> ClientTLS | None:
    wanted = args.grpc_tls or any(
        v is not None for v in (args.grpc_tls_ca, args.grpc_tls_cert, args.grpc_tls_key)
    )
    if not wanted:
        if args.grpc_tls_server_name:
            raise TLSConfigError("--grpc-tls-server-name needs TLS (--grpc-tls or --grpc-tls-ca)")
        return None
    return ClientTLS.load(args.grpc_tls_ca, args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_server_name)
