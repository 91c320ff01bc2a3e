"""A request trace as plain values, for bench/trace_replay.py: reading it (Mooncake's JSONL or
Azure's CSV), choosing the rows, scaling time and lengths, and giving each request a class.
Pure: no tokenizer, no network.

Formats, told apart by the file's first character:
  Mooncake (JSONL; kvcache-ai/Mooncake FAST25-release/traces/): one request a line,
    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}; equal
    hash ids are equal blocks of `block_tokens` (512) tokens, the same prefix up to them.
  Azure (CSV, Azure/AzurePublicDataset, bench/traces/azure2023_*.csv):
    TIMESTAMP,ContextTokens,GeneratedTokens; no prompt content, so every request gets hash ids of
    its own (ceil(input / block_tokens) of them, never seen in another request): no request
    shares a prefix with another, and the ideal cache shares are 0.
"""
from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.harness import PRIORITIES
from bench.qos_workloads import trace_priority

MOONCAKE_BLOCK_TOKENS = 512     # tokens per hash id in Mooncake's traces


@dataclass(slots=True, frozen=True)
class TraceRequest:
    at_ms: float                # arrival, ms after the trace's first request
    input_length: int           # prompt tokens in the trace
    output_length: int          # output tokens in the trace
    hash_ids: tuple[int, ...]   # the prompt's blocks, block_tokens each (the last may be partial)


@dataclass(slots=True, frozen=True)
class Scaled:
    """A request's lengths on the model under test."""
    prompt_tokens: int
    output_tokens: int
    truncated: bool             # its prompt was cut to fit the context


def read_trace(path: Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> tuple[list[TraceRequest], str]:
    """The trace's requests in file order, and its format ("mooncake" or "azure")."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        return parse_mooncake(text), "mooncake"
    return parse_azure(text, block_tokens), "azure"


def parse_mooncake(text: str) -> list[TraceRequest]:
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    start = rows[0]["timestamp"] if rows else 0
    return [TraceRequest(float(r["timestamp"] - start), int(r["input_length"]), int(r["output_length"]),
                         tuple(int(h) for h in r["hash_ids"])) for r in rows]


def parse_azure(text: str, block_tokens: int) -> list[TraceRequest]:
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows and not {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= rows[0].keys():
        raise ValueError(f"not a Mooncake or Azure trace: columns {sorted(rows[0])}")

    def seconds(stamp: str) -> float:     # 7 fractional digits; strptime takes 6
        return datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()

    start = seconds(rows[0]["TIMESTAMP"]) if rows else 0.0
    requests, next_id = [], 0
    for row in rows:
        context, blocks = int(row["ContextTokens"]), math.ceil(int(row["ContextTokens"]) / block_tokens)
        requests.append(TraceRequest((seconds(row["TIMESTAMP"]) - start) * 1000, context,
                                     int(row["GeneratedTokens"]), tuple(range(next_id, next_id + blocks))))
        next_id += blocks
    return requests


def select(requests: Sequence[TraceRequest], skip: int = 0, count: int | None = None,
           duration_s: float | None = None) -> list[TraceRequest]:
    """Rows skip.. of the trace, at most `count`, and only those within `duration_s` trace seconds
    of the first one kept; times then start at 0."""
    kept = list(requests[skip:])
    if count is not None:
        kept = kept[:count]
    if not kept:
        return []
    start = kept[0].at_ms
    if duration_s is not None:
        kept = [r for r in kept if r.at_ms - start <= duration_s * 1000]
    return [TraceRequest(r.at_ms - start, r.input_length, r.output_length, r.hash_ids) for r in kept]


def send_times(requests: Sequence[TraceRequest], speed: float) -> list[float]:
    """Seconds after the replay's start at which each request is sent: the trace's times divided
    by `speed` (2: twice as fast)."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, not {speed}")
    return [r.at_ms / 1000 / speed for r in requests]


def scale_lengths(request: TraceRequest, tokens_per_hash: int, block_tokens: int, max_len: int) -> Scaled:
    """The rule: both lengths times tokens_per_hash / block_tokens (prompt rounded up, output to
    nearest, at least 1), so a hash id's block is exactly tokens_per_hash tokens and the last one
    partial (never more than the hash ids cover); a prompt that then leaves no room for its
    output in max_len is cut from its end (its shared prefix kept)."""
    factor = tokens_per_hash / block_tokens
    prompt = max(1, min(math.ceil(request.input_length * factor), len(request.hash_ids) * tokens_per_hash))
    output = max(1, round(request.output_length * factor))
    truncated = prompt + output > max_len
    output = min(output, max_len - 1)           # an output alone over the context leaves 1 prompt token
    return Scaled(min(prompt, max_len - output), output, truncated)


def fit_tokens_per_hash(requests: Sequence[TraceRequest], block_tokens: int, max_len: int) -> int:
    """The most tokens per hash id (at most block_tokens: no scaling up) at which no request
    needs truncating; 0 when even one token per hash id is too many."""
    def fits(t: int) -> bool:
        return not any(scale_lengths(r, t, block_tokens, max_len).truncated for r in requests)

    low, high = 0, block_tokens
    while low < high:               # fits() holds for every t up to the answer
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _round_robin(index: int, request: TraceRequest) -> str:
    return PRIORITIES[index % 3]


def _by_lengths(index: int, request: TraceRequest) -> str:
    return trace_priority(request.input_length, request.output_length)


def _by_session(index: int, request: TraceRequest) -> str:
    # Requests whose first block is the same (a conversation, an app's system prompt) share a
    # class. A multiplicative mix, since hash ids are numbered in order of first appearance.
    first = request.hash_ids[0] if request.hash_ids else index
    return PRIORITIES[((first * 0x9E3779B1) & 0xFFFFFFFF) % 3]


# name -> (rule, what it does), for --classes and its help text
CLASS_RULES: dict[str, tuple[Callable[[int, TraceRequest], str], str]] = {
    "round-robin": (_round_robin, "High, Medium, Low in turn, in trace order (each class a third of the "
                                  "same traffic: per-class TTFT then compares the scheduling alone)"),
    "lengths": (_by_lengths, "by the trace's own lengths, before scaling (bench/qos_workloads.py): output "
                             "<= 64 and input <= 1,024 -> High; input > 2,048 -> Low; else Medium"),
    "session": (_by_session, "by the request's first hash id: requests that start with the same block share "
                             "a class (a fixed pseudo-random one of the three)"),
}


def classes(requests: Sequence[TraceRequest], rule: str) -> list[str]:
    fn = CLASS_RULES[rule][0]
    return [fn(i, r) for i, r in enumerate(requests)]
