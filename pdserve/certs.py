"""`pdserve certs`: a private CA for one cluster and the certificate its members share (mtls mode).

The CA signs one node certificate that every component presents, as server and as client; its
name is the cluster's (pdcommon.security.CLUSTER_NAME), not a host's, so the same files serve
pods and Ray actors on any address. Whoever holds a certificate from this CA is a member: keep
ca.key off the cluster (it is only needed to issue more), and ship the rest as a secret."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdcommon.security import CA_FILE, CERT_FILE, CLUSTER_NAME, KEY_FILE, write_secret

CA_KEY_FILE = "ca.key"


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _alt_names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(CLUSTER_NAME), x509.DNSName("localhost")]
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def make_certs(out: str | Path, hosts: list[str] | None = None, days: int = 365) -> Path:
    """Write ca.pem, ca.key, node.pem and node.key (keys 0600) into `out`."""
    out = Path(out)
    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(f"{CLUSTER_NAME} CA")).issuer_name(_name(f"{CLUSTER_NAME} CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    node = (x509.CertificateBuilder().subject_name(_name(CLUSTER_NAME)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_alt_names(hosts or [])), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    out.mkdir(parents=True, exist_ok=True)
    (out / CA_FILE).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / CERT_FILE).write_bytes(node.public_bytes(serialization.Encoding.PEM))
    write_secret(out / KEY_FILE, _pem_key(key))
    write_secret(out / CA_KEY_FILE, _pem_key(ca_key))
    return out
