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


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


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
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
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


def unnamed(cert_path: Path, hosts: list[str]) -> list[str]:
    """The ``hosts`` a server certificate is not valid for (SuperNodes connecting by those
    names would fail the TLS check); addresses compared as addresses, names case-blind."""
    def canon(h: str) -> str:
        try:
            return ipaddress.ip_address(h.strip("[]")).compressed
        except ValueError:
            return h.lower()

    try:
        named = {canon(h) for h in san_hosts(cert_path)}
    except x509.ExtensionNotFound:
        named = set()
    return sorted(h for h in hosts if canon(h) not in named)


def make_node_key(path: Path) -> Path:
    """An EC key pair for SuperNode authentication: ``path`` (private) and ``path.pub``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    pub = path.with_name(path.name + ".pub")
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b"\n")
    return pub
