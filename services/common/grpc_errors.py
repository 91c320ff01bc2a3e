"""The gRPC edge of services/common/errors.py: ServiceError -> status for what we serve, and a
received status -> ServiceError for what we call.

Every server installs `ServiceErrorInterceptor` (services/common/grpc_server.py), so a handler
just raises ServiceError, before or during its stream, and the client gets the kind's status and
message, with trailing metadata: `retry-after-ms` when the error says when to retry, and
`qos-error-kind` / `qos-error-field`, which let our router relay a scheduler's error exactly.
"""
from __future__ import annotations

import inspect
import logging

import grpc

from services.common.errors import ErrorKind, ServiceError, kind_of_transport_status

log = logging.getLogger(__name__)


def grpc_status(kind: ErrorKind) -> grpc.StatusCode:
    return grpc.StatusCode[kind.status.grpc]


async def abort(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    """End the call with the error's status; raises (as context.abort does)."""
    trailers = error.trailers()
    if trailers:
        context.set_trailing_metadata(trailers)
    await context.abort(grpc_status(error.kind), error.message)


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str) -> ServiceError:
    """A failed call to `peer` ("pool cpu's scheduler at 127.0.0.1:50052"), as a ServiceError.

    A status one of our services sent comes back as the error it raised (kind, message, field,
    retry-after), to be relayed as is. Any other status means the call itself failed (the peer
    could not be reached, the connection broke): its message then names the peer."""
    return error_from_status(exc.code().name, exc.details() or exc.code().name,
                             dict(exc.trailing_metadata() or ()), peer)


def error_from_status(status: str, details: str, trailers: dict[str, str], peer: str) -> ServiceError:
    """error_from_rpc's reading of a status (a grpc.StatusCode name), its message and trailing
    metadata, wherever they came from: a call's end, or a request's error on a SubmitLink stream."""
    sent = ServiceError.from_trailers(details, trailers)
    if sent is not None:
        return sent
    return ServiceError(kind_of_transport_status(status), f"{peer}: {details}", reason="unreachable")


def _wrap_unary(behavior):
    async def unary(request, context):
        try:
            return await behavior(request, context)
        except ServiceError as error:
            await abort(context, error)
    return unary


def _wrap_stream(behavior):
    async def stream(request, context):
        try:
            async for item in behavior(request, context):
                yield item
        except ServiceError as error:
            await abort(context, error)
    return stream


class ServiceErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps a ServiceError raised by any async handler (unary or server-streaming) to its status.

    A method's wrapped handler is made on its first call and kept: gRPC asks the interceptor on
    every call, and inspecting the handler each time was ~2% of the router's CPU per request
    (py-spy, bench/control_plane_cpu.py's cluster)."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = _wrapped(await continuation(handler_call_details))
            if wrapped is not None:       # only methods served: a client's made-up names are not kept
                self._wrapped[method] = wrapped
        return wrapped


def _wrapped(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    if handler is None:
        return None
    if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
        return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
    if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
        return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
    if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
        return handler._replace(stream_stream=_wrap_stream(handler.stream_stream))
    return handler
