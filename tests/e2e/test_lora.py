"""LoRA through the whole cluster, on the default model: an adapter made here with `peft` is
loaded by one of two CPU pools (marked `lora`, as an NPU pool would be); a request naming it
(x-lora over gRPC, `model: "ADAPTER"` or X-Lora over HTTP) is routed to that pool and its greedy
tokens equal PEFT + transformers `generate` with the adapter; the base model's answer differs;
an unknown adapter is refused by name. At run time adapters load only from a worker's
adapter_dirs, and a reload serves the new weights with nothing cached from the old."""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import shutil

import grpc
import pytest
import torch

from services.common.config import (AdapterConfig, AuthConfig, ClusterConfig, PoolConfig, RouterConfig,
                                   SchedulerConfig, WorkerConfig)
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.proto.qos.v1 import router_pb2_grpc
from services.common.tokenizer import TextTokenizer
from services.local.cluster import LocalCluster, resolve_model
from services.tools.client import chat_request, sampling_params
from tests.e2e.conftest import run

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft", reason="peft is a test dependency (requirements.txt)")

PROMPT, NEW_TOKENS = "Name three colours of the rainbow.", 24
ADMIN_KEY = "lora-test-admin-key"       # loading adapters needs it in every mode
EOS = 2                       # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("default", progress=False)


def save_adapter(model_dir, seed: int, folder):
    """A LoRA adapter of random weights (seeded) on q, v, o and down, saved as PEFT saves it."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    with torch.no_grad():          # a milder update than the random init: a different answer, not noise
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory):
    return save_adapter(model_dir, 7, tmp_path_factory.mktemp("adapter") / "colours")


@pytest.fixture(scope="module")
def adapter_v2(model_dir, adapter):
    """Other weights for the same modules, beside `adapter` (inside the main pool's adapter_dirs)."""
    return save_adapter(model_dir, 8, adapter.parent / "colours-v2")


def reference_tokens(model_dir, adapter_dir, prompt_ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                    max_new_tokens=NEW_TOKENS, do_sample=False)
    return without_eos(out[0, len(prompt_ids):].tolist())


def without_eos(tokens: list[int]) -> list[int]:
    """Up to the end-of-sequence token, if any (generate() stops there, as we do)."""
    return tokens[:tokens.index(EOS)] if EOS in tokens else tokens


@pytest.fixture(scope="module")
def cluster(adapter):
    # fp32 like the reference, also on a CPU with native bf16 (where a worker's default is bf16).
    # The main pool loads at run time from the adapters' folder; the adapters pool only from its
    # configured adapter's (adapter_dirs' default).
    worker = lambda **dirs: [WorkerConfig(port=0, threads=1, kv_cache_mb=128, dtype="fp32", **dirs)]  # noqa: E731
    config = ClusterConfig(router=RouterConfig(port=0, http_port=0), auth=AuthConfig(admin_key=ADMIN_KEY), pools=[
        PoolConfig(name="main", device="cpu", primary=True, scheduler=SchedulerConfig(port=0),
                   workers=worker(adapter_dirs=[str(adapter.parent)])),
        PoolConfig(name="adapters", device="cpu", lora=True, scheduler=SchedulerConfig(port=0), workers=worker(),
                   adapters=[AdapterConfig(name="colours", path=str(adapter))])])
    with LocalCluster(config, quiet=True) as running:
        yield running


async def generate_chunks(cluster, lora: str | None = None, max_tokens: int = NEW_TOKENS, started=None, **extra):
    """The response's chunks; `started` (an event) is set at the first."""
    metadata = [("x-priority", "medium")] + ([("x-lora", lora)] if lora else [])
    async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as channel:
        request = chat_request(PROMPT, sampling_params(max_tokens=max_tokens, temperature=0.0, **extra))
        chunks = []
        async for chunk in router_pb2_grpc.RouterStub(channel).Generate(request, metadata=metadata):
            chunks.append(chunk)
            if started is not None:
                started.set()
    return chunks


async def generate(cluster, lora: str | None = None):
    chunks = await generate_chunks(cluster, lora)
    return without_eos([t for c in chunks for t in c.token_ids]), chunks[-1].pool


def http_post(cluster, body: dict, headers: dict | None = None):
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_a_lora_request_goes_to_the_pool_holding_it_and_equals_peft(cluster, model_dir, adapter):
    prompt_ids = TextTokenizer.from_model_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    with_adapter, pool = run(generate(cluster, "colours"))
    assert pool == "adapters" and len(with_adapter) >= 8, with_adapter
    assert with_adapter == reference_tokens(model_dir, adapter, prompt_ids)
    base, base_pool = run(generate(cluster))
    assert base == reference_tokens(model_dir, None, prompt_ids) and base != with_adapter
    assert base_pool == "main"


def test_over_http_the_model_field_or_x_lora_picks_the_adapter(cluster):
    tokens, _ = run(generate(cluster, "colours"))
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": NEW_TOKENS, "temperature": 0}
    by_model = http_post(cluster, {**body, "model": "colours"})
    by_header = http_post(cluster, {**body, "model": cluster.config.model.rsplit("/", 1)[-1]},
                          {"x-lora": "colours"})
    assert by_model[0] == 200 and by_header[0] == 200
    assert by_model[1]["choices"][0]["message"]["content"] == by_header[1]["choices"][0]["message"]["content"]
    assert by_model[1]["usage"]["completion_tokens"] in (len(tokens), len(tokens) + 1)     # + the EOS
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=30)
    conn.request("GET", "/v1/models")
    models = {m["id"]: m for m in json.loads(conn.getresponse().read())["data"]}
    conn.close()
    assert models["colours"]["parent"] in models and models["colours"]["pools"] == ["adapters"]


def test_an_unknown_adapter_is_refused_by_name(cluster):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(generate(cluster, "nope"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "'nope'" in caught.value.details()
    base_model = cluster.config.model.rsplit("/", 1)[-1]
    status, body = http_post(cluster, {"model": base_model, "messages": [{"role": "user", "content": "hi"}]},
                             {"x-lora": "nope"})
    assert status == 404 and "'nope'" in body["error"]["message"] and body["error"]["param"] == "x-lora"


def http_admin(cluster, path: str, body: dict):
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=300)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json",
                                                                   "authorization": f"Bearer {ADMIN_KEY}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_an_adapter_loaded_and_unloaded_at_run_time(cluster, model_dir, adapter, tmp_path):
    status, body = http_admin(cluster, "/v1/load_lora_adapter",
                              {"lora_name": "runtime", "lora_path": str(adapter), "pool": "main"})
    assert status == 200 and "runtime" in body["pools"]["main"]["adapters"], body
    prompt_ids = TextTokenizer.from_model_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    tokens, pool = run(generate(cluster, "runtime"))
    assert pool == "main" and tokens == reference_tokens(model_dir, adapter, prompt_ids)

    bad = adapter.parent / "not-an-adapter"
    bad.mkdir()
    status, body = http_admin(cluster, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad),
                                                                 "pool": "main"})
    assert status == 400 and "no adapter_config.json" in body["error"]["message"]
    status, body = http_admin(cluster, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and body["error"]["param"] == "lora_path"

    status, body = http_admin(cluster, "/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert status == 200 and body["pools"]["main"]["adapters"] == []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(generate(cluster, "runtime"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    status, body = http_admin(cluster, "/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert status == 404 and body["error"]["param"] == "lora_name"


def test_adapters_load_at_run_time_only_from_inside_adapter_dirs(cluster, adapter, adapter_v2, tmp_path):
    outside = shutil.copytree(adapter, tmp_path / "colours")       # the same files, outside
    escape = adapter.parent / ".." / tmp_path.name / "colours"
    inside_link = adapter.parent / "link-out"
    inside_link.symlink_to(tmp_path, target_is_directory=True)
    for pool, path in (("main", outside), ("main", escape), ("main", inside_link / "colours"),
                       ("adapters", adapter_v2)):     # the adapters pool: only its configured adapter's folder
        status, body = http_admin(cluster, "/v1/load_lora_adapter",
                                  {"lora_name": "elsewhere", "lora_path": str(path), "pool": pool})
        assert status == 403 and "adapter_dirs" in body["error"]["message"], (pool, path, body)
    assert http_admin(cluster, "/v1/unload_lora_adapter", {"lora_name": "elsewhere"})[0] == 404


def test_a_reload_serves_the_new_weights_with_nothing_cached_from_the_old(cluster, model_dir, adapter, adapter_v2):
    """A prefix computed under v1, cached; the same name loaded again from v2: the next request
    reads none of v1's blocks (0 cached prompt tokens) and equals PEFT with v2. A reload while a
    request uses the adapter is refused (409) and changes nothing."""
    prompt_ids = TextTokenizer.from_model_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    load = {"lora_name": "swapped", "lora_path": str(adapter), "pool": "main"}
    assert http_admin(cluster, "/v1/load_lora_adapter", load)[0] == 200
    first = run(generate_chunks(cluster, "swapped"))
    again = run(generate_chunks(cluster, "swapped"))
    assert again[-1].usage.cached_tokens >= 16                # v1's prefix is cached

    async def reload_while_running():
        started = asyncio.Event()
        long = asyncio.create_task(generate_chunks(cluster, "swapped", max_tokens=300, started=started,
                                                   ignore_eos=True))
        await started.wait()
        refused = await asyncio.to_thread(http_admin, cluster, "/v1/load_lora_adapter",
                                          {**load, "lora_path": str(adapter_v2)})
        # Long enough to be running on any host; nothing to learn from its last ~250 tokens.
        long.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long
        return refused
    status, body = run(reload_while_running())
    assert status == 409 and "'swapped'" in body["error"]["message"] and "once they finish" in body["error"]["message"]
    assert [t for c in run(generate_chunks(cluster, "swapped")) for t in c.token_ids] == \
        [t for c in first for t in c.token_ids]               # still v1

    assert http_admin(cluster, "/v1/load_lora_adapter", {**load, "lora_path": str(adapter_v2)})[0] == 200
    after = run(generate_chunks(cluster, "swapped"))
    tokens = without_eos([t for c in after for t in c.token_ids])
    assert after[-1].usage.cached_tokens == 0
    assert tokens == reference_tokens(model_dir, adapter_v2, prompt_ids)
    assert tokens != without_eos([t for c in first for t in c.token_ids])
    assert http_admin(cluster, "/v1/unload_lora_adapter", {"lora_name": "swapped"})[0] == 200
