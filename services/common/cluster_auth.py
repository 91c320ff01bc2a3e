"""Trust inside the cluster: who may call a scheduler or a worker.

The internal hops (router -> scheduler -> worker, a worker registering, the admin RPCs Drain,
LoadAdapter, UnloadAdapter) carry prompts and control the pool, so a stranger who can reach a
port must get nothing from them. Two layers, either or both ([security] in the config):

- a shared cluster token (`token_file`, or $QOS_CLUSTER_TOKEN): every call to a scheduler or a
  worker carries it in the metadata `x-cluster-token`; without it, or with another, the call is
  refused with UNAUTHENTICATED before any handler runs. Health checks are exempt (probes).
  `qos-serve up` makes a random token for its cluster when none is configured.
- mutual TLS (`certs_dir`): every internal hop is TLS; each service presents its role's
  certificate (ROLE.pem, ROLE.key) and accepts a peer only with a certificate signed by the cluster
  CA (ca.pem). A client checks that the server's certificate names the role it wants to reach
  (DNS name qos-ROLE), whatever address it dials: pods come and go by IP. `qos-serve certs init DIR`
  makes a development CA and the certificates (services/tools/certs.py).

The router's public front is not covered here: it has API keys and its own TLS (router.tls_cert).
"""
from __future__ import annotations

import datetime
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.config import ConfigError

TOKEN_ENV = "QOS_CLUSTER_TOKEN"
TOKEN_KEY = "x-cluster-token"
ROLES = ("router", "scheduler", "worker", "admin")
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class TrustError(ConfigError):
    """The configured token or certificates cannot be used (a missing, expired or foreign file)."""


def role_name(role: str) -> str:
    """The DNS name a role's certificate carries and clients expect (ssl_target_name_override)."""
    return f"qos-{role}"


@dataclass(frozen=True)
class ClusterTrust:
    role: str                       # this process's role: whose certificate it presents
    token: str = ""
    certs_dir: Path | None = None

    @classmethod
    def load(cls, security, role: str) -> "ClusterTrust":
        """From the config's [security] table; $QOS_CLUSTER_TOKEN wins over token_file."""
        token = os.environ.get(TOKEN_ENV, "")
        if not token and security.token_file:
            path = Path(security.token_file).expanduser()
            try:
                token = path.read_text().strip()
            except OSError as exc:
                raise TrustError(f"security.token_file {path}: {exc.strerror}") from exc
            if not token:
                raise TrustError(f"security.token_file {path} is empty")
        certs = Path(security.certs_dir).expanduser() if security.certs_dir else None
        trust = cls(role, token, certs)
        if certs is not None:
            trust.check_certificates()
        return trust

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call to a scheduler or worker adds to its metadata."""
        return ((TOKEN_KEY, self.token),) if self.token else ()

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
    """No token, no certificates: a cluster that trusts its network (tests of the pure parts)."""
    return ClusterTrust(role)


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the cluster token (health checks excepted), before its handler.
    The refusing handler is made once per method, of the method's kind (unary or streaming)."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        given = next((value for key, value in handler_call_details.invocation_metadata or ()
                      if key == TOKEN_KEY), None)
        if given is not None and hmac.compare_digest(given.encode() if isinstance(given, str) else given,
                                                     self._token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        why = (f"{method} needs the cluster token in the metadata '{TOKEN_KEY}'" if given is None
               else f"{method}: the cluster token in '{TOKEN_KEY}' is not this cluster's")
        return _refusing(handler, why)


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield                                      # an async generator, as streaming handlers are

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary)
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=unary)
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=stream)
    return handler._replace(stream_stream=stream)
