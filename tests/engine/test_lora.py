"""LoRA adapters against PEFT: on tiny random Llama and Qwen2 checkpoints, three random adapters of
different ranks and target modules (made here with `peft`), one mixed batch (3 adapters + the base
model, prefill chunks and decodes) gives each sequence the logits of PEFT's model with its own
adapter active: max abs diff < 1e-4 (fp32, CPU). And adapters the engine cannot serve are refused
naming the field."""
from __future__ import annotations

import json
import random

import pytest
import torch

from services.common.step import SequenceWork, StepBatch
from services.engine.lora import AdapterError
from tests.tiny_models import make_engine, reference_logits, write_tiny_model

peft = pytest.importorskip("peft", reason="peft is a test dependency (requirements.txt)")
pytestmark = pytest.mark.slow          # peft builds and saves adapters: seconds, not milliseconds

ADAPTERS = {
    # name: LoraConfig arguments
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"],
                   rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 4}),
    "mlp-r2-rslora": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                          use_rslora=True, layers_to_transform=[0, 2]),
}


def make_adapter(model_dir, folder, seed: int, b_scale: float = 5.0, **config):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():                       # B starts random too, but small: make the update count
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(folder)
    return folder


def peft_reference(model_dir, adapter_dir):
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"lora-{request.param}")
    model_dir = write_tiny_model(folder / "model", request.param)
    adapters = {name: make_adapter(model_dir, folder / name, seed, **config)
                for seed, (name, config) in enumerate(ADAPTERS.items(), start=1)}
    return model_dir, adapters


def test_a_mixed_batch_matches_peft_adapter_by_adapter(setup):
    model_dir, adapters = setup
    engine = make_engine(model_dir, num_blocks=64)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    rng = random.Random(3)
    names = [*adapters, None]
    prompts = {seq_id: [rng.randrange(3, 512) for _ in range(40 + 7 * seq_id)] for seq_id in range(len(names))}
    tables = {seq_id: list(range(seq_id * 8, seq_id * 8 + 8)) for seq_id in prompts}
    lora = dict(enumerate(names))
    got = {seq_id: [] for seq_id in prompts}
    extended = {s: list(p) + [rng.randrange(3, 512) for _ in range(2)] for s, p in prompts.items()}
    # Step 1: the first 24 tokens of every prompt (chunks that start it); step 2: the rest of the
    # prompts of 0 and 1 (continued chunks) beside one-token steps of 2 and 3 (decodes); step 3:
    # a decode each.
    n0, n1 = len(prompts[0]), len(prompts[1])
    steps = [{0: (0, 24), 1: (0, 24), 2: (0, 24), 3: (0, 24)},
             {0: (24, n0), 1: (24, n1), 2: (24, 25), 3: (24, 25)},
             {0: (n0, n0 + 1), 1: (n1, n1 + 1), 2: (25, 26), 3: (25, 26)}]
    for plan in steps:
        batch = [SequenceWork(seq_id, extended[seq_id][a:b], a, tables[seq_id], lora=lora[seq_id] or "")
                 for seq_id, (a, b) in plan.items()]
        for seq_id, logits in engine.compute_logits(StepBatch(batch)).items():
            got[seq_id].append(logits)
    done = {seq_id: end for seq_id, (_, end) in steps[-1].items()}
    for seq_id, name in lora.items():
        reference = peft_reference(model_dir, adapters[name] if name else None)
        want = reference_logits(reference, extended[seq_id][:done[seq_id]])
        diff = (torch.cat(got[seq_id]) - want).abs().max().item()
        assert diff < 1e-4, f"sequence {seq_id} (adapter {name}): max abs diff {diff:.3g}"
        if name is not None:       # and the adapter changed something: not a vacuous match
            base = reference_logits(peft_reference(model_dir, None), extended[seq_id][:done[seq_id]])
            assert (base - want).abs().max().item() > 1e-2


def test_a_sequence_naming_an_adapter_not_loaded_is_refused(setup):
    from services.engine.engine import InvalidStepError
    model_dir, _ = setup
    engine = make_engine(model_dir, num_blocks=8)
    with pytest.raises(InvalidStepError, match="adapter .nope. is not loaded"):
        engine.compute_logits(StepBatch([SequenceWork(1, [5, 6, 7], 0, [0], lora="nope")]))


@pytest.mark.parametrize("change, words", [
    ({"use_dora": True}, "DoRA (use_dora)"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save is set"),
    ({"bias": "all"}, "bias is 'all'"),
    ({"r": 0}, "r must be a positive number"),
    ({"peft_type": "IA3"}, "only LORA adapters"),
    ({"target_modules": ["q_proj"]}, "target_modules / layers_to_transform do not name it"),
])
def test_adapters_that_cannot_be_served_are_refused_by_field(setup, tmp_path, change, words):
    model_dir, adapters = setup
    source = adapters["attn-r4"]
    folder = tmp_path / "bad"
    folder.mkdir()
    config = {**json.loads((source / "adapter_config.json").read_text()), **change}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    # (target_modules = ["q_proj"]: the weights adapt v_proj too, which it no longer names.)
    engine = make_engine(model_dir, num_blocks=8)
    with pytest.raises(AdapterError, match=words.replace("(", r"\(").replace(")", r"\)")):
        engine.load_adapter("bad", folder)


def test_an_adapter_for_another_model_is_refused(setup, tmp_path):
    model_dir, _ = setup
    other = write_tiny_model(tmp_path / "other", "llama")
    config = json.loads((other / "config.json").read_text())
    config["hidden_size"], config["intermediate_size"], config["head_dim"] = 32, 64, 8
    bigger = tmp_path / "small"
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k in LlamaConfig().to_dict()})).save_pretrained(bigger)
    folder = make_adapter(bigger, tmp_path / "adapter", 9, r=4, lora_alpha=8, target_modules=["q_proj"])
    engine = make_engine(model_dir, num_blocks=8)
    with pytest.raises(AdapterError, match="base model mismatch"):
        engine.load_adapter("other", folder)


def test_past_max_loras_adapters_swap_on_and_off_the_device_and_stay_exact(setup):
    from services.engine.engine import InvalidStepError
    model_dir, adapters = setup
    engine = make_engine(model_dir, num_blocks=32, max_loras=2, max_cpu_loras=3)
    names = list(adapters)
    for name in names:
        engine.load_adapter(name, adapters[name])
    rng = random.Random(11)
    tokens = {i: [rng.randrange(3, 512) for _ in range(30)] for i in range(3)}
    table = {i: list(range(i * 8, i * 8 + 8)) for i in range(3)}
    work = lambda i, a, b: SequenceWork(i, tokens[i][a:b], a, table[i], lora=names[i])  # noqa: E731
    got = {i: [] for i in range(3)}
    # Two adapters per step, in an order that makes each step evict the least recently used one.
    for step in ([work(0, 0, 28), work(1, 0, 28)], [work(2, 0, 28), work(0, 28, 29)],
                 [work(1, 28, 29), work(2, 28, 29)], [work(0, 29, 30), work(1, 29, 30)],
                 [work(2, 29, 30)]):
        for seq_id, logits in engine.compute_logits(StepBatch(step)).items():
            got[seq_id].append(logits)
        assert len(engine.adapters.on_device) <= 2
    for i, name in enumerate(names):
        want = reference_logits(peft_reference(model_dir, adapters[name]), tokens[i])
        assert (torch.cat(got[i]) - want).abs().max().item() < 1e-4, name
    with pytest.raises(InvalidStepError, match="names 3 LoRA adapters; at most max_loras = 2"):
        engine.compute_logits(StepBatch([SequenceWork(10 + i, [5], 0, [20 + i], lora=n) for i, n in enumerate(names)]))


def test_past_max_cpu_loras_the_least_recently_used_idle_adapter_goes(setup):
    model_dir, adapters = setup
    engine = make_engine(model_dir, num_blocks=8, max_loras=1, max_cpu_loras=2)
    first, second, third = (engine.read_adapter(n, p) for n, p in adapters.items())
    assert engine.add_adapter(first) == [] and engine.add_adapter(second) == []
    assert engine.add_adapter(third, in_use={first.name}) == [second.name]       # first is in use: kept
    assert list(engine.adapters) == [first.name, third.name]
    with pytest.raises(AdapterError, match="max_cpu_loras is 2"):
        engine.add_adapter(second, in_use={first.name, third.name})


def test_streaming_mode_with_an_adapter_matches_the_reference(setup):
    """LoRA changes projections only, so streaming mode (tests/engine/test_streaming.py) serves an
    adapter unchanged: its logits are the streaming reference's run over PEFT's modules. (B as
    initialised here, not 5x: with the 5x adapters two dense references already differ by 7.7e-5
    over 500 tokens, as much as the tolerance.)"""
    from services.common.stream_window import StreamWindow
    from tests.engine.test_streaming import StreamingSequence, reference_logits as streaming_reference, split
    model_dir, adapters = setup
    adapter = make_adapter(model_dir, adapters["all-r8"].parent / "streaming", 7, b_scale=1.0, **ADAPTERS["all-r8"])
    engine = make_engine(model_dir, num_blocks=24)
    engine.load_adapter("streaming", adapter)
    rng = random.Random(13)
    ids = [rng.randrange(3, 512) for _ in range(600)]        # past the tiny models' 512 positions
    window = StreamWindow(4, 48)
    seq = StreamingSequence(1, ids, window, list(range(engine.kv_spec.num_blocks)))
    got = []
    for count in split(len(ids), 100):
        work = seq.work(count)
        work.lora = "streaming"
        got.append(engine.compute_logits(StepBatch([work]))[1])
        seq.advance(count)
    with_adapter = peft_reference(model_dir, adapter).base_model.model
    assert (torch.cat(got) - streaming_reference(with_adapter, ids, window)).abs().max().item() < 1e-4
