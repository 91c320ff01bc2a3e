"""Tenants on a real cluster with `[auth] required`: keys on both fronts, each limit with its status
(and OpenAI's rate-limit headers), one tenant unable to read or cancel another's requests, and a
ledger whose rows match what the clients were told, request by request."""
from __future__ import annotations

import asyncio
import http.client
import json
import time
from pathlib import Path

import grpc
import pytest

from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc
from services.local.cluster import LocalCluster
from services.store.store import Store, Tenant
from services.tools.client import chat_request, sampling_params
from tests.e2e.conftest import cluster_config, run
from tests.e2e.test_http_faults import Exchange
from tests.postgres import database_url

pytestmark = pytest.mark.slow

ADMIN = "admin-secret-for-tests"
TENANTS = [Tenant("alpha"), Tenant("beta"), Tenant("batch", priorities=("low",)), Tenant("rpm2", rpm=2),
           Tenant("tpm", tpm=120), Tenant("solo", max_concurrent=1), Tenant("broke", budget=0.5), Tenant("choices"),
           Tenant("tokenizer", rpm=3)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # PostgreSQL, as deployments run it (the store's SQLite side: tests/unit/test_store.py and the
    # other e2e modules, on the default store); both here took 24 s of a suite near its 15 minutes.
    with database_url("postgresql", tmp_path_factory.mktemp("tenants")) as url:
        yield from _cluster(url)


def _cluster(url: str):
    store = Store(url)
    keys = {}
    for tenant in TENANTS:
        store.add_tenant(tenant)
        keys[tenant.name] = store.create_key(tenant.name)[0]
    revoked, prefix = store.create_key("alpha")
    store.revoke_key(prefix)
    keys["revoked"] = revoked
    store.close()
    config = cluster_config()
    config.store.url, config.auth.required, config.auth.admin_key = url, True, ADMIN
    config.billing.flush_seconds = 0.2
    with LocalCluster(config, quiet=True) as running:
        running.keys, running.store_url = keys, url
        yield running


def post(cluster, body: dict, key: str | None, headers: dict | None = None, path="/v1/completions"):
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=120)
    try:
        auth = {"authorization": f"Bearer {key}"} if key else {}
        conn.request("POST" if body is not None else "GET", path, body=json.dumps(body) if body is not None else None,
                     headers={"content-type": "application/json", **auth, **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())
    finally:
        conn.close()


def completion(cluster, max_tokens: int = 4, prompt: str = "Hello", **extra) -> dict:
    return {"model": Path(cluster.config.model).name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, **extra}


async def grpc_generate(cluster, key: str | None, priority: str = "medium", max_tokens: int = 4):
    metadata = [("x-priority", priority)] + ([("authorization", f"Bearer {key}")] if key else [])
    async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(
            chat_request("Hello", sampling_params(max_tokens=max_tokens)), metadata=metadata)
        return [chunk async for chunk in call]


def grpc_error(cluster, key, priority="medium", max_tokens: int = 4) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(grpc_generate(cluster, key, priority, max_tokens))
    return caught.value


def grpc_unary(cluster, method: str, message, key: str):
    async def call():
        async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as channel:
            return await getattr(router_pb2_grpc.RouterStub(channel), method)(
                message, metadata=[("authorization", f"Bearer {key}")])
    return run(call())


def grpc_unary_error(cluster, method: str, message, key: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        grpc_unary(cluster, method, message, key)
    return caught.value


def test_keys_on_both_fronts(cluster):
    for key, words in ((None, "an API key is required"), (cluster.keys["revoked"], "unknown or revoked"),
                       ("qsk_made_up", "unknown or revoked")):
        status, _, body = post(cluster, completion(cluster), key)
        assert status == 401 and words in body["error"]["message"] and body["error"]["param"] == "authorization"
        error = grpc_error(cluster, key)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and words in error.details()
    status, _, body = post(cluster, completion(cluster), cluster.keys["alpha"])
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert run(grpc_generate(cluster, cluster.keys["alpha"]))[-1].finish_reason


def test_a_priority_above_the_entitlement_is_refused_by_name(cluster):
    status, _, body = post(cluster, completion(cluster), cluster.keys["batch"], {"x-priority": "high"})
    assert status == 403 and body["error"]["param"] == "x-priority" and "not high" in body["error"]["message"]
    error = grpc_error(cluster, cluster.keys["batch"], "medium")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "may send low requests, not medium" in error.details()
    assert post(cluster, completion(cluster), cluster.keys["batch"], {"x-priority": "low"})[0] == 200


def test_requests_per_minute_with_retry_after_and_openai_headers(cluster):
    key = cluster.keys["rpm2"]
    first = post(cluster, completion(cluster), key)
    assert first[0] == 200 and first[1]["x-ratelimit-limit-requests"] == "2"
    assert first[1]["x-ratelimit-remaining-requests"] == "1"
    assert post(cluster, completion(cluster), key)[0] == 200
    status, headers, body = post(cluster, completion(cluster), key)
    assert status == 429 and body["error"]["code"] == "rate_limit_requests"
    assert 1 <= int(headers["retry-after"]) <= 60 and headers["x-ratelimit-remaining-requests"] == "0"
    error = grpc_error(cluster, key)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests per minute" in error.details()
    assert int(dict(error.trailing_metadata())["retry-after-ms"]) > 0


def test_tokens_per_minute_reserve_then_true_up(cluster):
    key = cluster.keys["tpm"]      # 120 tokens a minute
    # Reserves ~2 + 80 tokens, but the stop string ends it at once ("Hello" goes on "-by-date-..."):
    # the true-up frees the rest.
    status, headers, body = post(cluster, completion(cluster, max_tokens=80, stop=["-"]), key)
    assert status == 200 and body["usage"]["completion_tokens"] < 20
    assert int(headers["x-ratelimit-remaining-tokens"]) < 40         # as reserved, before the true-up
    status, _, body = post(cluster, completion(cluster, max_tokens=70, ignore_eos=True), key)
    assert status == 200, body                                        # fits only after the true-up
    status, headers, body = post(cluster, completion(cluster, max_tokens=70), key)
    assert status == 429 and body["error"]["code"] == "rate_limit_tokens" and int(headers["retry-after"]) >= 1
    error = grpc_error(cluster, key, max_tokens=70)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens per minute" in error.details()
    assert int(dict(error.trailing_metadata())["retry-after-ms"]) > 0
    status, _, body = post(cluster, completion(cluster, max_tokens=200), key)
    assert status == 400 and body["error"]["param"] == "max_tokens"      # could never fit


def test_concurrent_streams(cluster):
    key = cluster.keys["solo"]

    async def go():
        first = asyncio.create_task(asyncio.to_thread(post, cluster, completion(cluster, 120, ignore_eos=True), key))
        await asyncio.sleep(1.0)
        second = await asyncio.to_thread(post, cluster, completion(cluster), key)
        try:
            await grpc_generate(cluster, key)
            grpc_code, details = None, ""
        except grpc.aio.AioRpcError as error:
            grpc_code, details = error.code(), error.details()
        return await first, second, grpc_code, details

    first, second, grpc_code, details = run(go())
    assert first[0] == 200 and second[0] == 429 and second[2]["error"]["code"] == "rate_limit_concurrency"
    assert "retry-after" in second[1]
    assert grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in details


def test_a_spent_budget_is_insufficient_quota(cluster):
    key = cluster.keys["broke"]
    assert post(cluster, completion(cluster, max_tokens=20), key)[0] == 200      # spends > 0.5
    status, headers, body = post(cluster, completion(cluster), key)
    assert status == 429 and body["error"]["code"] == "insufficient_quota"
    assert "retry-after" not in headers and "--budget" in body["error"]["message"]
    error = grpc_error(cluster, key)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "budget" in error.details()


def test_a_tenant_sees_and_cancels_only_its_own(cluster):
    alpha, beta = cluster.keys["alpha"], cluster.keys["beta"]

    async def go():
        stream = await Exchange.post(cluster, "/v1/completions", completion(cluster, 2000, ignore_eos=True, stream=True),
                                     {"authorization": f"Bearer {beta}"})
        assert stream.status == 200 and isinstance(await stream.event(), dict)
        request_id = stream.headers["x-request-id"]
        probes = await asyncio.to_thread(lambda: {
            "alpha cancels": post(cluster, {}, alpha, path=f"/v1/requests/{request_id}/cancel"),
            "alpha reads": post(cluster, None, alpha, path=f"/v1/requests/{request_id}"),
            "alpha reads beta's usage": post(cluster, None, alpha, path="/v1/usage?tenant=beta"),
            "alpha's usage": post(cluster, None, alpha, path="/v1/usage"),
            "beta reads": post(cluster, None, beta, path=f"/v1/requests/{request_id}"),
            "admin usage": post(cluster, None, ADMIN, path="/v1/usage"),
            "alpha cancels over gRPC": grpc_unary_error(cluster, "Cancel", router_pb2.CancelRequest(
                request_id=request_id), alpha).code(),
            "alpha reads beta's usage over gRPC": grpc_unary_error(cluster, "Usage", router_pb2.UsageRequest(
                tenant="beta"), alpha).code(),
            "beta's usage over gRPC": grpc_unary(cluster, "Usage", router_pb2.UsageRequest(), beta),
            "admin usage over gRPC": grpc_unary(cluster, "Usage", router_pb2.UsageRequest(), ADMIN),
            "admin cancels": post(cluster, {}, ADMIN, path=f"/v1/requests/{request_id}/cancel")})
        events = []
        while (event := await asyncio.wait_for(stream.event(), 30)) is not None:
            events.append(event)
        return probes, events

    probes, events = run(go())
    assert probes["alpha cancels"][0] == 404 and probes["alpha reads"][0] == 404
    assert probes["alpha reads beta's usage"][0] == 403
    mine = probes["alpha's usage"][2]
    assert mine["tenant"] == "alpha" and {line["tenant"] for line in mine["lines"]} == {"alpha"}
    assert probes["beta reads"][0] == 200 and probes["beta reads"][2]["status"] == "in_flight"
    everyone = probes["admin usage"][2]
    assert everyone["tenant"] == "*" and "alpha" in {line["tenant"] for line in everyone["lines"]}
    assert probes["alpha cancels over gRPC"] == grpc.StatusCode.NOT_FOUND
    assert probes["alpha reads beta's usage over gRPC"] == grpc.StatusCode.PERMISSION_DENIED
    assert probes["beta's usage over gRPC"].tenant == "beta" and probes["beta's usage over gRPC"].in_flight == 1
    assert probes["admin usage over gRPC"].tenant == "*" and probes["admin usage over gRPC"].in_flight >= 1
    # what each keeps in the store, and its limit ([store] tenant_storage_mb here); every tenant's: none
    assert probes["beta's usage over gRPC"].storage_limit_bytes == cluster.config.store.tenant_storage_mb * 10**6
    assert not probes["admin usage over gRPC"].HasField("storage_limit_bytes")
    assert probes["admin cancels"][0] == 200 and probes["admin cancels"][2]["tenant"] == "beta"
    assert events[-1]["error"]["code"] == "cancelled" and "[DONE]" not in events


def test_tokenize_needs_a_key_and_bills_nothing(cluster):
    key = cluster.keys["alpha"]
    body = {"model": Path(cluster.config.model).name, "prompt": "Hello there"}
    assert post(cluster, body, None, path="/tokenize")[0] == 401
    assert post(cluster, {**body, "tokens": [1]}, "qsk_not_a_key", path="/detokenize")[0] == 401
    before = post(cluster, None, key, path="/v1/usage")[2]
    status, _, done = post(cluster, body, key, path="/tokenize")
    assert status == 200 and done["count"] == len(done["tokens"]) > 0
    after = post(cluster, None, key, path="/v1/usage")[2]
    assert (after["requests"], after["prompt_tokens"]) == (before["requests"], before["prompt_tokens"])


def test_tokenize_calls_count_against_the_tenants_requests(cluster):
    key, model = cluster.keys["tokenizer"], Path(cluster.config.model).name      # 3 requests a minute
    remaining = []
    for path, body in (("/tokenize", {"prompt": "Hello there"}), ("/detokenize", {"tokens": [1, 2]}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})):
        status, headers, _ = post(cluster, {"model": model, **body}, key, path=path)
        assert status == 200
        remaining.append(headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]
    status, headers, body = post(cluster, {"model": model, "prompt": "Hi"}, key, path="/tokenize")
    assert status == 429 and body["error"]["code"] == "rate_limit_requests" and 1 <= int(headers["retry-after"]) <= 60
    assert post(cluster, completion(cluster), key)[0] == 429          # the same minute as its generations


def test_a_scoring_call_bills_its_prompt_and_no_completion(cluster):
    """echo with max_tokens 0: the one token the model computed after the prompt is dropped, and
    not billed; the prompt is."""
    key = cluster.keys["alpha"]
    status, headers, body = post(cluster, completion(cluster, 0, echo=True, logprobs=1), key)
    assert status == 200 and body["usage"]["completion_tokens"] == 0 and body["choices"][0]["text"] == "Hello"
    row = post(cluster, None, key, path=f"/v1/requests/{headers['x-request-id']}")[2]
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == \
        ("completed", body["usage"]["prompt_tokens"], 0), row


def test_n_choices_bill_the_prompt_once_and_each_choices_completion(cluster):
    """A request with n choices is a request a choice (ids ID, ID-1, ...): the ledger bills its
    prompt once, with choice 0, as the response's usage counts it; the tenant's usage agrees."""
    key = cluster.keys["choices"]
    status, headers, body = post(cluster, completion(cluster, 5, ignore_eos=True, n=3, temperature=1.0), key)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2], body
    request_id, prompt_tokens = headers["x-request-id"], body["usage"]["prompt_tokens"]
    rows = [post(cluster, None, key, path=f"/v1/requests/{request_id}{suffix}")[2] for suffix in ("", "-1", "-2")]
    assert [(r["prompt_tokens"], r["completion_tokens"], r["status"]) for r in rows] == [
        (prompt_tokens, 5, "completed"), (0, 5, "completed"), (0, 5, "completed")]
    assert body["usage"]["completion_tokens"] == 15
    usage = post(cluster, None, key, path="/v1/usage")[2]
    assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"]) == (3, prompt_tokens, 15)
    assert usage["amount"] == pytest.approx(sum(r["amount"] for r in rows))


def test_more_choices_than_the_tenants_streams_is_a_400_naming_n(cluster):
    """Each choice is a stream: n above max_concurrent would be refused for ever, not retried."""
    status, headers, body = post(cluster, completion(cluster, n=2), cluster.keys["solo"])
    assert status == 400 and body["error"]["param"] == "n" and "max_concurrent" in body["error"]["message"]
    assert post(cluster, completion(cluster, n=1), cluster.keys["solo"])[0] == 200


def test_cancelling_one_choice_by_its_id_cancels_the_request(cluster):
    """Its owner may, by any choice's id; another tenant can neither cancel nor read a choice's id
    (404, as for an id that does not exist), and the stream goes on."""
    alpha, beta = cluster.keys["alpha"], cluster.keys["beta"]

    async def go():
        stream = await Exchange.post(cluster, "/v1/completions", completion(
            cluster, 2000, ignore_eos=True, stream=True, n=2), {"authorization": f"Bearer {alpha}"})
        assert stream.status == 200 and isinstance(await stream.event(), dict)
        request_id = stream.headers["x-request-id"]
        stranger = await asyncio.to_thread(lambda: [
            post(cluster, {}, beta, path=f"/v1/requests/{request_id}-1/cancel")[0],
            post(cluster, None, beta, path=f"/v1/requests/{request_id}-1")[0],
            grpc_unary_error(cluster, "Cancel", router_pb2.CancelRequest(request_id=f"{request_id}-1"), beta).code()])
        still = await asyncio.wait_for(stream.event(), 30)       # beta's tries ended nothing
        cancelled = await asyncio.to_thread(post, cluster, {}, alpha, path=f"/v1/requests/{request_id}-1/cancel")
        events = []
        while (event := await asyncio.wait_for(stream.event(), 30)) is not None:
            events.append(event)
        return request_id, stranger, still, cancelled, events

    request_id, stranger, still, cancelled, events = run(go())
    assert stranger == [404, 404, grpc.StatusCode.NOT_FOUND]
    assert isinstance(still, dict) and "error" not in still
    assert cancelled[0] == 200 and events[-1]["error"]["code"] == "cancelled" and "[DONE]" not in events
    for choice_id in (request_id, f"{request_id}-1"):         # both ended, and are billed as cancelled
        for _ in range(100):
            status, _, row = post(cluster, None, alpha, path=f"/v1/requests/{choice_id}")
            if status == 200 and row["status"] != "in_flight":
                break
            time.sleep(0.1)
        assert status == 200 and row["status"] == "cancelled" and row["completion_tokens"] < 2000, row


def test_a_tenant_learns_nothing_of_anothers_prompt_from_the_prefix_cache(cluster):
    """The cache is scoped to the tenant the key names (cache_scope = "tenant", the default):
    alpha's repeat of its private system prompt is served from cache, beta sending the same
    words (even claiming alpha in x-tenant) is told none were cached and pays for all of them,
    and a cache_salt or prompt_cache_key narrows sharing inside alpha too."""
    system = "You are the private assistant of Acme's merger team; the target is Globex. " * 6
    chat = {"model": Path(cluster.config.model).name, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Status?"}]}

    def cached(key: str, headers: dict | None = None, **extra) -> tuple[int, int]:
        status, _, body = post(cluster, {**chat, **extra}, key, headers, path="/v1/chat/completions")
        assert status == 200, body
        return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["usage"]["prompt_tokens"]

    alpha, beta = cluster.keys["alpha"], cluster.keys["beta"]
    first, prompt_tokens = cached(alpha)
    again, _ = cached(alpha)
    assert first == 0 and again >= prompt_tokens - 16      # all but the last, partial block
    # Beta, even claiming to be alpha: the key names the tenant, not the header ...
    assert cached(beta, {"x-tenant": "alpha"}) == (0, prompt_tokens)
    assert cached(beta)[0] == again                          # ... and beta's own repeat is its own
    assert cached(alpha, cache_salt="project-x")[0] == 0
    assert cached(alpha, prompt_cache_key="conversation-7")[0] == 0
    assert cached(alpha, cache_salt="project-x")[0] == again
    status, _, body = post(cluster, {**chat, "cache_salt": "s" * 257}, alpha, path="/v1/chat/completions")
    assert status == 400 and body["error"]["param"] == "cache_salt"


def test_a_strangers_body_is_never_read(cluster):
    """The key is checked from the headers: a request without a valid one is answered 401 while
    its 3 MiB body is still unsent (the router waiting for it would never answer)."""
    router = cluster.config.router

    async def answer_before_the_body(authorization: dict) -> tuple[int, dict]:
        reader, writer = await asyncio.open_connection(router.host, router.http_port)
        head = {"content-type": "application/json", "content-length": str(3 * 2**20), **authorization}
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\n"
                     + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n"
                     + b'{"model": "m", "prompt": "' + b"x" * 2**16)
        await writer.drain()
        try:
            status = int((await asyncio.wait_for(reader.readline(), 60)).split()[1])
            length = 0
            while (line := await reader.readline()).strip():
                key, _, value = line.decode().partition(":")
                length = int(value) if key.strip().lower() == "content-length" else length
            return status, json.loads(await reader.readexactly(length))
        finally:
            writer.close()

    for authorization, words in (({}, "an API key is required"),
                                 ({"authorization": "Bearer qsk_made_up"}, "unknown or revoked")):
        status, body = run(answer_before_the_body(authorization))
        assert status == 401 and words in body["error"]["message"] and body["error"]["param"] == "authorization"


def test_a_strangers_grpc_message_is_refused_before_it_is_read(cluster):
    """gRPC: a call without a valid key is refused from its metadata before its message is taken
    (a 65 MiB one gets UNAUTHENTICATED, not the 64 MiB transport limit's RESOURCE_EXHAUSTED);
    a caller with a key may send no more than the HTTP front's body limit (4 MiB)."""
    options = [("grpc.max_send_message_length", 128 * 2**20)]

    async def call(size: int, key: str | None) -> grpc.aio.AioRpcError:
        metadata = [("authorization", f"Bearer {key}")] if key else []
        async with grpc.aio.insecure_channel(cluster.router_address, options=options) as channel:
            generate = router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(prompt="x" * size), metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [chunk async for chunk in generate]
            return caught.value

    stranger = run(call(65 * 2**20, None))
    assert stranger.code() == grpc.StatusCode.UNAUTHENTICATED and "API key is required" in stranger.details()
    made_up = run(call(65 * 2**20, "qsk_made_up"))
    assert made_up.code() == grpc.StatusCode.UNAUTHENTICATED and "unknown or revoked" in made_up.details()
    large = run(call(5 * 2**20, cluster.keys["alpha"]))
    assert large.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in large.details()
    assert run(grpc_generate(cluster, cluster.keys["alpha"]))[-1].finish_reason     # and the rest as before


def test_a_key_that_is_not_ascii_is_401_not_500(cluster):
    # http.client sends the header in Latin-1, as a browser or curl would send these bytes.
    for key in ("qsk_clé", "qsk_\u00a0x"):
        status, _, body = post(cluster, completion(cluster), key)
        assert status == 401 and body["error"]["param"] == "authorization"
        assert "not printable ASCII at offset" in body["error"]["message"]


def test_a_bad_since_is_400_naming_it(cluster):
    alpha = cluster.keys["alpha"]
    for since in ("%C2%B2", "9" * 400, "1e400", "nan", "-1", ""):
        status, _, body = post(cluster, None, alpha, path=f"/v1/usage?since={since}")
        assert status == 400 and body["error"]["param"] == "since", (since, body)
    status, _, body = post(cluster, None, alpha, path="/v1/usage?since=1700000000.5")
    assert status == 200 and body["since"] == 1700000000.5
    # gRPC's since_unix_s is a double: what the HTTP parameter cannot spell is refused there too
    # (NaN and infinity were answered as zero usage).
    for since in (float("nan"), float("inf"), -5.0, 1e13):
        error = grpc_unary_error(cluster, "Usage", router_pb2.UsageRequest(since_unix_s=since), alpha)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "since_unix_s" in error.details(), since
    assert grpc_unary(cluster, "Usage", router_pb2.UsageRequest(since_unix_s=1700000000.5), alpha).requests >= 0


def test_an_id_no_request_can_have_is_not_found_on_either_store(cluster):
    # A NUL reached PostgreSQL, which refuses it in a string literal (a 500).
    for request_id in ("x%00y", "r" * 65, "tab%09id"):
        status, _, body = post(cluster, None, cluster.keys["alpha"], path=f"/v1/requests/{request_id}")
        assert status == 404 and body["error"]["type"] == "not_found_error", (request_id, body)


def test_with_auth_on_the_public_metrics_need_the_admin_key(cluster):
    """Class-wide counts move with every tenant's requests: a tenant scraping before and after
    its own would read another's volume, rejections and latencies. The metrics port serves all."""
    router = cluster.config.router

    def scrape(key):
        conn = http.client.HTTPConnection(router.host, router.http_port, timeout=30)
        try:
            conn.request("GET", "/metrics", headers={"authorization": f"Bearer {key}"} if key else {})
            response = conn.getresponse()
            return response.status, response.read().decode()
        finally:
            conn.close()

    assert scrape(None)[0] == 401
    status, body = scrape(cluster.keys["alpha"])
    assert status == 403 and "admin key" in json.loads(body)["error"]["message"]
    status, body = scrape(ADMIN)
    assert status == 200 and "qos_requests_total" in body
