"""`qos-serve certs init DIR`: a development CA and a certificate for each role of the cluster.

Writes DIR/ca.pem (the cluster CA's certificate), DIR-ca/ca.key (its private key, apart: DIR is
what services mount, and whoever reads the CA's key can issue any role's certificate; services
refuse to start with ca.key in their folder), and for each role (router, scheduler, worker,
admin) DIR/ROLE.pem and DIR/ROLE.key: an EC P-256 key and a certificate signed by the CA, named
qos-ROLE (the name clients check, services/common/cluster_auth.py) and also valid for localhost,
127.0.0.1 and every --host given, usable both as a server and as a client. Private keys are
written readable by their owner only. For production, issue the same files from your own CA
(cert-manager on Kubernetes): the services only need ca.pem, ROLE.pem and ROLE.key.
"""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.cluster_auth import CA_KEY, ROLES, role_name

DEFAULT_DAYS = 365


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "qos-serve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def make_ca(not_before: datetime.datetime, not_after: datetime.datetime,
            name: str = "qos-serve development CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key, ca_cert: x509.Certificate, role: str, not_before: datetime.datetime,
          not_after: datetime.datetime, hosts: tuple[str, ...] = ()) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A key and a certificate for `role`, signed by the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(role_name(role)), x509.DNSName("localhost"),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder().subject_name(_name(role_name(role))).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_pair(directory: Path, stem: str, key, cert: x509.Certificate) -> None:
    _write_key(directory / f"{stem}.key", key)
    (directory / f"{stem}.pem").write_bytes(cert_pem(cert))


def ca_key_dir(directory: Path) -> Path:
    """Where `init` keeps the CA's private key: a folder beside DIR, never inside it."""
    directory = directory.expanduser().absolute()
    return directory.with_name(directory.name + "-ca")


def init(directory: Path, days: int = DEFAULT_DAYS, hosts: tuple[str, ...] = (), force: bool = False,
         roles: tuple[str, ...] = ROLES, ca_dir: Path | None = None) -> list[Path]:
    """The CA and every role's files in `directory`, the CA's key in `ca_dir` (default DIR-ca);
    the files written. Refuses to replace an existing CA without `force`: certificates issued by
    it would stop being trusted."""
    ca_dir = ca_dir or ca_key_dir(directory)
    if ca_dir.expanduser().absolute() == directory.expanduser().absolute():
        raise ValueError(f"the CA's key goes apart from {directory}, which services mount: choose another --ca-dir")
    for existing in (ca_dir / CA_KEY, directory / CA_KEY, directory / "ca.pem"):
        if existing.exists() and not force:
            raise FileExistsError(f"{existing} exists; --force replaces the CA and every certificate")
    directory.mkdir(parents=True, exist_ok=True)
    ca_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key, ca_cert = make_ca(start, end)
    _write_key(ca_dir / CA_KEY, ca_key)
    (directory / CA_KEY).unlink(missing_ok=True)          # one left by an older init
    (directory / "ca.pem").write_bytes(cert_pem(ca_cert))
    for role in roles:
        key, cert = issue(ca_key, ca_cert, role, start, end, hosts)
        write_pair(directory, role, key, cert)
    return [*sorted(directory.iterdir()), ca_dir / CA_KEY]
