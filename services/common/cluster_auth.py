"""Trust inside the cluster: who is calling a scheduler or a worker, and which role it plays.

The internal hops (router -> scheduler -> worker, a worker registering, the admin RPCs Drain,
LoadAdapter, UnloadAdapter) carry prompts and control the pool, so a stranger who can reach a
port must get nothing from them, and one component must get no more than its role needs: a
worker's credentials must not Submit work past the router's keys and ledger, nor drive another
worker. Each role (router, scheduler, worker, admin) has a credential of its own, by either or
both layers ([security] in the config):

- a token per role (`tokens_dir`, or $QOS_CLUSTER_TOKEN with $QOS_CLUSTER_ROLES): every call to
  a scheduler or a worker carries the caller's token in the metadata `x-cluster-token`; the
  callee knows each role's token only by its SHA-256 digest (the file `roles`), so holding the
  digests lets a service tell callers apart without being able to act as any of them.
  `qos-serve tokens init DIR` makes the tokens; `qos-serve up` makes them for its cluster.
- mutual TLS (`certs_dir`): every internal hop is TLS; each service presents its role's
  certificate (ROLE.pem, ROLE.key) and accepts a peer only with a certificate signed by the
  cluster CA (ca.pem), whose name says its role (qos-ROLE). A client checks that the server's
  certificate names the role it wants to reach, whatever address it dials: pods come and go by
  IP. `qos-serve certs init DIR` makes a development CA and the certificates (services/tools/certs.py).

Which role may call which method: services/common/cluster_roles.py. Without either layer a
service is open, and then it listens on loopback only. The router's public front is not covered
here: it has API keys and its own TLS (router.tls_cert).
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.config import ConfigError

TOKEN_ENV = "QOS_CLUSTER_TOKEN"        # this process's own token
ROLES_ENV = "QOS_CLUSTER_ROLES"        # every role's token digest: "router=HEX,scheduler=HEX,..."
TOKEN_KEY = "x-cluster-token"
ROLES = ("router", "scheduler", "worker", "admin")
ROLES_FILE = "roles"
CA_KEY = "ca.key"


class TrustError(ConfigError):
    """The configured tokens or certificates cannot be used (a missing, expired or foreign file)."""


def role_name(role: str) -> str:
    """The DNS name a role's certificate carries and clients expect (ssl_target_name_override)."""
    return f"qos-{role}"


def token_digest(token: str | bytes) -> str:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()


def parse_roles(text: str, where: str) -> dict[str, str]:
    """`role=digest` entries, separated by commas or newlines -> {digest: role}."""
    digests: dict[str, str] = {}
    for entry in text.replace(",", "\n").splitlines():
        entry = entry.split("#", 1)[0].strip()
        if not entry:
            continue
        role, sep, digest = entry.partition("=")
        role, digest = role.strip(), digest.strip().lower()
        if not sep or role not in ROLES or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise TrustError(f"{where}: {entry!r} is not ROLE=SHA256 (roles: {', '.join(ROLES)})")
        if digest in digests:
            raise TrustError(f"{where}: {role} and {digests[digest]} have the same token")
        digests[digest] = role
    return digests


# --- tokens: `qos-serve tokens init` (services/tools/tokens.py), `qos-serve up` ------------------

def make_tokens(roles: tuple[str, ...] = ROLES) -> dict[str, str]:
    return {role: f"qos-{role}-{secrets.token_urlsafe(32)}" for role in roles}


def roles_text(tokens: dict[str, str]) -> str:
    return "".join(f"{role}={token_digest(token)}\n" for role, token in tokens.items())


def write_tokens(directory: Path, tokens: dict[str, str]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    for role, token in tokens.items():
        path = directory / f"{role}.token"
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(token + "\n")
    (directory / ROLES_FILE).write_text(roles_text(tokens))
    return sorted(directory.iterdir())


def is_loopback(address: str) -> bool:
    """Whether a listen address (HOST:PORT) is reachable from this machine only."""
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ClusterTrust:
    role: str                       # this process's role: whose token and certificate it presents
    token: str = ""
    digests: dict[str, str] = field(default_factory=dict)     # token digest -> role
    certs_dir: Path | None = None

    @classmethod
    def load(cls, security, role: str) -> "ClusterTrust":
        """From the config's [security] table; $QOS_CLUSTER_TOKEN and $QOS_CLUSTER_ROLES win
        over the files of tokens_dir."""
        tokens = Path(security.tokens_dir).expanduser() if security.tokens_dir else None
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token and tokens is not None:
            token = _read(tokens / f"{role}.token", "security.tokens_dir").strip()
            if not token:
                raise TrustError(f"security.tokens_dir: {tokens / (role + '.token')} is empty")
        roles_text = os.environ.get(ROLES_ENV, "")
        where = f"${ROLES_ENV}"
        if not roles_text and tokens is not None:
            roles_text, where = _read(tokens / ROLES_FILE, "security.tokens_dir"), str(tokens / ROLES_FILE)
        digests = parse_roles(roles_text, where)
        if token and not digests:
            raise TrustError(f"a cluster token without the roles' digests cannot tell a router from a worker: "
                             f"set security.tokens_dir (a folder with ROLE.token and {ROLES_FILE}) or "
                             f"${ROLES_ENV}; `qos-serve tokens init DIR` makes both")
        if token and digests.get(token_digest(token)) != role:
            found = digests.get(token_digest(token))
            raise TrustError(f"this {role}'s token is " + (f"the {found}'s" if found else "in no role's digest")
                             + f" ({where})")
        certs = Path(security.certs_dir).expanduser() if security.certs_dir else None
        trust = cls(role, token, digests, certs)
        if certs is not None:
            trust.check_certificates()
        return trust

    @property
    def guarded(self) -> bool:
        """Whether callers must prove a role (a token, a certificate or both)."""
        return bool(self.digests) or self.certs_dir is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call to a scheduler or worker adds to its metadata."""
        return ((TOKEN_KEY, self.token),) if self.token else ()

    def refuse_open(self, service: str, address: str) -> None:
        """A scheduler or worker with neither layer is open to whoever reaches its port: allowed
        on loopback only, where nothing but this machine reaches it."""
        if not self.guarded and not is_loopback(address):
            raise TrustError(f"{service}: refusing to listen on {address} with no cluster credentials "
                             f"(anyone who reaches it could submit work or drive workers): set "
                             f"security.tokens_dir (`qos-serve tokens init DIR`) or security.certs_dir "
                             f"(`qos-serve certs init DIR`), or listen on 127.0.0.1")

    # --- certificates ------------------------------------------------------------------------

    def _file(self, name: str) -> bytes:
        path = self.certs_dir / name
        try:
            return path.read_bytes()
        except OSError as exc:
            raise TrustError(f"security.certs_dir: cannot read {path} ({exc.strerror}); "
                             f"`qos-serve certs init {self.certs_dir}` makes the files") from exc

    def check_certificates(self) -> None:
        """Refuse to start on a certificate that is expired, not yet valid, or not signed by the
        cluster CA: better one precise line at start than handshakes failing later."""
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        if (self.certs_dir / CA_KEY).exists():
            raise TrustError(f"{self.certs_dir / CA_KEY}: the CA's private key is in the folder services read; "
                             f"whoever reads it can issue any role's certificate. Keep it apart (`qos-serve "
                             f"certs init` writes it to {self.certs_dir}-ca/) and remove it here")
        ca = x509.load_pem_x509_certificate(self._file("ca.pem"))
        cert = x509.load_pem_x509_certificate(self._file(f"{self.role}.pem"))
        now = datetime.datetime.now(datetime.timezone.utc)
        for name, c in (("ca.pem", ca), (f"{self.role}.pem", cert)):
            if now > c.not_valid_after_utc:
                raise TrustError(f"{self.certs_dir / name} expired on {c.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
            if now < c.not_valid_before_utc:
                raise TrustError(f"{self.certs_dir / name} is not valid before "
                                 f"{c.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise TrustError(f"{self.certs_dir / (self.role + '.pem')} is not signed by the cluster CA "
                             f"{self.certs_dir / 'ca.pem'}") from exc

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """mTLS: our certificate, and a client certificate from the cluster CA required."""
        if self.certs_dir is None:
            return None
        return grpc.ssl_server_credentials([(self._file(f"{self.role}.key"), self._file(f"{self.role}.pem"))],
                                           root_certificates=self._file("ca.pem"), require_client_auth=True)

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._file("ca.pem"),
                                            private_key=self._file(f"{self.role}.key"),
                                            certificate_chain=self._file(f"{self.role}.pem"))

    def channel(self, address: str, peer_role: str, options=()) -> grpc.aio.Channel:
        """An asyncio channel to a scheduler or worker (`peer_role`)."""
        return self._open(grpc.aio, address, peer_role, options)

    def sync_channel(self, address: str, peer_role: str, options=()) -> grpc.Channel:
        return self._open(grpc, address, peer_role, options)

    def _open(self, api, address: str, peer_role: str, options):
        """`api`: grpc or grpc.aio, which name their channel constructors alike."""
        if self.certs_dir is None:
            return api.insecure_channel(address, options=list(options))
        return api.secure_channel(address, self._channel_credentials(),
                                  options=[*options, ("grpc.ssl_target_name_override", role_name(peer_role))])


def no_trust(role: str = "admin") -> ClusterTrust:
    """No token, no certificates: a cluster that trusts its network (loopback; tests of the pure parts)."""
    return ClusterTrust(role)


def _read(path: Path, setting: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise TrustError(f"{setting}: cannot read {path} ({exc.strerror}); "
                         f"`qos-serve tokens init {path.parent}` makes the files") from exc
