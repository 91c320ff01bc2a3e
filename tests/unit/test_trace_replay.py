"""bench/trace_replay.py's pure parts: reading Mooncake and Azure traces, choosing rows and scaling
time and lengths, the class rules, prompts whose shared hash ids are shared token prefixes, and
the ideal caches (cases computed by hand)."""
from __future__ import annotations

import json

import pytest

from bench.cache_ideal import ideal_share, lru_hits, optimal_hits
from bench.trace_prompts import BlockText, exact_blocks, one_token_words
from bench.trace_workload import (Scaled, TraceRequest, classes, fit_tokens_per_hash, parse_azure, parse_mooncake,
                                  read_trace, scale_lengths, select, send_times)
from services.common.tokenizer import TextTokenizer
from services.engine.bench_model import bench_model_dir

MOONCAKE = "\n".join(json.dumps(r) for r in [
    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 2353]},
    {"timestamp": 30535, "input_length": 1000, "output_length": 26, "hash_ids": [46, 47]},
    {"timestamp": 31000, "input_length": 10, "output_length": 3000, "hash_ids": [9]},
]) + "\n"
AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,1025,109\n"
         "2023-11-16 18:15:51.0000000,512,1")      # no trailing newline, as in the published files


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_model_dir(bench_model_dir())


def test_mooncake_rows_keep_their_hash_ids_and_start_at_zero(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(MOONCAKE)
    requests, fmt = read_trace(path)
    assert fmt == "mooncake"
    assert requests[0] == TraceRequest(0.0, 6955, 52, (46, 47, 48, 2353))
    assert [r.at_ms for r in requests] == [0.0, 3053.0, 3518.0]


def test_azure_rows_get_hash_ids_no_other_row_has(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE)
    requests, fmt = read_trace(path, block_tokens=512)
    assert fmt == "azure"
    assert [(r.input_length, r.output_length) for r in requests] == [(374, 44), (1025, 109), (512, 1)]
    assert [r.at_ms for r in requests] == pytest.approx([0.0, 4314.579, 4319.41])
    # ceil(input / 512) blocks each, all distinct: nothing is shared, so every ideal is 0
    assert [r.hash_ids for r in requests] == [(0,), (1, 2, 3), (4,)]


def test_a_csv_of_other_columns_is_refused():
    with pytest.raises(ValueError, match="not a Mooncake or Azure trace"):
        parse_azure("a,b\n1,2\n", 512)


def test_select_skips_caps_and_restarts_the_clock():
    requests = parse_mooncake(MOONCAKE)
    assert [r.at_ms for r in select(requests, skip=1)] == [0.0, 465.0]
    assert len(select(requests, count=2)) == 2
    assert len(select(requests, duration_s=3.1)) == 2      # 0 and 3.053 s; 3.518 s is past
    assert select(requests, skip=5) == []


def test_time_is_divided_by_the_speed():
    requests = parse_mooncake(MOONCAKE)
    assert send_times(requests, 2.0) == pytest.approx([0.0, 1.5265, 1.759])
    with pytest.raises(ValueError):
        send_times(requests, 0)


def test_lengths_scale_by_tokens_per_hash_and_cut_only_what_does_not_fit():
    first, second, _ = parse_mooncake(MOONCAKE)
    # ceil(1000 * 8 / 512) = 16 prompt tokens (2 ids of 8); round(26 * 8 / 512) = 0 -> 1 output token
    assert scale_lengths(second, 8, 512, 4096) == Scaled(16, 1, False)
    # never more prompt than the hash ids cover: ceil(6955 * 4 / 512) = 55, but 4 ids x 4 = 16
    assert scale_lengths(first, 4, 512, 4096).prompt_tokens == 16
    # unscaled, 1,000 + 26 tokens in a context of 600: the prompt is cut to 574, from its end
    assert scale_lengths(second, 512, 512, 600) == Scaled(574, 26, True)
    # an output longer than the context: 1 prompt token, the rest output, marked truncated
    assert scale_lengths(TraceRequest(0, 10, 3000, (1,)), 512, 512, 600) == Scaled(1, 599, True)


def test_auto_takes_the_most_tokens_per_hash_that_fit():
    requests = [TraceRequest(0, 1024, 1024, (1, 2))]
    # at t tokens per hash: ceil(1024 t / 512) + round(1024 t / 512) = 4t <= 100 -> t = 25
    assert fit_tokens_per_hash(requests, 512, 100) == 25
    assert fit_tokens_per_hash(requests, 512, 10**6) == 512     # never scaled up
    assert fit_tokens_per_hash([TraceRequest(0, 10**6, 10**6, (1,))], 512, 2) == 0


def test_class_rules():
    requests = [TraceRequest(0, 100, 10, (7, 8)), TraceRequest(0, 5000, 10, (7, 9)),
                TraceRequest(0, 1500, 10, (3,)), TraceRequest(0, 100, 500, (7,))]
    assert classes(requests, "round-robin") == ["high", "medium", "low", "high"]
    assert classes(requests, "lengths") == ["high", "low", "medium", "medium"]
    by_session = classes(requests, "session")
    assert by_session[0] == by_session[1] == by_session[3]       # all start with hash id 7
    assert classes(requests, "session") == by_session           # deterministic


def test_shared_hash_ids_are_shared_token_prefixes_exactly(tokenizer):
    blocks = BlockText(one_token_words(tokenizer), tokens_per_hash=5, max_hash_id=3000, seed=1)
    a_text, a = blocks.prompt([46, 47, 48, 2353], 18)
    b_text, b = blocks.prompt([46, 47, 99], 15)
    assert len(a) == 18 and len(b) == 15
    assert a[:10] == b[:10] and a[10:15] != b[10:15]          # two shared blocks of 5, then apart
    assert a[15:] == blocks.block_ids(2353)[:3]                # the last block partial, its start
    assert tokenizer.encode(a_text) == a and tokenizer.encode(b_text) == b
    assert exact_blocks(tokenizer, [(a_text, a), (b_text, b)], 5) == (7, 7)
    assert BlockText(one_token_words(tokenizer), 5, 3000, seed=1).block_ids(46) == blocks.block_ids(46)
    assert BlockText(one_token_words(tokenizer), 5, 3000, seed=2).block_ids(46) != blocks.block_ids(46)


def test_distinct_hash_ids_have_distinct_texts_when_the_digits_fit(tokenizer):
    words = one_token_words(tokenizer, size=10)
    blocks = BlockText(words, tokens_per_hash=2, max_hash_id=99)      # 2 digits of base 10
    assert blocks.distinct
    assert len({tuple(blocks.block_ids(h)) for h in range(100)}) == 100
    assert not BlockText(words, tokens_per_hash=2, max_hash_id=100).distinct


def test_exact_blocks_counts_from_where_the_tokens_first_differ(tokenizer):
    blocks = BlockText(one_token_words(tokenizer), tokens_per_hash=4, max_hash_id=10)
    text, ids = blocks.prompt([1, 2, 3], 12)
    # Built ids that the text does not give from token 5 on: block 0 exact, blocks 1 and 2 not.
    wrong = ids[:5] + [ids[5] + 1] + ids[6:]
    assert exact_blocks(tokenizer, [(text, wrong)], 4) == (1, 3)
    # A text that makes one token more than built: the last block is not exact.
    assert exact_blocks(tokenizer, [(text + " river", ids)], 4) == (2, 3)


def test_lru_hits_by_hand():
    # (names, usable): a, then a b, then c (evicts with capacity 2), then a b again
    requests = [(["a"], 0), (["a", "b"], 2), (["c"], 1), (["a", "b"], 2)]
    assert lru_hits(requests, None) == [0, 1, 0, 2]
    # capacity 2: after request 3 the cache held [b, a] + c -> the LRU, b, goes (a was touched
    # after b: tails first), so the 4th finds a but not b
    assert lru_hits(requests, 2) == [0, 1, 0, 1]
    assert lru_hits(requests, 0) == [0, 0, 0, 0]
    # a hit is a run of first blocks: b alone is no prefix
    assert lru_hits([(["a", "b"], 2), (["x", "b"], 2)], None) == [0, 0]
    # never more than `usable`, even when the cache holds every block
    assert lru_hits([(["a", "b"], 2), (["a", "b"], 1)], None) == [0, 1]


def test_ideal_share_uses_the_servers_blocks():
    # block 4: prompt A has 2 full blocks; B repeats A's 8 tokens and adds 1 -> 2 blocks usable
    a, b, c = list(range(8)), list(range(8)) + [99], list(range(100, 109))
    assert ideal_share([a, b], 4, None) == pytest.approx(8 / 17)
    # A again right after A: only 1 block usable (its last token is always computed)
    assert ideal_share([a, a], 4, None) == pytest.approx(4 / 16)
    # capacity 2 blocks: C's 2 blocks push A's out before B arrives
    assert ideal_share([a, c, b], 4, 2) == 0.0
    assert ideal_share([a, c, b], 4, 4) == pytest.approx(8 / 26)


def test_the_optimal_cache_keeps_what_is_used_next_by_hand():
    requests = [(["a"], 0), (["a", "b"], 2), (["c"], 1), (["a", "b"], 2)]
    # capacity 2: c is never used again, so it goes at once and a b stay for the 4th request
    assert optimal_hits(requests, 2) == [0, 1, 0, 2]
    assert optimal_hits(requests, 2)[3] > lru_hits(requests, 2)[3]
    # capacity 1, a chain used again in full: the deeper block goes, the head is served
    assert optimal_hits([(["a", "b"], 2), (["a", "b", "c"], 3)], 1) == [0, 1]
    # a block used later beats one used never, even when the never-used one is newer
    assert optimal_hits([(["x"], 1), (["y"], 1), (["x"], 1)], 1) == [0, 0, 1]
    assert lru_hits([(["x"], 1), (["y"], 1), (["x"], 1)], 1) == [0, 0, 0]
