"""A worker's LoRA adapters at run time (services/worker/adapters.py), on the tiny checkpoints, fp32,
CPU: adapters load only from inside adapter_dirs (real paths: `..` and links resolved), and an
adapter a sequence of the worker uses is neither replaced nor unloaded under it; once it is free,
a reload serves the new weights exactly as an engine that loaded them first."""
from __future__ import annotations

import asyncio
import os

import pytest

from services.common.drain import Drain
from services.common.errors import ErrorKind, ServiceError
from services.common.proto.qos.v1 import worker_pb2
from services.common.step import SamplingParams, SequenceWork, StepBatch
from services.common.wire import engine_sampling
from services.worker.server import WorkerService
from tests.tiny_models import make_engine

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft", reason="peft is a test dependency (requirements.txt)")

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [5, 9, 33, 17, 101, 250, 7, 64, 3, 88, 12, 40]


@pytest.fixture()
def folders(tiny_model_dir, tmp_path):
    """adapter_dirs = [allowed]; two versions of one adapter inside it, one outside."""
    from tests.engine.test_lora import ADAPTERS, make_adapter
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    v1 = make_adapter(tiny_model_dir, allowed / "v1", 1, **ADAPTERS["attn-r4"])
    v2 = make_adapter(tiny_model_dir, allowed / "v2", 2, **ADAPTERS["attn-r4"])
    secret = make_adapter(tiny_model_dir, outside / "secret", 3, **ADAPTERS["attn-r4"])
    return allowed, v1, v2, secret


def load(service, name, path):
    return asyncio.run(service.LoadAdapter(worker_pb2.LoadAdapterRequest(name=name, path=str(path)), None))


def refused(call) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        call()
    return caught.value


def step(service, step_id: int, seq_id: int, blocks: list[int], lora: str = "", released=()):
    new = worker_pb2.NewSequence(seq_id=seq_id, prompt_token_ids=PROMPT, sampling=engine_sampling(GREEDY), lora=lora)
    plan = worker_pb2.StepPlan(step_id=step_id, new_sequences=[new], scheduled_seq_ids=[seq_id],
                               scheduled_num_tokens=[len(PROMPT)], granted_seq_ids=[seq_id] * len(blocks),
                               granted_block_ids=blocks, released_seq_ids=list(released))
    answer = service._run_plan(plan, lambda _: None)
    assert not answer.error, answer.error
    return answer


def first_token(engine, lora: str) -> int:
    return engine.step(StepBatch([SequenceWork(1, PROMPT, 0, [0], GREEDY, lora=lora)])).tokens[0].token_id


def test_adapters_load_only_from_inside_adapter_dirs(tiny_model_dir, folders, tmp_path):
    allowed, v1, _, secret = folders
    nowhere = WorkerService(make_engine(tiny_model_dir), Drain("test worker", 1.0))
    error = refused(lambda: load(nowhere, "a", v1))
    assert error.kind is ErrorKind.PERMISSION_DENIED and "adapter_dirs is empty" in error.message

    service = WorkerService(make_engine(tiny_model_dir), Drain("test worker", 1.0), adapter_dirs=[str(allowed)])
    (allowed / "link").symlink_to(secret, target_is_directory=True)
    (tmp_path / "allowed-but-not").mkdir()
    for path in (secret, allowed / ".." / "outside" / "secret", allowed / "link", tmp_path / "allowed-but-not"):
        error = refused(lambda: load(service, "a", path))
        assert error.kind is ErrorKind.PERMISSION_DENIED and error.kind.status.http == 403, path
        assert "[[pools.workers]] adapter_dirs" in error.message and error.field == "path"
    assert "a" not in service.engine.adapters
    reply = load(service, "a", allowed / "v2" / ".." / "v1")       # resolves inside: fine
    assert reply.adapter.path == os.path.realpath(v1) and "a" in service.engine.adapters


def test_an_adapter_in_use_is_not_replaced_and_a_reload_then_serves_the_new_weights(tiny_model_dir, folders):
    allowed, v1, v2, _ = folders
    service = WorkerService(make_engine(tiny_model_dir), Drain("test worker", 1.0), adapter_dirs=[str(allowed)])
    load(service, "a", v1)
    step(service, 1, 1, [0], lora="a")                     # sequence 1 computes under v1
    error = refused(lambda: load(service, "a", v2))
    assert error.kind is ErrorKind.CONFLICT and error.kind.status.http == 409
    assert "'a'" in error.message and "once they finish" in error.message and error.retry_after_ms
    error = refused(lambda: asyncio.run(service.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name="a"), None)))
    assert error.kind is ErrorKind.CONFLICT
    assert service.engine.adapters.loaded["a"].path == os.path.realpath(v1)

    answer = step(service, 2, 2, [1], lora="", released=[1])   # sequence 1 ends
    load(service, "a", v2)
    answer = step(service, 3, 3, [2], lora="a")
    fresh = make_engine(tiny_model_dir)
    fresh.load_adapter("a", v2)
    old = make_engine(tiny_model_dir)
    old.load_adapter("a", v1)
    assert answer.tokens[0].token_id == first_token(fresh, "a") != first_token(old, "a")
