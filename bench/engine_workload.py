"""bench/engine_throughput.py's workload and the engine run over it, apart from the benchmark
itself so that other engine benchmarks (engine_vs_llamacpp, engine_paired, engine_profile,
grammar_mask_cost, stream_overhead) and the tests run exactly the same requests the same way:
random-token prompts of given lengths, outputs forced to their length (EOS ignored), the engine
on BatchRunner with the benchmark's step budget, and a recorder of each step's work and time for
the roofline (bench/roofline.py)."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from tqdm import tqdm

from services.common.step import SamplingParams, StepBatch
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.engine.config import load_model_config
from services.engine.device import DTYPES
from services.engine.engine import Engine, EngineConfig
from services.engine.kv_cache import DEFAULT_BLOCK_SIZE, bytes_per_block

BATCH = 32                    # concurrency of the b32 phase, both sides
# Engine token budget per step (decodes + prefill chunks). Measured on the default b32 workload
# (2 EPYC cores, engine alone): 128 was ~17% slower; 256, 512, 1024, 2048 and 4096 were all
# within run-to-run noise (46-48 s). 512 fits a whole default-max prompt next to 32 decodes.
ENGINE_MAX_STEP_TOKENS = 512
FIRST_PLAIN_TOKEN_ID = 100    # SmolLM2-style vocabularies keep special tokens (BOS, EOS...) below
PROMPT_RANGE = (16, 256)      # default prompt and output lengths, tokens (--min/--max-prompt, -output)
OUTPUT_RANGE = (16, 128)


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int           # exactly this many tokens are generated


def make_workload(count: int, seed: int, vocab: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[Request]:
    """Random-token prompts: the work per token does not depend on the text, and no tokenizer runs."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab) for _ in range(rng.randint(*prompt_range))]
        requests.append(Request(prompt, rng.randint(*output_range)))
    return requests


def warmup_workload(seed: int, vocab: int) -> list[Request]:
    """Two tiny requests run before the timed phases (allocator, kernel selection, lazy imports)."""
    return make_workload(2, seed + 1, vocab, (8, 32), (4, 4))


def useful_tokens(requests: list[Request]) -> int:
    return sum(r.output_len for r in requests)


# --- our engine --------------------------------------------------------------------------------

def load_engine(model_dir: str, threads: int, max_prompt: int, max_output: int, device: str,
                dtype: str, decode_attention: str = "auto") -> Engine:
    # Size the KV cache for exactly BATCH worst-case requests rather than a fraction of free
    # memory: BatchRunner admits a request only once its whole KV need is reserved, so too small a
    # cache would silently run fewer than 32 at a time and too large a one only costs RAM.
    per_request = math.ceil((max_prompt + max_output) / DEFAULT_BLOCK_SIZE)
    kv_bytes = BATCH * per_request * bytes_per_block(load_model_config(model_dir), DEFAULT_BLOCK_SIZE,
                                                     DTYPES[dtype])
    return Engine(EngineConfig(model_dir=model_dir, device=device, dtype=dtype,
                               block_size=DEFAULT_BLOCK_SIZE, kv_cache_bytes=kv_bytes,
                               num_threads=threads, decode_attention=decode_attention))


def run_engine(engine: Engine, requests: list[Request], max_running: int,
               bar: tqdm | None = None) -> tuple[float, list[list[int]]]:
    """Wall seconds and output tokens of one BatchRunner.run over all `requests`."""
    runner = BatchRunner(engine, max_running=max_running, max_step_tokens=ENGINE_MAX_STEP_TOKENS)
    batch = [GenerationRequest(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                        ignore_eos=True)) for r in requests]
    on_token = (lambda _index, _token: bar.update()) if bar is not None else None
    started = time.perf_counter()
    results = runner.run(batch, on_token=on_token)
    elapsed = time.perf_counter() - started
    outputs = [result.token_ids for result in results]
    for i, (request, output) in enumerate(zip(requests, outputs)):
        if len(output) != request.output_len:   # the comparison would be meaningless
            raise RuntimeError(f"engine gave request {i} {len(output)} tokens, not {request.output_len}")
    return elapsed, outputs


class StepRecorder:
    """The engine as BatchRunner uses it, noting each step's (position, tokens, samples) per
    sequence: the roofline's work (bench/roofline.py)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.steps: list[list[tuple[int, int, bool]]] = []
        self.seconds: list[float] = []           # each step's time in engine.step

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def step(self, batch: StepBatch):
        self.steps.append([(s.position, len(s.token_ids), s.sample) for s in batch.sequences])
        started = time.perf_counter()
        output = self.engine.step(batch)
        self.seconds.append(time.perf_counter() - started)
        return output
