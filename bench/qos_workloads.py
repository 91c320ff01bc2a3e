"""The QoS benchmark's workloads (bench/qos_burst.py): the synthetic burst and the replay of an
Azure 2023 trace, as lists of bench.loadgen.Job, with prompts of ordinary words cut to an exact
token count. What each workload is, and the trace priority rule, are in qos_burst.py's -h text.
"""
from __future__ import annotations

import csv
import random
from datetime import datetime
from pathlib import Path

from bench.loadgen import Job
from services.common.tokenizer import TextTokenizer

WORDS = ("time river stone light paper green music table window garden number market summer "
         "letter story island silver morning travel bridge").split()
TRACES = {"azure-code": "azure2023_code.csv", "azure-conv": "azure2023_conv.csv"}
TRACE_DIR = Path(__file__).resolve().parent / "traces"


def text_of_tokens(tokenizer: TextTokenizer, rng: random.Random, tokens: int) -> tuple[str, int]:
    """A prompt of about `tokens` tokens of ordinary words; returns it with its exact length."""
    words = [rng.choice(WORDS) for _ in range(tokens)]
    text = " ".join(words)
    ids = tokenizer.encode(text)
    if len(ids) > tokens:       # trim to the budget exactly
        text = tokenizer.decode(ids[:tokens])
        ids = tokenizer.encode(text)
    return text, len(ids)


def trace_priority(input_tokens: int, output_tokens: int) -> str:
    if output_tokens <= 64 and input_tokens <= 1024:
        return "high"
    if input_tokens > 2048:
        return "low"
    return "medium"


def trace_workload(tokenizer: TextTokenizer, max_context: int, trace: str, skip: int, count: int,
                   time_scale: float, length_scale: float, seed: int, high_prompt_min: int = 0) -> list[Job]:
    """The trace's rows as jobs. `high_prompt_min`: High prompts (the rule above, from the trace's
    own lengths) are made at least this long: the real-time class with long prompts (chat with
    a document, a long conversation), whose first token needs several steps of prefill."""
    rng = random.Random(seed)
    path = TRACE_DIR / TRACES[trace]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[skip:skip + count]
    if not rows:
        raise SystemExit(f"{path} has no rows after --trace-skip {skip}")

    def seconds(stamp: str) -> float:
        return datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()

    start = seconds(rows[0]["TIMESTAMP"])
    jobs = []
    for row in rows:
        # The priority comes from the trace's own lengths, before scaling.
        context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        priority = trace_priority(context, generated)
        out = max(1, min(int(generated * length_scale), max_context // 4))
        prompt_len = int(context * length_scale)
        if priority == "high":
            prompt_len = max(prompt_len, high_prompt_min)
        prompt_len = max(1, min(prompt_len, max_context - out - 16))
        text, n = text_of_tokens(tokenizer, rng, prompt_len)
        jobs.append(Job(priority, text, n, out, (seconds(row["TIMESTAMP"]) - start) / time_scale))
    return jobs


def burst_workload(tokenizer: TextTokenizer, max_context: int, scale: float, high_rate: float, seed: int,
                   flood_seconds: float) -> list[Job]:
    rng = random.Random(seed)
    arrivals = random.Random(seed + 1)   # arrival times apart, so the prompts do not depend on them
    shapes = burst_shapes(max_context)
    jobs = []
    for priority, count in [("low", 300), ("medium", 500)]:
        prompt_len, out = shapes[priority]
        for _ in range(max(1, round(count * scale))):
            text, n = text_of_tokens(tokenizer, rng, prompt_len)
            jobs.append(Job(priority, text, n, out, arrivals.uniform(0.0, flood_seconds)))
    t = 0.0
    for _ in range(max(1, round(200 * scale))):
        t += rng.expovariate(high_rate)
        prompt_len, out = shapes["high"]
        text, n = text_of_tokens(tokenizer, rng, prompt_len)
        jobs.append(Job("high", text, n, out, t))
    return jobs


# The sustained-load scenario (--workload steady): each class a Poisson stream with the burst's
# request shapes, mixed by request count as below.
STEADY_SHARES = {"high": 0.3, "medium": 0.5, "low": 0.2}


def burst_shapes(max_context: int) -> dict[str, tuple[int, int]]:
    """(prompt tokens, output tokens) of each class's requests in the burst and steady workloads."""
    medium_prompt = 256
    low_prompt = min(max_context - 128 - 16, 16 * medium_prompt)
    if low_prompt < 8 * medium_prompt:
        raise SystemExit(f"the model's context ({max_context}) is too short for Low prompts of "
                         f">= {8 * medium_prompt} tokens")
    return {"high": (32, 32), "medium": (medium_prompt, 64), "low": (low_prompt, 128)}


def saturation_workload(tokenizer: TextTokenizer, max_context: int, count: int, seed: int) -> list[Job]:
    """`count` requests of the steady mix, all at once: what the cluster completes per second under
    them is its capacity for that mix."""
    rng = random.Random(seed + 2)
    shapes = burst_shapes(max_context)
    jobs = []
    for priority, share in STEADY_SHARES.items():
        prompt_len, out = shapes[priority]
        for _ in range(max(1, round(count * share))):
            text, n = text_of_tokens(tokenizer, rng, prompt_len)
            jobs.append(Job(priority, text, n, out, 0.0))
    return jobs


def steady_workload(tokenizer: TextTokenizer, max_context: int, requests_per_s: float,
                    duration_s: float, seed: int) -> list[Job]:
    """Poisson arrivals of every class for `duration_s`, `requests_per_s` in all, split by
    STEADY_SHARES. Prompts are drawn once per class and reused (tokenizing hundreds of Low prompts
    of ~4,000 tokens takes longer than the run; the work per token does not depend on the text)."""
    rng = random.Random(seed)
    arrivals = random.Random(seed + 1)
    shapes = burst_shapes(max_context)
    jobs = []
    for priority, share in STEADY_SHARES.items():
        prompt_len, out = shapes[priority]
        texts = [text_of_tokens(tokenizer, rng, prompt_len) for _ in range(8)]
        t = arrivals.expovariate(requests_per_s * share)
        while t < duration_s:
            text, n = texts[arrivals.randrange(len(texts))]
            jobs.append(Job(priority, text, n, out, t))
            t += arrivals.expovariate(requests_per_s * share)
    return jobs
