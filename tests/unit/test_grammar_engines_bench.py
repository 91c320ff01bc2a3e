"""bench/grammar_engines.py on llguidance (the engine the project depends on): it compiles every
schema of the comparison and accepts each valid answer token by token. (Its mask may still leave
out a token of that tokenization where the bytes that follow are forced: it offers their
canonical tokens, `"` then `}}` rather than `"}`; the JSON counts those.)"""
from __future__ import annotations

from tokenizers import Tokenizer

from bench.grammar_engines import SCHEMAS, Llguidance, measure
from services.engine.config import load_model_config
from services.engine.default_model import default_model_dir


def test_llguidance_walks_every_answer_of_the_comparison():
    model_dir = default_model_dir(progress=False)
    config = load_model_config(model_dir)
    engine = Llguidance(model_dir, config.vocab_size, list(config.eos_token_ids))
    result = measure(engine, Tokenizer.from_file(str(model_dir / "tokenizer.json")), repeats=1)
    assert set(result["schemas"]) == set(SCHEMAS)
    for name, row in result["schemas"].items():
        assert row["refused_the_answer_at"] is None, name
        assert row["answer_tokens"] > 10 and row["mask_us_median"] > 0
