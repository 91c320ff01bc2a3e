"""Which role may call which method of a scheduler or a worker, and the interceptor that holds
every call to it.

A caller's role comes from its credentials (services/common/cluster_auth.py): the token in
`x-cluster-token`, known here by its digest, and/or the name on its client certificate
(qos-ROLE, signed by the cluster CA). Where both layers are on, both must name the same role.
A method missing from the table is refused to everyone: a new RPC is closed until someone
decides who needs it (tests/unit/test_cluster_roles.py checks that the table names every method
the protos define). Health checks are open to all: probes and load balancers call them.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
from collections.abc import Iterable

import grpc

from services.common.cluster_auth import ROLES, TOKEN_KEY, ClusterTrust, role_name, token_digest

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)

# Each method and the roles whose job needs it; docs/security.md shows the same table.
METHOD_ROLES: dict[str, frozenset[str]] = {name: frozenset(roles) for name, roles in {
    # The router submits requests past its keys, limits and ledger; nobody else may.
    "/qos.v1.Scheduler/Submit": ("router",),
    "/qos.v1.Scheduler/SubmitLink": ("router",),
    # Pool stats: the router's routing cache; operators' tools and the local launcher.
    "/qos.v1.Scheduler/GetPoolStats": ("router", "admin"),
    "/qos.v1.Scheduler/WatchPoolStats": ("router", "admin"),
    # A worker offers itself to its pool.
    "/qos.v1.Scheduler/Register": ("worker",),
    # Adapters: the router's HTTP admin endpoints (admin key checked there) and operators' tools.
    "/qos.v1.Scheduler/LoadAdapter": ("router", "admin"),
    "/qos.v1.Scheduler/UnloadAdapter": ("router", "admin"),
    # The model's tokenizer: the router's /tokenize and /detokenize; operators' tools.
    "/qos.v1.Scheduler/Tokenize": ("router", "admin"),
    "/qos.v1.Scheduler/Detokenize": ("router", "admin"),
    # The scheduler drives its workers; operators ask what a worker is and drain it.
    "/qos.v1.Worker/Info": ("scheduler", "admin"),
    "/qos.v1.Worker/Execute": ("scheduler",),
    "/qos.v1.Worker/Drain": ("admin",),
    "/qos.v1.Worker/LoadAdapter": ("scheduler",),
    "/qos.v1.Worker/UnloadAdapter": ("scheduler",),
}.items()}


def allowed_roles(method: str) -> frozenset[str]:
    return METHOD_ROLES.get(method, frozenset())


def certificate_role(auth_context: dict) -> str | None:
    """The role a verified client certificate names (qos-ROLE among its DNS names, else its
    common name); None when it names none or more than one."""
    names: Iterable[bytes] = auth_context.get("x509_subject_alternative_name") or \
        auth_context.get("x509_common_name") or ()
    found = {role for role in ROLES for name in names
             if (name.decode() if isinstance(name, bytes) else name) == role_name(role)}
    return found.pop() if len(found) == 1 else None


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call whose caller proves no role (UNAUTHENTICATED) or a role the method is not
    for (PERMISSION_DENIED). The token is checked before the request is read; a certificate's
    name, which grpc.aio gives the handler's context only, is checked when the handler starts."""

    def __init__(self, trust: ClusterTrust):
        self.digests = trust.digests
        self.certificates = trust.certs_dir is not None

    def _token_role(self, method: str, metadata) -> tuple[str | None, str]:
        """The token's role, or None and why not."""
        given = next((value for key, value in metadata or () if key == TOKEN_KEY), None)
        if given is None:
            return None, f"{method} needs the caller's cluster token in the metadata '{TOKEN_KEY}'"
        digest = token_digest(given)
        role = next((r for d, r in self.digests.items() if hmac.compare_digest(d, digest)), None)
        if role is None:
            return None, f"{method}: the token in '{TOKEN_KEY}' is no role's of this cluster"
        return role, ""

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        token_role = None
        if self.digests:
            token_role, why = self._token_role(method, handler_call_details.invocation_metadata)
            if token_role is None:
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, why)
            if not self.certificates:
                why = _not_allowed(method, token_role)
                return handler if not why else _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, why)
        return _checked(handler, lambda context: self._certificate_check(method, token_role, context))

    def _certificate_check(self, method: str, token_role: str | None, context) -> tuple[grpc.StatusCode, str] | None:
        role = certificate_role(context.auth_context())
        if role is None:
            return grpc.StatusCode.UNAUTHENTICATED, f"{method}: the client certificate names no role (qos-ROLE)"
        if token_role is not None and token_role != role:
            return grpc.StatusCode.UNAUTHENTICATED, (f"{method}: the certificate is the {role}'s but the token "
                                                     f"the {token_role}'s")
        why = _not_allowed(method, role)
        return (grpc.StatusCode.PERMISSION_DENIED, why) if why else None


def _not_allowed(method: str, role: str) -> str:
    roles = allowed_roles(method)
    if role in roles:
        return ""
    if not roles:
        return f"{method} is open to no role"
    return f"{method} is for the {' and '.join(sorted(roles))}, not the {role}"


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, why: str) -> grpc.RpcMethodHandler:
    return _checked(handler, lambda _context: (code, why))


def _checked(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """The handler, run only when `check(context)` returns None; else aborted with its status.
    Handlers here are coroutines (unary replies) or async generators (streamed replies)."""
    streamed_requests = handler.request_streaming

    async def refuse_or_none(request, context) -> None:
        refusal = check(context)
        if refusal is not None:
            if streamed_requests:
                await _first_message(request)
            await context.abort(*refusal)

    if handler.unary_unary is not None or handler.stream_unary is not None:
        kind = "unary_unary" if handler.unary_unary is not None else "stream_unary"
        inner = getattr(handler, kind)

        async def unary(request, context):
            await refuse_or_none(request, context)
            return await inner(request, context)
        return handler._replace(**{kind: unary})

    kind = "unary_stream" if handler.unary_stream is not None else "stream_stream"
    inner = getattr(handler, kind)

    async def stream(request, context):
        await refuse_or_none(request, context)
        replies = inner(request, context)
        if inspect.isawaitable(replies):          # a handler that writes with context.write()
            replies = await replies
            if replies is None:
                return
        async for reply in replies:
            yield reply
    return handler._replace(**{kind: stream})


async def _first_message(requests, wait_s: float = 1.0) -> None:
    """Reads a refused caller's first message (for at most wait_s) before the refusal goes out.
    grpcio's asyncio client reports INTERNAL 'Internal error from Core' instead of the server's
    status when a write of its own fails because the call has ended (grpc/grpc issue 36066):
    refused before its first message went out, a router saw that about once in 100 tries on a
    loaded host, not why it was refused."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(anext(aiter(requests)), wait_s)
