"""Structured outputs in the engine: the grammar mask applies per sequence in any batch mix, EOS
only where the JSON is complete, and a sequence announced again (preemption, failover, resume)
continues its grammar from its tokens. On a random-weight Llama with SmolLM2's tokenizer (its
unconstrained text is noise, so every valid answer is the grammar's doing), fp32."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from services.common.proto.qos.v1 import worker_pb2
from services.common.step import FinishReason, SamplingParams, StepBatch
from services.common.wire import engine_sampling
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.worker.sequences import SequenceTable
from tests.e2e.conftest import text_model
from tests.tiny_models import make_engine

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
SCHEMA_TEXT = json.dumps(SCHEMA)
SCHEMA_PARAMS = SamplingParams(json_schema=SCHEMA_TEXT)
PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def engine():
    return make_engine(text_model(), num_blocks=256, dtype="float32")


def decode(engine, ids):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(engine.grammars.model_dir / "tokenizer.json")).decode(ids)


def test_constrained_rows_give_valid_json_and_leave_their_neighbours_alone(engine):
    constrained = [SamplingParams(temperature=0.0, max_tokens=120, json_schema=SCHEMA_TEXT),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=120, json_schema=SCHEMA_TEXT),
                   SamplingParams(temperature=0.8, top_k=5, seed=4, max_tokens=120, json_schema=json.dumps(
                       {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                        "additionalProperties": False}))]
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    requests = [GenerationRequest(PROMPT[:20 + 5 * i], p) for i, p in enumerate(constrained)]
    mixed = BatchRunner(engine, max_running=8).run(requests[:2] + [GenerationRequest(PROMPT, free)] + requests[2:])
    alone = BatchRunner(engine, max_running=1).run([GenerationRequest(PROMPT, free)])
    assert mixed[2].token_ids == alone[0].token_ids        # the unconstrained row: as if alone
    for result, params in zip(mixed[:2] + mixed[3:], constrained):
        assert result.finish_reason is FinishReason.STOP   # EOS came, once the JSON was complete
        answer = json.loads(decode(engine, result.token_ids))
        jsonschema.validate(answer, json.loads(params.json_schema))


def test_eos_is_allowed_only_where_the_grammar_accepts(engine):
    eos = engine.model_config.eos_token_ids[0]
    result = BatchRunner(engine, max_running=1).run([GenerationRequest(PROMPT, SamplingParams(
        temperature=1.0, seed=9, max_tokens=120, json_schema=SCHEMA_TEXT))])[0]
    matcher = engine.grammars.matcher(SCHEMA_PARAMS, [])
    mask = np.zeros((engine.model_config.vocab_size + 31) // 32, dtype=np.int32)
    for i, token in enumerate(result.token_ids):
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        eos_allowed = bool((int(mask[eos // 32]) >> (eos % 32)) & 1)
        assert eos_allowed == (i == len(result.token_ids) - 1), i     # only at the very end
        assert matcher.consume_token(token)


def test_masks_computed_after_the_forward_give_the_same_answers(engine):
    requests = [GenerationRequest(PROMPT[:30 + i], SamplingParams(temperature=0.0, max_tokens=80, json_schema=SCHEMA_TEXT))
                for i in range(3)]
    during = BatchRunner(engine, max_running=4).run(requests)
    engine.grammars.overlap = False
    try:
        after = BatchRunner(engine, max_running=4).run(requests)
    finally:
        engine.grammars.overlap = True
    assert [r.token_ids for r in after] == [r.token_ids for r in during]


def test_masks_overlap_the_forward_only_where_a_core_is_left_for_them():
    import os
    import torch
    from services.engine.grammar import overlap_masks
    cores = len(os.sched_getaffinity(0))
    assert overlap_masks(torch.device("cuda"), cores) and not overlap_masks(torch.device("cpu"), cores)
    assert overlap_masks(torch.device("cpu"), cores - 1) == (cores > 1)


def test_an_answer_cut_by_max_tokens_ends_with_length(engine):
    result = BatchRunner(engine, max_running=1).run([GenerationRequest(PROMPT, SamplingParams(
        temperature=0.0, max_tokens=6, json_schema=SCHEMA_TEXT))])[0]
    assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 6


# Schemas llguidance compiles but cannot follow to a complete answer: each ended "stop" with
# incomplete JSON ("", '{"', '[[', '"'), its matcher's failure turned into EOS.
DEAD_ENDS = [{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
             {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
             {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
             {"type": "string", "pattern": "^a{1000000}$"}]


@pytest.mark.parametrize("schema", DEAD_ENDS)
def test_a_grammar_that_allows_no_next_token_ends_in_error_never_stop(engine, schema):
    free = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    dead, beside = BatchRunner(engine, max_running=2).run([GenerationRequest(PROMPT[:20], SamplingParams(
        temperature=0.0, max_tokens=30, json_schema=json.dumps(schema))), free])
    assert dead.finish_reason is FinishReason.ERROR and len(dead.token_ids) <= 3
    assert beside.finish_reason is FinishReason.LENGTH and len(beside.token_ids) == 8


def announce(seq_id, tokens, num_generated, params, blocks):
    return worker_pb2.NewSequence(seq_id=seq_id, prompt_token_ids=tokens, sampling=engine_sampling(params),
                                  num_generated=num_generated)


def run_table(engine, table, seq_id, tokens_before, steps, blocks, new):
    """Drive one sequence through `table` and the engine: prefill what it holds, then decode."""
    generated = []
    plan = worker_pb2.StepPlan(step_id=1, new_sequences=[new], scheduled_seq_ids=[seq_id],
                               scheduled_num_tokens=[tokens_before], granted_seq_ids=[seq_id] * len(blocks),
                               granted_block_ids=blocks, packed_results=True)
    for step in range(steps):
        batch = table.apply(plan)
        tokens = engine.step(batch).tokens
        table.commit(batch, tokens)
        generated.append(tokens[0].token_id)
        if tokens[0].finish_reason is not None:
            break
        plan = worker_pb2.StepPlan(step_id=step + 2, scheduled_seq_ids=[seq_id], scheduled_num_tokens=[1],
                                   packed_results=True)
    return generated


def test_a_sequence_announced_again_continues_its_grammar_from_its_tokens(engine):
    params = SamplingParams(temperature=0.0, max_tokens=100, json_schema=SCHEMA_TEXT)
    blocks = list(range(10))
    whole = run_table(engine, SequenceTable(16, engine.grammars.matcher), 1, len(PROMPT), 100, blocks,
                      announce(1, PROMPT, 0, params, blocks))
    assert json.loads(decode(engine, whole))
    cut = len(whole) // 2
    # Preempted (or its worker lost) after `cut` tokens: announced again with them as prompt.
    first = whole[:cut]
    rest = run_table(engine, SequenceTable(16, engine.grammars.matcher), 2, len(PROMPT) + cut, 100,
                     list(range(20, 30)), announce(2, PROMPT + first, cut, params, blocks))
    assert first + rest == whole


@pytest.mark.slow          # peft makes the adapter: seconds
def test_lora_and_streaming_mode_entries_are_constrained_too(engine, tmp_path):
    from services.common.step import SequenceWork
    from services.common.stream_window import StreamWindow
    from tests.engine.test_lora import make_adapter      # skips without peft
    engine.load_adapter("a", make_adapter(text_model(), tmp_path / "a", seed=5, r=4, lora_alpha=8,
                                          target_modules=["q_proj", "v_proj"]))
    matchers = {s: engine.grammars.matcher(SCHEMA_PARAMS, []) for s in (1, 2)}
    params = SamplingParams(temperature=0.0, max_tokens=200, json_schema=SCHEMA_TEXT)
    window = StreamWindow(4, 32)                 # attends its first 4 tokens and the last 32
    tokens = {1: list(PROMPT), 2: list(PROMPT)}
    done = {}
    computed = {1: 0, 2: 0}
    for _ in range(200):
        work = [SequenceWork(s, tokens[s][computed[s]:], computed[s], list(range(16 * s, 16 * s + 16)), params,
                             num_generated=len(tokens[s]) - len(PROMPT), constraint=matchers[s],
                             lora="a" if s == 1 else "", window=window if s == 2 else None)
                for s in (1, 2) if s not in done]
        if not work:
            break
        for w in work:
            computed[w.seq_id] = w.end
        for token in engine.step(StepBatch(work)).tokens:
            tokens[token.seq_id].append(token.token_id)
            if token.finish_reason is not None:
                done[token.seq_id] = token.finish_reason
    for s in (1, 2):
        assert done[s] is FinishReason.STOP
        jsonschema.validate(json.loads(decode(engine, tokens[s][len(PROMPT):])), SCHEMA)


def test_logprobs_are_of_the_masked_logits(engine):
    """The answer's first token is forced ('{"'): after the mask it has all the probability, and
    no token the grammar forbids is among the most likely."""
    from services.common.step import SequenceWork
    params = SamplingParams(temperature=0.0, max_tokens=10, json_schema=SCHEMA_TEXT, logprobs=5)
    work = SequenceWork(1, PROMPT, 0, list(range(4)), params, constraint=engine.grammars.matcher(SCHEMA_PARAMS, []))
    (token,) = engine.step(StepBatch([work])).tokens
    assert decode(engine, [token.token_id]) == '{"'
    assert token.logprobs.logprob == 0.0 and token.logprobs.top == ((token.token_id, 0.0),)


# vLLM's other structured outputs: a regular expression, a choice, a context-free grammar (GBNF).
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
SQL_GBNF = ('root ::= "SELECT " cols " FROM " table ";"\ncols ::= col | col ", " cols\n'
            'col ::= "id" | "name" | "email"\ntable ::= "users" | "orders"')
SQL = r"SELECT (id|name|email)(, (id|name|email))* FROM (users|orders);"
CHOICES = ("positive", "negative", "neither, or both")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_regex_a_choice_and_a_grammar_each_hold_in_a_mixed_batch(engine, seed):
    kinds = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, regex=PHONE),
             SamplingParams(temperature=1.0, seed=seed, max_tokens=20, choice=CHOICES),
             SamplingParams(temperature=1.0, seed=seed, max_tokens=60, grammar=SQL_GBNF)]
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    results = BatchRunner(engine, max_running=8).run(
        [GenerationRequest(PROMPT[:20 + i], p) for i, p in enumerate(kinds)] + [GenerationRequest(PROMPT, free)])
    alone = BatchRunner(engine, max_running=1).run([GenerationRequest(PROMPT, free)])
    assert results[3].token_ids == alone[0].token_ids        # the unconstrained row: as if alone
    phone, choice, sql = (decode(engine, r.token_ids) for r in results[:3])
    assert all(r.finish_reason is FinishReason.STOP for r in results[:3]), [r.finish_reason for r in results]
    assert re.fullmatch(PHONE, phone), phone
    assert choice in CHOICES, choice
    assert re.fullmatch(SQL, sql), sql


def test_a_regex_sequence_announced_again_continues_from_its_tokens(engine):
    params = SamplingParams(temperature=0.0, max_tokens=40, regex=PHONE)
    blocks = list(range(10))
    whole = run_table(engine, SequenceTable(16, engine.grammars.matcher), 1, len(PROMPT), 40, blocks,
                      announce(1, PROMPT, 0, params, blocks))
    cut = len(whole) // 2
    rest = run_table(engine, SequenceTable(16, engine.grammars.matcher), 2, len(PROMPT) + cut, 40,
                     list(range(20, 30)), announce(2, PROMPT + whole[:cut], cut, params, blocks))
    assert whole[:cut] + rest == whole


def test_a_grammar_the_worker_cannot_convert_starts_in_error_not_an_exception(engine):
    """The scheduler refuses such a grammar; should one reach a worker, its sequence ends in
    FinishReason.ERROR like any grammar that fails, and the step goes on."""
    assert engine.grammars.matcher(SamplingParams(grammar="root ::= missing"), []).is_error()
    free = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    bad, beside = BatchRunner(engine, max_running=2).run([GenerationRequest(PROMPT[:20], SamplingParams(
        temperature=0.0, max_tokens=10, grammar="root ::= missing")), free])
    assert bad.finish_reason is FinishReason.ERROR and beside.finish_reason is FinishReason.LENGTH


def test_a_grammar_too_costly_for_a_step_fails_instead_of_stalling_the_batch(engine):
    """(a{600}){600} needs more of llguidance's lexer work for its first mask than a step may
    spend on one row (FIRST_MASK_FUEL): its sequence ends in ERROR. Under llguidance's default
    limits it would be followed, at ~0.6 s of every step's time here."""
    from llguidance import LLMatcher
    from services.common.grammar import guide_grammar
    costly = "(a{600}){600}"
    free = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    bad, beside = BatchRunner(engine, max_running=2).run([GenerationRequest(PROMPT[:20], SamplingParams(
        temperature=0.0, max_tokens=8, regex=costly)), free])
    assert bad.finish_reason is FinishReason.ERROR and beside.finish_reason is FinishReason.LENGTH
    unbounded = LLMatcher(engine.grammars.tokenizer, guide_grammar(costly), log_level=0)
    mask = np.zeros((engine.model_config.vocab_size + 31) // 32, dtype=np.int32)
    unbounded.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    assert not unbounded.is_error()         # the limit, not the regex, is what ends it
