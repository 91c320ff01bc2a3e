"""The embedded default model (SmolLM2-135M-Instruct) against transformers, token for token."""
from __future__ import annotations

import os

import pytest
import torch

from services.common.step import SamplingParams
from services.common.tokenizer import TextTokenizer
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.engine.default_model import default_model_dir
from services.engine.engine import Engine, EngineConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    "Explain how a rainbow forms.",
    "Write a short story about a lighthouse keeper.",
    "List five uses of baking soda and explain each.",
    "Describe the water cycle step by step.",
    "What are the benefits of regular exercise? Answer in detail.",
    "Explain what a neural network is to a ten year old.",
    "Write a letter to a friend about a trip to the mountains.",
    "Describe how bread is made, from flour to loaf.",
]
NEW_TOKENS = 32                 # the assertion below wants 32 without an early end of text


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir(progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return TextTokenizer.from_model_dir(model_dir)


def test_chat_template_matches_transformers(model_dir, tokenizer):
    from transformers import AutoTokenizer
    reference = AutoTokenizer.from_pretrained(model_dir)
    conversations = [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Über café 🍰?"}],
    ]
    for messages in conversations:
        want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tokenizer.chat_template.render(messages) == want
        assert tokenizer.encode_chat(messages) == reference(want, add_special_tokens=False)["input_ids"]


def test_greedy_batch_equals_transformers_generate(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    engine = Engine(EngineConfig(model_dir=str(model_dir), num_threads=1, dtype="float32",
                                 kv_cache_bytes=64 * 2**20))     # fp32 like the reference, on any CPU
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    results = BatchRunner(engine, max_running=len(prompts)).run(
        [GenerationRequest(p, params) for p in prompts])

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, result, text in zip(prompts, results, PROMPTS):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                     dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = out[0, len(prompt):].tolist()
        assert len(result.token_ids) >= 32, text
        assert result.token_ids == expected, (text, tokenizer.decode(result.token_ids),
                                              tokenizer.decode(expected))


def test_the_converted_folder_is_readable_by_every_user(model_dir, tmp_path):
    """An image converts the model as root and runs as user qos: every file must be readable by
    all (safetensors writes 0600; the first CPU image built failed on exactly this). The folder
    writer convert_gguf ends with, on a tiny model (the whole conversion takes ~20 s; `make test`
    has just run it for the cached folder, checked too), under a umask that would hide them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.engine.default_model import write_model_folder
    from tests.tiny_models import write_tiny_model
    tiny = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "tiny", "qwen2"))
    target = tmp_path / "model"
    umask = os.umask(0o077)
    try:
        write_model_folder(tiny, AutoTokenizer.from_pretrained(model_dir), target, source="test")
    finally:
        os.umask(umask)
    for folder in (target, model_dir):
        modes = {f.name: oct(f.stat().st_mode & 0o777) for f in folder.iterdir()}
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(modes), modes
        assert all(int(mode, 8) & 0o444 == 0o444 for mode in modes.values()), (folder, modes)
    assert target.stat().st_mode & 0o555 == 0o555          # the folder itself: listable by all
    assert AutoModelForCausalLM.from_pretrained(target).config.tie_word_embeddings   # loads back
