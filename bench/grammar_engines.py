#!/usr/bin/env python
"""llguidance against XGrammar on this host, with the embedded model's tokenizer: which grammar
engine constrains structured outputs (docs/http-api.md#structured-outputs)?

For each engine and each JSON Schema below: the time to compile it (into a matcher ready for its
first mask), and the time to compute the token mask at every token of a valid answer, walked
token by token (mask, then consume the token; `answer_tokens_masked_off` counts tokens of that
tokenization the mask left out although the engine accepts them: where the bytes that follow are
forced, llguidance offers only their canonical tokens). Each engine is asked
for the same JSON text (no free whitespace, ", " and ": " separators) and runs on one thread.
Also the one-off cost of reading the tokenizer, and what importing each engine loads.

    python bench/grammar_engines.py [--repeats 20] [--json bench/results/grammar_engines.json]

XGrammar is measured only where it is installed (`pip install --no-deps xgrammar apache-tvm-ffi`:
its GPU kernels' dependency, triton, is not needed on a CPU); the project depends on llguidance.
"""
from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.harness import cpu_name, make_parser, quantile, write_json  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402

SEPARATORS = (", ", ": ")
SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"enum": ["drama", "comedy", "thriller"]},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "actor": {"type": "string"}, "role": {"type": "string"}}, "required": ["actor", "role"],
            "additionalProperties": False}, "minItems": 1, "maxItems": 5},
        "rating": {"type": "number"}}, "required": ["title", "year", "genre", "cast", "rating"],
        "additionalProperties": False},
        {"title": "The Long Night", "year": 1998, "genre": "thriller",
         "cast": [{"actor": "Jane Doe", "role": "detective"}, {"actor": "John Roe", "role": "suspect"}],
         "rating": 7.5}),
    "strings": ({"type": "object", "properties": {
        "email": {"type": "string", "format": "email"}, "date": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "note": {"type": "string", "maxLength": 80}}, "required": ["email", "date", "code", "note"],
        "additionalProperties": False},
        {"email": "ada@example.org", "date": "2024-05-17", "code": "QOS-2024",
         "note": "Delivered on time; \"fragile\" sticker on the box."}),
    "tool_calls": ({"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False}},
         "required": ["name", "arguments"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "search"}, "arguments": {
            "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query", "limit"], "additionalProperties": False}},
         "required": ["name", "arguments"], "additionalProperties": False}]}},
        [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
         {"name": "search", "arguments": {"query": "rain tomorrow", "limit": 3}}]),
}


def import_cost(module: str) -> dict:
    """Seconds to import the engine in a fresh interpreter, and whether that loads torch (the
    router and scheduler never import torch: tests/unit/test_layers.py)."""
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            f"print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return {"import_s": float(out[0]), "imports_torch": out[1] == "True"}


class Llguidance:
    name = "llguidance"

    def __init__(self, model_dir: Path, vocab: int, eos: list[int]):
        import llguidance
        self.llg = llguidance
        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"
        started = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab,
                                                eos_token=eos)
        self.tokenizer_s = time.perf_counter() - started
        self.mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def compile(self, schema: dict):
        from llguidance import LLMatcher
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides={
            "whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]})
        matcher = LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, matcher) -> np.ndarray:
        matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        return self.mask

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, model_dir: Path, vocab: int, eos: list[int]):
        import xgrammar
        from transformers import AutoTokenizer
        self.xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir),
                                                       vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.tokenizer_s = time.perf_counter() - started
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=SEPARATORS, strict_mode=True)
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> np.ndarray:
        matcher.fill_next_token_bitmask(self.mask)
        return self.mask.numpy()

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def allows(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def measure(engine, tokenizer, repeats: int) -> dict:
    out = {"version": engine.version, "tokenizer_s": engine.tokenizer_s, "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        compiles = []
        for _ in range(repeats):
            started = time.perf_counter()
            engine.compile(schema)
            compiles.append(time.perf_counter() - started)
        tokens = tokenizer.encode(json.dumps(instance, separators=(", ", ": ")), add_special_tokens=False).ids
        masks, refused, stopped = [], 0, None
        for _ in range(repeats):
            matcher = engine.compile(schema)
            for index, token in enumerate(tokens):
                started = time.perf_counter()
                mask = engine.fill(matcher)
                masks.append(time.perf_counter() - started)
                refused += not allows(mask, token)
                if not engine.consume(matcher, token):     # a valid answer it cannot produce
                    stopped = {"token_index": index, "text_before": tokenizer.decode(tokens[:index]),
                               "token": tokenizer.decode([token])}
                    break
        out["schemas"][name] = {
            "compile_ms_median": statistics.median(compiles) * 1e3, "compile_ms_max": max(compiles) * 1e3,
            "answer_tokens": len(tokens), "mask_us_median": statistics.median(masks) * 1e6,
            "mask_us_p99": quantile(masks, 0.99) * 1e6, "mask_us_mean": statistics.fmean(masks) * 1e6,
            "answer_tokens_masked_off": refused // repeats, "refused_the_answer_at": stopped}
        row = out["schemas"][name]
        print(f"{engine.name:10s} {name:10s} compile {row['compile_ms_median']:8.2f} ms   mask median "
              f"{row['mask_us_median']:7.1f} us, p99 {row['mask_us_p99']:8.1f} us over {len(tokens)} tokens"
              + (f"; REFUSED token {stopped['token']!r} after {stopped['text_before']!r}" if stopped else ""),
              file=sys.stderr)
    return out


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer
    model_dir = default_model_dir()
    config = load_model_config(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    result = {"model": model_dir.name, "cpu": cpu_name(), "load_average": os.getloadavg()[0],
              "repeats": args.repeats, "separators": SEPARATORS, "engines": {}}
    for engine_class, module in ((Llguidance, "llguidance"), (Xgrammar, "xgrammar")):
        if importlib.util.find_spec(module) is None:
            print(f"{module} is not installed: skipped", file=sys.stderr)
            continue
        engine = engine_class(model_dir, config.vocab_size, list(config.eos_token_ids))
        result["engines"][engine.name] = {**import_cost(module), **measure(engine, tokenizer, args.repeats)}
    result["load_average_after"] = os.getloadavg()[0]
    write_json(args.json, result)


if __name__ == "__main__":
    main()
