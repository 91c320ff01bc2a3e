"""Each role only its job (services/common/cluster_roles.py, cluster_auth.py): every method of a
scheduler and a worker called with every role's credentials, by token and by certificate, and
allowed exactly where the table says. In-process servers whose handlers answer empty messages,
so a call that reaches its handler is OK and one refused shows the interceptor's status."""
from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
from google.protobuf import message_factory

from services.common.cluster_auth import (
    ROLES, ROLES_ENV, TOKEN_ENV, TOKEN_KEY, ClusterTrust, TrustError, is_loopback, parse_roles, token_digest)
from services.common.cluster_roles import METHOD_ROLES, RoleInterceptor, certificate_role
from services.common.config import SecurityConfig
from services.common.grpc_errors import ServiceErrorInterceptor
from services.common.proto.qos.v1 import scheduler_pb2, worker_pb2
from services.tools import tokens as role_tokens
from services.tools.certs import ca_key_dir, init as certs_init

SERVICES = (scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"],
            worker_pb2.DESCRIPTOR.services_by_name["Worker"])
METHODS = [(service, method) for service in SERVICES for method in service.methods]


def path(service, method) -> str:
    return f"/{service.full_name}/{method.name}"


def test_the_table_names_every_method_the_protos_define_and_nothing_else():
    assert sorted(path(s, m) for s, m in METHODS) == sorted(METHOD_ROLES)
    assert all(roles and roles <= set(ROLES) for roles in METHOD_ROLES.values())
    # What the issue that made the table named: a worker's credentials open none of these.
    for method in ("/qos.v1.Scheduler/Submit", "/qos.v1.Scheduler/LoadAdapter", "/qos.v1.Worker/Execute"):
        assert "worker" not in METHOD_ROLES[method]


def _empty_handlers():
    """Every method, answering an empty message of its reply type (streams: one)."""
    handlers = {}
    for service, method in METHODS:
        reply = message_factory.GetMessageClass(method.output_type)
        request = message_factory.GetMessageClass(method.input_type)

        async def unary(_request, _context, reply=reply):
            return reply()

        async def stream(_request, _context, reply=reply):
            yield reply()

        async def unary_from_stream(requests, _context, reply=reply):
            async for _ in requests:
                pass
            return reply()

        kind = (method.client_streaming, method.server_streaming)
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler}[kind]
        behaviour = {(False, False): unary, (True, False): unary_from_stream}.get(kind, stream)
        handlers.setdefault(service.full_name, {})[method.name] = make(
            behaviour, request_deserializer=request.FromString, response_serializer=reply.SerializeToString)
    return [grpc.method_handlers_generic_handler(name, methods) for name, methods in handlers.items()]


async def _call(channel, service, method, metadata) -> grpc.StatusCode:
    request = message_factory.GetMessageClass(method.input_type)()
    reply = message_factory.GetMessageClass(method.output_type)
    name = path(service, method)
    try:
        if method.client_streaming:
            factory = channel.stream_stream if method.server_streaming else channel.stream_unary
            call = factory(name, request_serializer=type(request).SerializeToString,
                           response_deserializer=reply.FromString)(iter([request]), metadata=metadata, timeout=10)
        else:
            factory = channel.unary_stream if method.server_streaming else channel.unary_unary
            call = factory(name, request_serializer=type(request).SerializeToString,
                           response_deserializer=reply.FromString)(request, metadata=metadata, timeout=10)
        if method.server_streaming:
            async for _ in call:
                pass
        else:
            await call
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as error:
        return error.code()


async def _serve(trust: ClusterTrust):
    server = grpc.aio.server(interceptors=[RoleInterceptor(trust), ServiceErrorInterceptor()])
    server.add_generic_rpc_handlers(_empty_handlers())
    credentials = trust.server_credentials()
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials
            else server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def tokens(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(ROLES_ENV, raising=False)
    role_tokens.init(tmp_path / "tokens")
    return tmp_path / "tokens"


def _outcomes(callee_trust: ClusterTrust, caller_trusts: dict[str, ClusterTrust], metadata_of) -> dict:
    async def go():
        server, address = await _serve(callee_trust)
        try:
            found = {}
            for role, trust in caller_trusts.items():
                peer = "scheduler"
                async with trust.channel(address, peer) as channel:
                    for service, method in METHODS:
                        found[(role, path(service, method))] = await _call(channel, service, method, metadata_of(trust))
            return found
        finally:
            await server.stop(0)
    return asyncio.run(go())


def _expected(role: str, method: str) -> grpc.StatusCode:
    return grpc.StatusCode.OK if role in METHOD_ROLES[method] else grpc.StatusCode.PERMISSION_DENIED


def test_by_token_every_role_reaches_exactly_the_methods_of_its_job(tokens):
    security = SecurityConfig(tokens_dir=str(tokens))
    callers = {role: ClusterTrust.load(security, role) for role in ROLES}
    found = _outcomes(callers["worker"], callers, lambda trust: trust.metadata)
    assert found == {(role, method): _expected(role, method) for role, method in itertools.product(ROLES, METHOD_ROLES)}


def test_without_a_token_or_with_a_foreign_one_nothing_is_reached(tokens, tmp_path):
    callee = ClusterTrust.load(SecurityConfig(tokens_dir=str(tokens)), "scheduler")
    role_tokens.init(tmp_path / "other")
    stranger = ClusterTrust.load(SecurityConfig(tokens_dir=str(tmp_path / "other")), "router")
    for metadata in ((), ((TOKEN_KEY, stranger.token),), ((TOKEN_KEY, "guess"),)):
        found = _outcomes(callee, {"stranger": stranger}, lambda _trust: metadata)
        assert set(found.values()) == {grpc.StatusCode.UNAUTHENTICATED}, metadata


def test_by_certificate_every_role_reaches_exactly_the_methods_of_its_job(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(ROLES_ENV, raising=False)
    certs_init(tmp_path / "certs")
    security = SecurityConfig(certs_dir=str(tmp_path / "certs"))
    callers = {role: ClusterTrust.load(security, role) for role in ROLES}
    # The callee presents the scheduler's certificate (what the clients here expect to reach).
    found = _outcomes(callers["scheduler"], callers, lambda _trust: ())
    assert found == {(role, method): _expected(role, method) for role, method in itertools.product(ROLES, METHOD_ROLES)}


def test_with_both_layers_the_certificate_and_the_token_must_name_one_role(tmp_path, tokens):
    certs_init(tmp_path / "certs")
    security = SecurityConfig(certs_dir=str(tmp_path / "certs"), tokens_dir=str(tokens))
    callee = ClusterTrust.load(security, "scheduler")
    worker, router = ClusterTrust.load(security, "worker"), ClusterTrust.load(security, "router")
    # A worker's certificate with the router's token (stolen, say) is refused outright.
    found = _outcomes(callee, {"worker": worker}, lambda _trust: router.metadata)
    assert set(found.values()) == {grpc.StatusCode.UNAUTHENTICATED}
    found = _outcomes(callee, {"router": router}, lambda trust: trust.metadata)
    assert found[("router", "/qos.v1.Scheduler/Submit")] == grpc.StatusCode.OK
    assert found[("router", "/qos.v1.Worker/Execute")] == grpc.StatusCode.PERMISSION_DENIED


def test_the_certificates_name_their_roles():
    assert certificate_role({"x509_subject_alternative_name": [b"qos-worker", b"localhost", b"127.0.0.1"]}) == "worker"
    assert certificate_role({"x509_common_name": [b"qos-router"]}) == "router"
    assert certificate_role({"x509_subject_alternative_name": [b"qos-worker", b"qos-router"]}) is None
    assert certificate_role({"x509_subject_alternative_name": [b"localhost"]}) is None
    assert certificate_role({}) is None


def test_loading_refuses_tokens_that_cannot_tell_roles_apart(tokens, tmp_path, monkeypatch):
    security = SecurityConfig(tokens_dir=str(tokens))
    assert ClusterTrust.load(security, "router").digests[token_digest((tokens / "router.token").read_text().strip())] == "router"
    (tmp_path / "shared").write_text("one-token-for-all")
    monkeypatch.setenv(TOKEN_ENV, "one-token-for-all")
    with pytest.raises(TrustError, match="cannot tell a router from a worker"):
        ClusterTrust.load(SecurityConfig(), "worker")
    monkeypatch.setenv(TOKEN_ENV, (tokens / "worker.token").read_text().strip())
    with pytest.raises(TrustError, match="this router's token is the worker's"):
        ClusterTrust.load(security, "router")
    with pytest.raises(TrustError, match="is not ROLE=SHA256"):
        parse_roles("router=abc", "roles")
    with pytest.raises(TrustError, match="same token"):
        parse_roles(f"router={'a' * 64}\nworker={'a' * 64}", "roles")


def test_the_ca_key_lives_apart_and_a_service_refuses_a_folder_that_holds_it(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(ROLES_ENV, raising=False)
    written = certs_init(tmp_path / "certs")
    assert not (tmp_path / "certs" / "ca.key").exists()
    assert written[-1] == ca_key_dir(tmp_path / "certs") / "ca.key" and written[-1].exists()
    assert written[-1].stat().st_mode & 0o077 == 0
    (tmp_path / "certs" / "ca.key").write_bytes(written[-1].read_bytes())
    with pytest.raises(TrustError, match="the CA's private key is in the folder services read"):
        ClusterTrust.load(SecurityConfig(certs_dir=str(tmp_path / "certs")), "worker")


def test_an_open_service_listens_on_loopback_only(tokens):
    open_trust = ClusterTrust("worker")
    for address in ("127.0.0.1:50053", "localhost:1", "[::1]:5", "127.3.4.5:9"):
        assert is_loopback(address)
        open_trust.refuse_open("worker", address)
    for address in ("0.0.0.0:50053", "[::]:50053", "10.0.0.7:1", "worker.internal:50053"):
        with pytest.raises(TrustError, match="refusing to listen on .* with no cluster credentials"):
            open_trust.refuse_open("worker", address)
    ClusterTrust.load(SecurityConfig(tokens_dir=str(tokens)), "worker").refuse_open("worker", "0.0.0.0:50053")
