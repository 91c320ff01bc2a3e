"""The baseline of bench/engine_throughput.py: Hugging Face transformers generate() on the same
requests, in static batches (left-padded, every row decoding the batch's longest requested length,
EOS unable to end a row early). A request is anything with `prompt` (token ids) and `output_len`.
"""
from __future__ import annotations

import time
from typing import Protocol

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer


class Request(Protocol):
    prompt: list[int]
    output_len: int           # exactly this many tokens are generated


class _StepProgress(BaseStreamer):
    """Advances the bar each decoding step by the rows still inside their requested length."""

    def __init__(self, bar: tqdm, output_lens: list[int]):
        self.bar, self.output_lens, self.step = bar, output_lens, -1   # the first put is the prompt

    def put(self, value: torch.Tensor) -> None:
        self.step += 1
        if self.step == 0:
            return
        self.bar.update(sum(1 for n in self.output_lens if n >= self.step))

    def end(self) -> None:
        pass


def hf_generate(model, requests: list[Request], pad_id: int,
                bar: tqdm | None = None) -> list[list[int]]:
    """One static batch: left-padded prompts, every row decoding the longest requested length."""
    width = max(len(r.prompt) for r in requests)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long, device=model.device)
    attention_mask = torch.zeros((len(requests), width), dtype=torch.long, device=model.device)
    for row, request in enumerate(requests):
        input_ids[row, width - len(request.prompt):] = torch.tensor(request.prompt)
        attention_mask[row, width - len(request.prompt):] = 1
    new_tokens = max(r.output_len for r in requests)
    streamer = _StepProgress(bar, [r.output_len for r in requests]) if bar is not None else None
    # min_new_tokens = max_new_tokens: EOS can never end a row early, like ignore_eos on our side.
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
                         streamer=streamer)
    return [out[row, width:width + r.output_len].tolist() for row, r in enumerate(requests)]


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int,
           bar: tqdm | None = None) -> tuple[float, list[list[int]]]:
    """Wall seconds and output tokens of static batches of `batch_size` consecutive requests."""
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        outputs += hf_generate(model, requests[first:first + batch_size], pad_id, bar)
    return time.perf_counter() - started, outputs
