"""TLS certificates and SuperNode authentication keys for a deployment (``flowerbed deploy certs``).

A self-signed CA signs one server certificate for the SuperLink, whose subject alternative names
must list every name or IP address SuperNodes and ``flwr`` use to reach it. SuperNodes verify the
SuperLink with the CA certificate (``--root-certificates``); the SuperLink itself needs the
certificate, its key and the CA (``--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile``).

SuperNode authentication keys are EC (NIST P-384) key pairs in OpenSSH format, which is what
``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT, SERVER_CERT, SERVER_KEY = "ca.crt", "server.crt", "server.key"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "flowerbed"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``host`` spells, an IPv6 literal bracketed or not (``[::1]``, ``::1``);
    None for a host name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    # an IPv6 literal as written in an address ([2001:db8::5]) is an IP entry too
    return x509.SubjectAlternativeName([x509.DNSName(h) if (ip := ip_of(h)) is None
                                        else x509.IPAddress(ip) for h in hosts])


def _write_private(path: Path, data: bytes) -> None:
    """A private key file, readable by its owner only from the moment it exists."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    _write_private(path, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))


def _usage(**on: bool) -> x509.KeyUsage:
    flags = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
             "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{f: on.get(f, False) for f in flags})


def make_certs(out: Path, hosts: list[str] | tuple[str, ...] = DEFAULT_HOSTS,
               days: int = 365) -> dict[str, Path]:
    """Write ``ca.crt`` (+ ``ca.key``), ``server.crt`` and ``server.key`` into ``out``.

    ``hosts``: every DNS name or IP address the SuperLink is reached by (SANs).
    """
    hosts = list(dict.fromkeys(hosts))
    if not hosts:
        raise ValueError("make_certs needs at least one host name or IP address for the SuperLink")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder().subject_name(_name("flowerbed CA")).issuer_name(_name("flowerbed CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(_usage(digital_signature=True, key_cert_sign=True, crl_sign=True),
                         critical=True)
          # key identifiers: Python >= 3.13's default TLS context (VERIFY_X509_STRICT) needs them
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(_usage(digital_signature=True), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_key(out / "ca.key", ca_key)
    (out / CA_CERT).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_key(out / SERVER_KEY, key)
    (out / SERVER_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return {"ca": out / CA_CERT, "cert": out / SERVER_CERT, "key": out / SERVER_KEY}


def san_hosts(cert_path: Path) -> list[str]:
    """The names and addresses a server certificate is valid for."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in san.get_values_for_type(x509.DNSName)] + \
        [str(v) for v in san.get_values_for_type(x509.IPAddress)]


def expires(cert_path: Path) -> dt.datetime:
    """When a certificate stops being valid (UTC)."""
    return x509.load_pem_x509_certificate(Path(cert_path).read_bytes()).not_valid_after_utc


def unnamed(cert_path: Path, hosts: list[str]) -> list[str]:
    """The ``hosts`` a server certificate is not valid for (SuperNodes connecting by those
    names would fail the TLS check); addresses compared as addresses, names case-blind."""
    def canon(h: str) -> str:
        return h.lower() if (ip := ip_of(h)) is None else ip.compressed

    try:
        named = {canon(h) for h in san_hosts(cert_path)}
    except x509.ExtensionNotFound:
        named = set()
    return sorted(h for h in hosts if canon(h) not in named)


def make_node_key(path: Path, force: bool = False) -> Path:
    """An EC key pair for SuperNode authentication: ``path`` (private) and ``path.pub``; an
    existing pair is kept unless ``force`` (a registered SuperNode could not authenticate)."""
    path = Path(path)
    if not force and (path.exists() or path.with_name(path.name + ".pub").exists()):
        from flowerbed.config import ConfigError

        raise ConfigError("--out", str(path), "holds a key pair already (a SuperNode may be "
                          "registered with it); --force replaces it")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(path, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
    pub = path.with_name(path.name + ".pub")
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b"\n")
    return pub
