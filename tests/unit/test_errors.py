"""The one error map: every kind's gRPC and HTTP status, the trailers that carry retry-after and
the kind across a hop, and a real gRPC server whose handlers only raise ServiceError."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import STATUS, ErrorKind, ServiceError
from services.common.grpc_errors import ServiceErrorInterceptor, error_from_rpc, grpc_status

EXPECTED = {
    ErrorKind.INVALID: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    ErrorKind.UNAUTHENTICATED: (grpc.StatusCode.UNAUTHENTICATED, 401),
    ErrorKind.PERMISSION_DENIED: (grpc.StatusCode.PERMISSION_DENIED, 403),
    ErrorKind.NOT_FOUND: (grpc.StatusCode.NOT_FOUND, 404),
    ErrorKind.UNSUPPORTED: (grpc.StatusCode.FAILED_PRECONDITION, 404),
    ErrorKind.CONFLICT: (grpc.StatusCode.FAILED_PRECONDITION, 409),
    ErrorKind.TOO_LARGE: (grpc.StatusCode.RESOURCE_EXHAUSTED, 400),
    ErrorKind.PAYLOAD_TOO_LARGE: (grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
    ErrorKind.EXHAUSTED: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    ErrorKind.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, 503),
    ErrorKind.CANCELLED: (grpc.StatusCode.CANCELLED, 499),
    ErrorKind.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ErrorKind.REQUEST_TIMEOUT: (grpc.StatusCode.DEADLINE_EXCEEDED, 408),
    ErrorKind.INTERNAL: (grpc.StatusCode.INTERNAL, 500),
}


def test_every_kind_has_one_grpc_and_one_http_status():
    assert set(STATUS) == set(ErrorKind) == set(EXPECTED)
    for kind, (code, http) in EXPECTED.items():
        assert (grpc_status(kind), kind.status.http) == (code, http), kind


def test_retry_after_in_ms_for_grpc_and_whole_seconds_for_http():
    error = ServiceError(ErrorKind.EXHAUSTED, "queue full", retry_after_ms=1200, field="x")
    assert dict(error.trailers()) == {"retry-after-ms": "1200", "qos-error-kind": "resource_exhausted",
                                      "qos-error-field": "x", "qos-error-reason": "resource_exhausted"}
    assert error.retry_after_seconds == 2
    assert ServiceError(ErrorKind.EXHAUSTED, "x", retry_after_ms=1).retry_after_seconds == 1
    assert ServiceError(ErrorKind.INVALID, "bad").retry_after_seconds is None
    assert ServiceError(ErrorKind.INVALID, "bad").reason == "invalid_argument"


class Echo:
    """Handlers that fail the way request code does: by raising ServiceError."""

    def __init__(self, error: ServiceError):
        self.error = error

    async def unary(self, request: bytes, context) -> bytes:
        raise self.error

    async def stream(self, request: bytes, context):
        yield b"first"
        raise self.error


async def call_both(error: ServiceError):
    server = grpc.aio.server(interceptors=[ServiceErrorInterceptor()])
    echo = Echo(error)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(echo.unary),
        "Stream": grpc.unary_stream_rpc_method_handler(echo.stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            failures, streamed = [], []
            try:
                await channel.unary_unary("/test.Echo/Unary")(b"x")
            except grpc.aio.AioRpcError as exc:
                failures.append(exc)
            try:
                async for item in channel.unary_stream("/test.Echo/Stream")(b"x"):
                    streamed.append(item)
            except grpc.aio.AioRpcError as exc:
                failures.append(exc)
            return failures, streamed
    finally:
        await server.stop(0)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_the_interceptor_maps_a_raised_error_and_the_caller_gets_it_back_exactly(kind):
    error = ServiceError(kind, f"{kind.name} happened", field="sampling.top_p", retry_after_ms=300,
                         reason="queue_full")
    failures, streamed = asyncio.run(call_both(error))
    assert streamed == [b"first"], "a failure mid-stream comes after what was already sent"
    assert len(failures) == 2
    for exc in failures:
        assert exc.code() == EXPECTED[kind][0] and exc.details() == f"{kind.name} happened"
        relayed = error_from_rpc(exc, "peer")
        assert (relayed.kind, relayed.field, relayed.retry_after_ms, relayed.reason) == \
            (kind, "sampling.top_p", 300, "queue_full")


def test_the_interceptor_keeps_each_served_methods_wrapper_but_not_unknown_names():
    """The wrapped handler is made once per method (it was made on every call); a later call of
    the same method still gets its error mapped, and a made-up method name is neither served
    nor remembered (a client cannot grow the interceptor's table)."""
    error = ServiceError(ErrorKind.EXHAUSTED, "full", retry_after_ms=250, reason="queue_full")

    async def calls():
        interceptor = ServiceErrorInterceptor()
        server = grpc.aio.server(interceptors=[interceptor])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
            "Unary": grpc.unary_unary_rpc_method_handler(Echo(error).unary)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for method in ("/test.Echo/Unary", "/test.Echo/Unary", "/test.Echo/Nope", "/test.Echo/Nope"):
                    try:
                        await channel.unary_unary(method)(b"x", timeout=5)
                    except grpc.aio.AioRpcError as exc:
                        codes.append((exc.code(), error_from_rpc(exc, "peer").retry_after_ms))
        finally:
            await server.stop(0)
        return codes, set(interceptor._wrapped)

    codes, kept = asyncio.run(calls())
    assert codes[:2] == [(grpc.StatusCode.RESOURCE_EXHAUSTED, 250)] * 2
    assert [code for code, _ in codes[2:]] == [grpc.StatusCode.UNIMPLEMENTED] * 2
    assert kept == {"/test.Echo/Unary"}


def test_a_status_no_service_of_ours_sent_names_the_peer():
    async def unreachable():
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/test.Echo/Unary")(b"x", timeout=5)
            return caught.value

    error = error_from_rpc(asyncio.run(unreachable()), "pool cpu scheduler 127.0.0.1:1 unavailable")
    assert error.kind is ErrorKind.UNAVAILABLE
    assert error.message.startswith("pool cpu scheduler 127.0.0.1:1 unavailable: ")


@pytest.mark.parametrize("quoted", ["m" * 60_000, "é" * 20_000, "\U0001F600" * 9_000 + "%" * 9_000])
def test_a_message_quoting_a_long_value_arrives_with_its_own_status_cut_in_the_middle(quoted):
    """gRPC sends the message as metadata, percent-encoded; a client refuses more than 8 KiB of
    metadata, and reported RESOURCE_EXHAUSTED 'received metadata size exceeds...' in place of
    our status (a 60,000-character model name, a 15,000-character role)."""
    error = ServiceError(ErrorKind.UNSUPPORTED, f"no pool serves model {quoted!r}; models here: 'a', 'b'",
                         field="model")
    failures, _ = asyncio.run(call_both(error))
    assert len(failures) == 2
    for exc in failures:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
        details = exc.details()
        assert details.startswith("no pool serves model '") and details.endswith("models here: 'a', 'b'")
        assert "characters cut ...]" in details and details == error.message
        assert error_from_rpc(exc, "peer").kind is ErrorKind.UNSUPPORTED


def test_a_short_message_is_kept_whole():
    message = "sampling.top_p must be in (0, 1], got 1.5 " + "é" * 100
    assert ServiceError(ErrorKind.INVALID, message).message == message
