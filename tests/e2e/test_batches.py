"""OpenAI's Batch API through the official `openai` client on a real cluster of two router
replicas over one pool and PostgreSQL (embedded SmolLM2, fp32, greedy): a JSONL file uploaded,
a batch created and polled to its end, each output line the answer its endpoint gives the same
body alone; a bad line in the error file, a bad file failing the batch at once; a cancel; one
tenant's files and batches invisible to another; and the router running a batch SIGKILLed: the
other replica takes it over, every line answered once and billed once; a tenant's rate limits
left to its interactive traffic; a tenant's storage limit held across both replicas."""
from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.local.cluster import LocalCluster
from services.store.store import Store, Tenant
from tests.e2e.conftest import cluster_config
from tests.postgres import database_url

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with database_url("postgresql", tmp_path_factory.mktemp("batches")) as url:
        store = Store(url)
        store.add_tenant(Tenant("limited", rpm=1, max_concurrent=1))
        store.add_tenant(Tenant("small", storage_mb=1))
        store.close()
        config = cluster_config(dtype="fp32")
        config.store.url, config.auth.replicas, config.billing.flush_seconds = url, 2, 0.2
        config.batches.lease_s, config.batches.concurrency = 2.0, 2
        with LocalCluster(config, quiet=True) as running:
            running.store_url = url
            yield running


def tenant_client(cluster, tenant: str, replica: int = 0) -> openai.OpenAI:
    host = cluster.router_http_addresses[replica]
    return openai.OpenAI(base_url=f"http://{host}/v1", api_key="unused", max_retries=0, timeout=120,
                         default_headers={"x-tenant": tenant})


@pytest.fixture(scope="module")
def alpha(cluster):
    with tenant_client(cluster, "alpha") as client:
        yield client


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return Path(cluster.config.model).name


def jsonl(model: str, bodies: dict[str, dict], url: str = CHAT) -> bytes:
    return "".join(json.dumps({"custom_id": k, "method": "POST", "url": url, "body": {"model": model, **b}}) + "\n"
                   for k, b in bodies.items()).encode()


def chat_body(prompt: str, max_tokens: int = 12, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, **extra}


def alone(client, model: str, body: dict):
    """The chat answer to a batch line's body sent on its own (vLLM's extras as extra_body)."""
    own = {k: v for k, v in body.items() if k in ("messages", "max_tokens", "temperature")}
    return client.chat.completions.create(model=model, **own, extra_body={k: v for k, v in body.items() if k not in own})


def finished(client, batch_id: str, timeout: float = 180) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


def lines(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {o["custom_id"]: o for o in map(json.loads, client.files.content(file_id).text.splitlines())}


def run_batch(client, model, bodies, url: str = CHAT, **create):
    upload = client.files.create(file=("requests.jsonl", jsonl(model, bodies, url), "application/jsonl"),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h", **create)
    assert batch.status == "validating" and batch.request_counts.total == len(bodies)
    return finished(client, batch.id)


def test_a_batch_answers_each_line_as_its_endpoint_does(cluster, alpha, model):
    bodies = {f"q{i}": chat_body(p) for i, p in enumerate(PROMPTS[:4])}
    bodies["bad"] = chat_body("x", temperature=5)
    batch = run_batch(alpha, model, bodies, metadata={"job": "nightly"})
    assert batch.status == "completed" and batch.metadata == {"job": "nightly"}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    output, errors = lines(alpha, batch.output_file_id), lines(alpha, batch.error_file_id)
    assert set(output) == {"q0", "q1", "q2", "q3"} and set(errors) == {"bad"}
    for custom_id, body in list(bodies.items())[:4]:
        direct = alone(alpha, model, body)
        response = output[custom_id]["response"]
        assert response["status_code"] == 200 and response["body"]["service_tier"] == "flex"     # Low
        assert response["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert response["body"]["usage"]["completion_tokens"] == direct.usage.completion_tokens
    refused = errors["bad"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    counted = {"completed": 0.0, "failed": 0.0}          # the routers' metrics, over both replicas
    for host in cluster.router_http_addresses:
        with urllib.request.urlopen(f"http://{host}/metrics", timeout=10) as page:
            families = list(text_string_to_metric_families(page.read().decode()))
        for sample in families:
            for s in sample.samples:
                if s.name == "qos_batch_lines_total":
                    counted[s.labels["outcome"]] += s.value
    assert counted["completed"] >= 4 and counted["failed"] >= 1


def test_completions_and_responses_batches(alpha, model):
    completion = run_batch(alpha, model, {"c": {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}},
                           "/v1/completions")
    alone = alpha.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert lines(alpha, completion.output_file_id)["c"]["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    responses = run_batch(alpha, model, {"r": {"input": "Say hello.", "max_output_tokens": 8, "temperature": 0}},
                          "/v1/responses")
    body = lines(alpha, responses.output_file_id)["r"]["response"]["body"]
    alone = alpha.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0)
    assert body["object"] == "response" and body["output"][0]["content"][0]["text"] == alone.output_text


def test_a_body_that_is_no_json_object_is_a_400(cluster):
    """Batches and /tokenize read their bodies as the generation endpoints do: invalid UTF-8 and
    deep nesting (a 500 before) are 400s naming the body."""
    host = cluster.router_http_addresses[0]
    for path in ("/v1/batches", "/tokenize"):
        for raw in (b"\xff\xfe", b"[" * 50_000 + b"]" * 50_000, b"", b"[1]"):
            request = urllib.request.Request(f"http://{host}{path}", data=raw, method="POST",
                                             headers={"content-type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["param"] == "body"


def test_a_batch_does_not_take_its_tenants_rate_limits(cluster, model):
    """A tenant allowed 1 request a minute and 1 stream: its batch of 4 runs all the same (its
    rates are its interactive traffic's), and its own chat request still finds them unused."""
    with tenant_client(cluster, "limited") as limited:
        batch = run_batch(limited, model, {f"l{i}": chat_body(p, 4) for i, p in enumerate(PROMPTS[:4])})
        assert batch.status == "completed" and batch.request_counts.completed == 4
        assert limited.chat.completions.create(model=model, **chat_body("Hi", 2)).usage.completion_tokens == 2
        with pytest.raises(openai.RateLimitError):
            limited.chat.completions.create(model=model, **chat_body("Hi", 2))       # rpm 1: the second


def test_a_bad_file_fails_the_batch_and_says_where(alpha, model):
    content = jsonl(model, {"a": chat_body("x"), "b": chat_body("y")}) + b'{"custom_id": "c"}\n'
    upload = alpha.files.create(file=("bad.jsonl", content, "application/jsonl"), purpose="batch")
    batch = alpha.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.errors.data[0].line == 3
    assert batch.errors.data[0].code == "invalid_request"
    for kwargs, param in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                          ({"input_file_id": "file-nope"}, "input_file_id")):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as refused:
            alpha.batches.create(**{"input_file_id": upload.id, "endpoint": CHAT, "completion_window": "24h", **kwargs})
        assert refused.value.body["param"] == param


def test_a_cancelled_batch_ends_with_what_ran(alpha, model):
    bodies = {f"long{i}": chat_body(f"Count to one hundred, number {i}.", 120, ignore_eos=True) for i in range(10)}
    upload = alpha.files.create(file=("long.jsonl", jsonl(model, bodies), "application/jsonl"), purpose="batch")
    batch = alpha.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 60
    while alpha.batches.retrieve(batch.id).request_counts.completed < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alpha.batches.cancel(batch.id).status == "cancelling"
    done = finished(alpha, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and 1 <= done.request_counts.completed < 10
    unrun = [o for o in lines(alpha, done.error_file_id).values() if o["response"] is None]
    assert len(unrun) + done.request_counts.completed == 10
    assert {o["error"]["code"] for o in unrun} == {"batch_cancelled"}


def test_one_tenants_files_and_batches_are_not_anothers(cluster, alpha, model):
    batch = run_batch(alpha, model, {"mine": chat_body("secret", 2)})
    with tenant_client(cluster, "beta") as beta:
        for call in (lambda: beta.batches.retrieve(batch.id), lambda: beta.files.retrieve(batch.input_file_id),
                     lambda: beta.files.content(batch.output_file_id), lambda: beta.batches.cancel(batch.id),
                     lambda: beta.files.delete(batch.input_file_id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert batch.id not in {b.id for b in beta.batches.list()}
        assert batch.input_file_id not in {f.id for f in beta.files.list()}
    assert alpha.files.retrieve(batch.input_file_id).purpose == "batch"


def keeping(client, model: str, wanted: str, seconds: float) -> str:
    """Asks to keep a response until it is `wanted` ('kept' or 'refused'), for at most `seconds`;
    what it was last."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            kept = client.responses.create(model=model, input="Hi", max_output_tokens=1)
            assert client.responses.retrieve(kept.id).id == kept.id
            now = "kept"
        except openai.RateLimitError as refused:
            assert refused.code == "storage_quota_exceeded" and refused.param == "store", refused.message
            now = "refused"
        if now == wanted or time.monotonic() > deadline:
            return now
        time.sleep(0.25)


def test_a_tenant_at_its_storage_limit_is_refused_on_either_replica_until_it_deletes(cluster, model):
    """'small' may keep 1 MB (its storage_mb): an upload past it is refused on the other replica
    (the total is the store's), writing nothing; at the limit, requests that would keep something
    (a kept response, a batch) are refused and one with store false is served; a delete makes room.
    Another tenant is not touched by it."""
    lines = jsonl(model, {"a": chat_body("Hi")})
    with tenant_client(cluster, "small", 0) as first, tenant_client(cluster, "small", 1) as second, \
            tenant_client(cluster, "beta", 1) as other:
        batch_file = first.files.create(file=("a.jsonl", lines), purpose="batch")
        big = first.files.create(file=("b.jsonl", b"x" * 600_000), purpose="batch")
        with pytest.raises(openai.RateLimitError) as refused:
            second.files.create(file=("c.jsonl", b"x" * 600_000), purpose="batch")
        assert refused.value.code == "storage_quota_exceeded" and refused.value.param == "file"
        assert "of its 1 MB of storage" in refused.value.message and "retry-after" not in refused.value.response.headers
        assert [f.id for f in second.files.list()] == [big.id, batch_file.id]     # nothing written
        filler = second.files.create(file=("d.jsonl", b"x" * (1_000_000 - 600_000 - len(lines))), purpose="batch")
        usage = second.get("/usage", cast_to=object)
        assert (usage["storage_bytes"], usage["storage_limit_bytes"]) == (1_000_000, 1_000_000)
        # A request that keeps what it makes is let in by the router's copy of the totals, read
        # with keys and tenants every [store] refresh_s: refused from the next read on.
        assert keeping(first, model, "refused", cluster.config.store.refresh_s + 10) == "refused"
        with pytest.raises(openai.RateLimitError) as refused:
            first.batches.create(input_file_id=batch_file.id, endpoint=CHAT, completion_window="24h")
        assert refused.value.param == "input_file_id" and refused.value.code == "storage_quota_exceeded"
        assert first.responses.create(model=model, input="Hi", max_output_tokens=2, store=False).output_text
        other.files.delete(other.files.create(file=("e.jsonl", b"x" * 600_000), purpose="batch").id)
        second.files.delete(filler.id)
        assert keeping(first, model, "kept", cluster.config.store.refresh_s + 10) == "kept"
        # the first file and the response kept now
        assert 600_000 + len(lines) < second.get("/usage", cast_to=object)["storage_bytes"] < 1_000_000


def test_a_batch_whose_router_is_killed_is_finished_by_the_other_and_billed_once(cluster, alpha, model):
    bodies = {f"k{i}": chat_body(p, 40, ignore_eos=True) for i, p in enumerate(PROMPTS)}
    upload = alpha.files.create(file=("k.jsonl", jsonl(model, bodies), "application/jsonl"), purpose="batch")
    batch = alpha.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    store = Store(cluster.store_url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with store.engine.connect() as db:
                owner, completed = db.exec_driver_sql("SELECT owner, completed FROM batches WHERE id = %s",
                                                      (batch.id,)).one()
            if owner and completed >= 2:
                break
            time.sleep(0.1)
        assert completed < len(bodies), "the kill should come mid-batch"
        pid = int(owner.rsplit("-", 2)[1])
        name = next(n for n, p in cluster.processes.items() if p.pid == pid)
        cluster.processes[name].send_signal(signal.SIGKILL)
        survivor = 1 if name == "router" else 0
        with tenant_client(cluster, "alpha", survivor) as client:
            done = finished(client, batch.id)
            output = lines(client, done.output_file_id)
        assert done.status == "completed" and done.request_counts.completed == len(bodies)
        assert set(output) == set(bodies) and done.request_counts.failed == 0
        with tenant_client(cluster, "alpha", survivor) as client:
            for custom_id in ("k0", "k7"):
                assert output[custom_id]["response"]["body"]["choices"][0]["message"]["content"] \
                    == alone(client, model, bodies[custom_id]).choices[0].message.content
        time.sleep(1.0)          # the survivor's last ledger rows
        rows = [r for r in store.ledger_rows(tenant="alpha") if r["request_id"].startswith(batch.id)]
        assert sorted(r["request_id"] for r in rows) == sorted(f"{batch.id}-{i}" for i in range(len(bodies)))
        assert all(r["completion_tokens"] >= 1 for r in rows)
    finally:
        store.close()
