"""The fleet's own certificate authority: hosts serve TLS with certificates it signs, and accept only
clients that show its gateway certificate (mTLS), so a host's port is useless to anyone but a gateway.

    shoal fleet init --dir /etc/shoal/fleet            # ca.pem, ca.key, gateway.pem/.key, admin.key
    shoal fleet cert --dir /etc/shoal/fleet h1 --san 10.0.0.11 --out /etc/shoal/h1   # a host's server cert

Roles are in the certificate: the gateway's client certificate has OU=gateway and only the
clientAuth usage; server certificates have only serverAuth, so a host's certificate cannot call
another host (OpenSSL refuses a client certificate without clientAuth). EC P-256 keys, SHA-256.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InvalidArgument

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ImportError as e:  # an extra: a single host does not need it
    raise ImportError("the fleet's certificates need cryptography: pip install 'shoal[fleet]'") from e

CA_DAYS = 3650
CERT_DAYS = 365
GATEWAY_ROLE = "gateway"


@dataclass(frozen=True)
class FleetFiles:
    """Where `shoal fleet init` put things (under one directory)."""

    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def gateway_cert(self) -> Path:
        return self.dir / "gateway.pem"

    @property
    def gateway_key(self) -> Path:
        return self.dir / "gateway.key"

    @property
    def admin_key(self) -> Path:
        return self.dir / "admin.key"


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str, ou: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "shoal fleet"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if ou:
        attrs.insert(1, x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou))
    return x509.Name(attrs)


def _load_ca(files: FleetFiles) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not (files.ca_cert.exists() and files.ca_key.exists()):
        raise InvalidArgument(f"no fleet CA in {files.dir}: run `shoal fleet init --dir {files.dir}` first")
    cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(files.ca_key.read_bytes(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument(f"{files.ca_key} is not an EC key written by `shoal fleet init`")
    return cert, key


def _issue(files: FleetFiles, cn: str, *, ou: str | None, server: bool, sans: list[str], days: int
           ) -> tuple[bytes, bytes]:
    ca_cert, ca_key = _load_ca(files)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    b = (x509.CertificateBuilder().subject_name(_name(cn, ou)).issuer_name(ca_cert.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
         .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                      data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                      crl_sign=False, encipher_only=False, decipher_only=False), critical=True))
    if sans:
        names: list[x509.GeneralName] = []
        for s in sans:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(s)))
            except ValueError:
                names.append(x509.DNSName(s))
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def init_fleet(directory: str | os.PathLike, *, force: bool = False) -> FleetFiles:
    """A new CA, the gateways' client certificate and the fleet admin key, under `directory`
    (keys 0600). Refuses to overwrite an existing CA unless `force`."""
    files = FleetFiles(Path(directory))
    if files.ca_cert.exists() and not force:
        raise InvalidArgument(f"{files.ca_cert} exists: this fleet already has a CA (--force replaces it, and every "
                              "certificate it signed stops working)")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = _name("shoal fleet CA")
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, key_encipherment=False, content_commitment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(key, hashes.SHA256()))
    _write(files.ca_key, _key_pem(key), 0o600)
    _write(files.ca_cert, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    cert, gkey = _issue(files, "shoal gateway", ou=GATEWAY_ROLE, server=False, sans=[], days=CERT_DAYS)
    _write(files.gateway_key, gkey, 0o600)
    _write(files.gateway_cert, cert, 0o644)
    _write(files.admin_key, ("sk-fleet-" + secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    return files


def issue_server_cert(directory: str | os.PathLike, name: str, sans: list[str], out_dir: str | os.PathLike,
                      days: int = CERT_DAYS) -> tuple[Path, Path]:
    """A server certificate for a host (or a gateway's client-facing port) named `name`, valid for
    the DNS names / IP addresses in `sans`: (cert path, key path) under out_dir."""
    if not sans:
        raise InvalidArgument("a server certificate needs at least one --san (the host's DNS name or IP address)")
    cert, key = _issue(FleetFiles(Path(directory)), name, ou="host", server=True, sans=sans, days=days)
    out = Path(out_dir)
    _write(out / f"{name}.key", key, 0o600)
    _write(out / f"{name}.pem", cert, 0o644)
    return out / f"{name}.pem", out / f"{name}.key"


def gateway_client_context(directory: str | os.PathLike) -> ssl.SSLContext:
    """TLS for a gateway calling hosts: trusts only the fleet CA, shows the gateway certificate."""
    files = FleetFiles(Path(directory))
    ctx = ssl.create_default_context(cafile=str(files.ca_cert))
    ctx.load_cert_chain(str(files.gateway_cert), str(files.gateway_key))
    return ctx
