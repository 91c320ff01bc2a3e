"""The routing rules, table-driven (pure Python)."""
from __future__ import annotations

import pytest

from services.common.priority import HIGH, LOW, MEDIUM
from services.router.routing import (NoPoolError, OverflowThreshold, PoolLoad,
                                     PoolRouter, PoolSpec, RouteRequest)

M = "smollm2"
GPU = PoolSpec("gpu", "cuda", frozenset({M, "llama-8b"}))
NPU = PoolSpec("npu", "npu", frozenset({M}), lora=True)
CPU = PoolSpec("cpu", "cpu", frozenset({M}))
CPU_BIG = PoolSpec("cpu-big", "cpu", frozenset({M}), cost_per_token=0.2, primary=True)


def router(pools, **loads) -> PoolRouter:
    r = PoolRouter(list(pools))
    for name, load in loads.items():
        r.loads[name.replace("_", "-")] = load
    return r


def load(queued=0, free_kv=0.9, ttft_ms=100.0, utilization=0.3, healthy=True, adapters=()) -> PoolLoad:
    return PoolLoad(healthy=healthy, queued=queued, free_kv=free_kv, ttft_ms=ttft_ms, utilization=utilization,
                    adapters=frozenset(adapters))


BUSY_GPU = load(queued=20)

CASES = [
    # (description, pools, loads, request, expected pool, expected rule)
    ("high goes to the GPU even when it queues", [GPU, NPU, CPU], dict(gpu=BUSY_GPU, npu=load(), cpu=load()),
     RouteRequest(M, HIGH), "gpu", "high-to-primary"),
    ("high goes to the primary when there is no GPU", [CPU, CPU_BIG], dict(cpu=load(), cpu_big=load(queued=50)),
     RouteRequest(M, HIGH), "cpu-big", "high-to-primary"),
    ("LoRA goes to the NPU when it has room", [GPU, NPU, CPU],
     dict(gpu=load(adapters=["adapter-1"]), npu=load(adapters=["adapter-1"]), cpu=load(adapters=["adapter-1"])),
     RouteRequest(M, LOW, lora="adapter-1"), "npu", "lora-to-npu"),
    ("LoRA with a full NPU falls back through the other rules", [GPU, NPU],
     dict(gpu=load(adapters=["a"]), npu=load(free_kv=0.02, adapters=["a"])),
     RouteRequest(M, LOW, lora="a"), "gpu", "primary-under-threshold"),
    ("LoRA goes only where the adapter is, even past the NPU", [GPU, NPU, CPU],
     dict(gpu=load(), npu=load(adapters=["b"]), cpu=load(adapters=["a"])),
     RouteRequest(M, LOW, lora="a"), "cpu", "primary-under-threshold"),
    ("High with an adapter: the primary among the pools that hold it", [GPU, NPU, CPU],
     dict(gpu=load(), npu=load(adapters=["a"]), cpu=load(adapters=["a"])),
     RouteRequest(M, HIGH, lora="a"), "npu", "high-to-primary"),
    ("under the threshold, low stays on the GPU", [GPU, NPU, CPU], dict(gpu=load(queued=3), npu=load(), cpu=load()),
     RouteRequest(M, LOW), "gpu", "primary-under-threshold"),
    ("over the threshold, low overflows to the cheapest pool", [GPU, NPU, CPU], dict(gpu=BUSY_GPU, npu=load(), cpu=load()),
     RouteRequest(M, LOW), "cpu", "overflow-cheapest"),
    ("a cheap pool without free KV is skipped", [GPU, NPU, CPU], dict(gpu=BUSY_GPU, npu=load(), cpu=load(free_kv=0.01)),
     RouteRequest(M, LOW), "npu", "overflow-cheapest"),
    ("a cheap pool too slow for the SLO is skipped", [GPU, NPU, CPU],
     dict(gpu=BUSY_GPU, npu=load(ttft_ms=900), cpu=load(ttft_ms=5000)),
     RouteRequest(M, MEDIUM, slo_ms=1000), "npu", "overflow-cheapest"),
    ("the class default SLO applies without x-slo-ms", [GPU, CPU], dict(gpu=BUSY_GPU, cpu=load(ttft_ms=5000)),
     RouteRequest(M, MEDIUM), "gpu", "queue-on-primary"),
    ("low's default SLO is generous", [GPU, CPU], dict(gpu=BUSY_GPU, cpu=load(ttft_ms=5000)),
     RouteRequest(M, LOW), "cpu", "overflow-cheapest"),
    ("no cheap pool fits: queue on the GPU", [GPU, CPU], dict(gpu=BUSY_GPU, cpu=load(queued=30)),
     RouteRequest(M, LOW), "gpu", "queue-on-primary"),
    ("only pools serving the model are candidates", [GPU, NPU, CPU], dict(gpu=BUSY_GPU, npu=load(), cpu=load()),
     RouteRequest("llama-8b", LOW), "gpu", "queue-on-primary"),
    ("an unhealthy pool is not chosen", [GPU, NPU, CPU], dict(gpu=BUSY_GPU, npu=load(), cpu=load(healthy=False)),
     RouteRequest(M, LOW), "npu", "overflow-cheapest"),
    ("the least-queued GPU pool is the primary", [GPU, PoolSpec("gpu2", "cuda", frozenset({M}))],
     dict(gpu=BUSY_GPU, gpu2=load(queued=1)), RouteRequest(M, HIGH), "gpu2", "high-to-primary"),
]


@pytest.mark.parametrize("description, pools, loads, request_, pool, rule", CASES, ids=[c[0] for c in CASES])
def test_rules(description, pools, loads, request_, pool, rule):
    decision = router(pools, **loads).route(request_)
    assert (decision.pool, decision.rule) == (pool, rule)


@pytest.mark.parametrize("request_, message", [
    (RouteRequest("gpt-17", LOW), "model 'gpt-17' is not served by any pool"),
    (RouteRequest("llama-8b", LOW, lora="x"), "LoRA adapter 'x' is not loaded in any pool serving model 'llama-8b'"),
])
def test_unservable_requests_name_the_model(request_, message):
    with pytest.raises(NoPoolError, match=message):
        router([GPU, NPU, CPU]).route(request_)


def test_costs_default_by_device():
    assert (GPU.cost, NPU.cost, CPU.cost, CPU_BIG.cost) == (1.0, 0.3, 0.1, 0.2)


@pytest.mark.parametrize("primary_queued, cheap, expected", [
    (10, load(queued=0, utilization=0.1), 8 / 1.25),      # cheap pools idle, GPU queues: lower
    (0, load(queued=0, utilization=0.1), 8.0),            # nothing queues: keep
    (10, load(queued=9, utilization=0.9), 8 * 1.25),      # cheap pools back up: raise
    (10, load(queued=2, utilization=0.7), 8.0),           # in between: keep
])
def test_threshold_adapts_to_load(primary_queued, cheap, expected):
    r = router([GPU, CPU], cpu=cheap)
    r.update("gpu", load(queued=primary_queued))     # one stats update, one adjustment
    assert r.threshold.value == pytest.approx(expected)


def test_threshold_stays_within_bounds():
    t = OverflowThreshold(value=2.0, minimum=1.0, maximum=4.0)
    for _ in range(10):
        t.adapt(primary_queued=5, cheap_idle=True, cheap_backed_up=False)
    assert t.value == 1.0
    for _ in range(10):
        t.adapt(primary_queued=5, cheap_idle=False, cheap_backed_up=True)
    assert t.value == 4.0


def test_lowered_threshold_overflows_sooner():
    r = router([GPU, CPU], gpu=load(queued=5), cpu=load())
    assert r.route(RouteRequest(M, LOW)).pool == "gpu"          # 5 < 8
    for _ in range(3):
        r.update("gpu", load(queued=5))                          # CPU idles while the GPU queues
    assert r.threshold.value < 5
    assert r.route(RouteRequest(M, LOW)).pool == "cpu"


def test_config_errors():
    with pytest.raises(ValueError, match="unique"):
        PoolRouter([CPU, CPU])
    with pytest.raises(ValueError, match="device must be cuda, npu or cpu"):
        PoolRouter([PoolSpec("tpu", "tpu", frozenset({M}))])


def test_dispatches_count_as_queued_until_the_next_stats():
    r = router([GPU, CPU], gpu=load(queued=0), cpu=load())
    chosen = []
    for _ in range(12):                       # a burst between two stats updates
        decision = r.route(RouteRequest(M, LOW))
        r.note_dispatch(decision.pool)
        chosen.append(decision.pool)
    assert chosen[:8] == ["gpu"] * 8 and "cpu" in chosen[8:]
    r.update("gpu", load(queued=0))           # fresh stats replace the local count
    assert r.route(RouteRequest(M, LOW)).pool == "gpu"


def test_primary_mode_keeps_everything_on_the_primary():
    r = PoolRouter([GPU, CPU], mode="primary")
    r.loads.update(gpu=BUSY_GPU, cpu=load())
    assert r.route(RouteRequest(M, LOW)).pool == "gpu"
    with pytest.raises(ValueError, match="routing mode"):
        PoolRouter([GPU], mode="random")


def test_a_conversation_overflows_to_the_pool_that_holds_its_cache_while_the_rules_allow():
    from services.router.cache_affinity import affinity_key
    from services.common.proto.qos.v1 import common_pb2
    npu_cheaper = PoolSpec("npu", "npu", frozenset({M}), cost_per_token=0.05)
    r = router([GPU, npu_cheaper, CPU], gpu=BUSY_GPU, npu=load(), cpu=load())
    turn = lambda *texts: [common_pb2.ChatMessage(role=role, content=text)          # noqa: E731
                           for role, text in zip(("system", "user", "assistant", "user"), texts)]
    first = RouteRequest(M, LOW, affinity=affinity_key("", turn("be brief", "hello")))
    assert r.route(first).pool == "npu"                     # the cheapest with room
    r.note_dispatch("cpu", first)                           # say it went to the CPU pool
    later = RouteRequest(M, LOW, affinity=affinity_key("", turn("be brief", "hello", "hi!", "and then?")))
    assert later.affinity == first.affinity                 # the same conversation's opening
    assert r.route(later) == ("cpu", "overflow-cache-affinity", 0.0)
    other = RouteRequest(M, LOW, affinity=affinity_key("", turn("be brief", "something else")))
    assert r.route(other).pool == "npu"
    r.loads["cpu"] = load(free_kv=0.01)                     # no room there any more: the rules win
    assert r.route(later) == ("npu", "overflow-cheapest", 0.0)


def test_a_prompt_of_token_ids_has_an_opening_key_of_its_first_tokens():
    from services.router.cache_affinity import OPENING_CHARS, affinity_key
    opening = list(range(OPENING_CHARS // 4))
    key = affinity_key("", (), "tenant-a", opening + [1, 2])
    assert key == affinity_key("", (), "tenant-a", opening + [3]) != 0      # the same opening
    assert key != affinity_key("", (), "tenant-b", opening)                # another scope
    assert affinity_key("", (), "tenant-a", [5] + opening) != key


def test_among_gpu_pools_a_conversation_stays_unless_its_pool_queues_more_than_the_slack():
    gpu2 = PoolSpec("gpu2", "cuda", frozenset({M}))
    r = router([GPU, gpu2], gpu=load(queued=3), gpu2=load(queued=0))
    request = RouteRequest(M, HIGH, affinity=42)
    r.affinity.remember(42, "gpu")
    assert r.route(request).pool == "gpu"                   # 3 more queued: within the slack of 4
    r.loads["gpu"] = load(queued=5)
    assert r.route(request).pool == "gpu2"
