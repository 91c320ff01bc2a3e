#!/usr/bin/env python
"""The prefix-cache bench's two workloads (bench/prefix_cache.py) written as traces in Mooncake's
format, so that bench/trace_replay.py and bench/cache_tiers.py replay them as they replay a public
trace. One hash id is one block of --block-tokens (16: the server's KV block) tokens; replay with
--block-tokens 16 --tokens-per-hash 16 to send them at their lengths.

  chat  --users conversations, 3-8 turns each; turn t sends the conversation so far (a system
        prompt all users share, every earlier message and the answer to it) and a new message of
        1-3 blocks, --think seconds after the answer to the turn before is due (its output tokens
        at --decode-tok-s). Users start --stagger seconds apart.
  api   --api-requests calls, Poisson at --api-rate a second, each one of --system-prompts system
        prompts of --api-system-blocks blocks, and a question of 1-2 blocks.

    python bench/workload_traces.py --chat bench/traces/workload_chat.jsonl \\
                                    --api bench/traces/workload_api.jsonl [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random
from itertools import count
from pathlib import Path


def chat_trace(rng: random.Random, users: int, system_blocks: int, answer_blocks: int, block_tokens: int,
               think_s: float, stagger_s: float, decode_tok_s: float) -> list[dict]:
    ids = count()
    system = [next(ids) for _ in range(system_blocks)]
    rows = []
    for user in range(users):
        history, at = list(system), user * stagger_s
        for _ in range(rng.randint(3, 8)):
            prompt = history + [next(ids) for _ in range(rng.randint(1, 3))]
            rows.append({"timestamp": round(at * 1000), "input_length": len(prompt) * block_tokens,
                         "output_length": answer_blocks * block_tokens, "hash_ids": prompt})
            history = prompt + [next(ids) for _ in range(answer_blocks)]
            at += answer_blocks * block_tokens / decode_tok_s + think_s
    return sorted(rows, key=lambda r: r["timestamp"])


def api_trace(rng: random.Random, requests: int, rate: float, prompts: int, system_blocks: int,
              answer_tokens: int, block_tokens: int) -> list[dict]:
    ids = count()
    systems = [[next(ids) for _ in range(system_blocks)] for _ in range(prompts)]
    rows, at = [], 0.0
    for _ in range(requests):
        at += rng.expovariate(rate)
        prompt = rng.choice(systems) + [next(ids) for _ in range(rng.randint(1, 2))]
        rows.append({"timestamp": round(at * 1000), "input_length": len(prompt) * block_tokens,
                     "output_length": answer_tokens, "hash_ids": prompt})
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{path}: {len(rows)} requests over {rows[-1]['timestamp'] / 1000:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chat", type=Path)
    parser.add_argument("--api", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--system-blocks", type=int, default=12, help="the chat's shared system prompt")
    parser.add_argument("--answer-blocks", type=int, default=2, help="blocks per chat answer")
    parser.add_argument("--think", type=float, default=4.0)
    parser.add_argument("--stagger", type=float, default=2.0)
    parser.add_argument("--decode-tok-s", type=float, default=8.0, help="a stream's pace, for when its answer is due")
    parser.add_argument("--api-requests", type=int, default=300)
    parser.add_argument("--api-rate", type=float, default=1.5)
    parser.add_argument("--system-prompts", type=int, default=6)
    parser.add_argument("--api-system-blocks", type=int, default=38)
    parser.add_argument("--api-answer", type=int, default=16)
    args = parser.parse_args()
    if args.chat:
        write(args.chat, chat_trace(random.Random(args.seed), args.users, args.system_blocks, args.answer_blocks,
                                    args.block_tokens, args.think, args.stagger, args.decode_tok_s))
    if args.api:
        write(args.api, api_trace(random.Random(args.seed + 1), args.api_requests, args.api_rate,
                                  args.system_prompts, args.api_system_blocks, args.api_answer, args.block_tokens))


if __name__ == "__main__":
    main()
