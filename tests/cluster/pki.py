"""Throw-away certificate authorities and certificates for the TLS tests, made with the openssl CLI."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class CA:
    name: str
    cert: str
    key: str
    directory: Path

    def issue(self, name: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> Pair:
        """A leaf certificate good for both server and client authentication."""
        d = self.directory
        sans = [f"DNS:{n}" for n in dns] + [f"IP:{i}" for i in ips]
        ext = d / f"{name}.ext"
        ext.write_text(
            "basicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
            + (f"subjectAltName={','.join(sans)}\n" if sans else "")
        )
        _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", self.cert, "-CAkey", self.key,
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", str(ext), cwd=d,
        )  # fmt: skip
        return Pair(str(d / f"{name}.crt"), str(d / f"{name}.key"))


def make_ca(directory: Path, name: str) -> CA:
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory,
    )  # fmt: skip
    return CA(name, str(directory / f"{name}.crt"), str(directory / f"{name}.key"), directory)


@dataclass(frozen=True)
class PKI:
    """A trusted CA with server and client certificates, and a rogue CA nobody trusts."""

    ca: CA
    rogue: CA
    server: Pair  # SANs: localhost, 127.0.0.1, master.pdcoord.test
    wrong_host: Pair  # SAN: elsewhere.example only
    client: Pair
    rogue_client: Pair


def make_pki(directory: Path) -> PKI:
    ca = make_ca(directory / "ca", "pdcoord-test-ca")
    rogue = make_ca(directory / "rogue", "rogue-ca")
    return PKI(
        ca=ca,
        rogue=rogue,
        server=ca.issue("server", dns=("localhost", "master.pdcoord.test"), ips=("127.0.0.1",)),
        wrong_host=ca.issue("wrong-host", dns=("elsewhere.example",)),
        client=ca.issue("client", dns=("agent.pdcoord.test",)),
        rogue_client=rogue.issue("rogue-client", dns=("agent.pdcoord.test",)),
    )
