"""Allowed tokens, logit bias, repetition / frequency / presence penalties and min_p: each
against its formula written out by hand (vLLM's), the order they apply in, a grammar's mask kept,
logprobs left the model's, the same token alone or in any batch, and their bounds."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TypicalLogitsWarper

from services.common.step import SamplingParams, SequenceWork, StepBatch
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.engine.sampler import adjust_logits, keep_typical, sample, sample_step
from tests.tiny_models import make_engine

VOCAB = 8


def entry(params: SamplingParams, history=(), output_start=0) -> SequenceWork:
    return SequenceWork(seq_id=0, token_ids=[0], position=0, block_table=[0], sampling=params,
                        history=list(history), output_start=output_start)


def adjusted(params: SamplingParams, logits: list[float], history=(), output_start=0) -> list[float]:
    row = torch.tensor([logits])
    adjust_logits(row, [entry(params, history, output_start)])
    return row[0].tolist()


LOGITS = [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.5]
HISTORY = [1, 2, 6, 6, 0]          # prompt [1, 2], then output [6, 6, 0]


def test_each_adjustment_is_its_formula():
    bias = adjusted(SamplingParams(logit_bias=((3, 5.0), (6, -100.0))), LOGITS)
    assert bias == pytest.approx([2.0, -1.0, 0.5, 2.0, 1.0, 0.0, -96.0, -0.5])

    # Repetition: every token of prompt and output, once, whatever its count.
    rep = adjusted(SamplingParams(repetition_penalty=2.0), LOGITS, HISTORY, 2)
    assert rep == pytest.approx([1.0, -2.0, 0.25, -3.0, 1.0, 0.0, 2.0, -0.5])

    # Frequency and presence: the output only (token 6 twice, 0 once; the prompt's 1 and 2 not).
    pen = adjusted(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), LOGITS, HISTORY, 2)
    assert pen == pytest.approx([2.0 - 0.75, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0 - 1.25, -0.5])

    # Negative values reward instead (OpenAI's range is -2..2).
    assert adjusted(SamplingParams(presence_penalty=-1.0), LOGITS, HISTORY, 2)[6] == pytest.approx(5.0)


def test_the_bias_comes_before_the_repetition_penalty():
    # Token 1's -1 biased to +3 is then divided (positive), not multiplied: vLLM's order.
    got = adjusted(SamplingParams(logit_bias=((1, 4.0),), repetition_penalty=2.0), LOGITS, [1], 1)
    assert got[1] == pytest.approx(1.5)


def test_a_row_without_adjustments_and_a_masked_token_are_left_as_they_are():
    logits = torch.tensor([LOGITS, LOGITS])
    logits[1, 6] = float("-inf")            # a grammar's mask
    rows = [entry(SamplingParams()), entry(SamplingParams(logit_bias=((6, 100.0),), frequency_penalty=-2.0,
                                                          repetition_penalty=0.5), HISTORY, 2)]
    adjust_logits(logits, rows)
    assert logits[0].tolist() == LOGITS and logits[1, 6].item() == float("-inf")


def test_greedy_rows_take_the_argmax_after_the_penalties():
    # Greedy picks 6 (4.0); once 6 was output, a presence penalty of 2 and a frequency one of 2
    # (4 - 2 - 2*2 = -2) leave 0 (2.0) on top.
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    picks = sample_step(torch.tensor([LOGITS, LOGITS]), [entry(params), entry(params, [5, 6], 1)],
                        torch.Generator().manual_seed(0))
    assert [token for token, _ in picks] == [6, 0]


def test_logprobs_are_the_models_not_the_penalised_ones():
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias=((3, 100.0),))
    [(token, logprobs)] = sample_step(torch.tensor([LOGITS]), [entry(params)], torch.Generator())
    total = math.log(sum(math.exp(v) for v in LOGITS))
    assert token == 3                                   # the bias decided the token ...
    assert logprobs.logprob == pytest.approx(-3.0 - total, abs=1e-5)      # ... not its logprob
    assert [t for t, _ in logprobs.top] == [6, 0]


def test_min_p_keeps_only_tokens_near_the_likeliest():
    # Probabilities at temperature 1: token 6 is e^4 / sum; with min_p 0.1 only tokens within a
    # factor 10 of it (logit > 4 - ln 10 = 1.70) may come: 6 and 0.
    logits = torch.tensor([LOGITS] * 400)
    params = [SamplingParams(temperature=1.0, min_p=0.1, seed=s) for s in range(400)]
    drawn = set(sample(logits, params, [0] * 400, torch.Generator()))
    assert drawn == {0, 6}
    unfiltered = set(sample(logits, [SamplingParams(temperature=1.0, seed=s) for s in range(400)],
                            [0] * 400, torch.Generator()))
    assert len(unfiltered) > 2


def test_typical_p_keeps_transformers_typical_set_and_one_is_none():
    """keep_typical drops exactly what transformers' TypicalLogitsWarper drops (TGI's typical_p),
    row by row in one batch of different masses, a row already cut by top-k included; a mass of 1
    drops nothing; sampling with it draws only typical tokens."""
    generator = torch.Generator().manual_seed(3)
    for trial in range(40):
        logits = torch.randn(4, 500, generator=generator) * (1 + trial % 4)
        logits[0, :60] = float("-inf")
        masses = [0.2, 0.6, 0.95, 1.0]
        ours = keep_typical(logits.clone(), masses)
        for row, mass in enumerate(masses[:3]):
            theirs = TypicalLogitsWarper(mass=mass)(None, logits[row:row + 1].clone())[0]
            assert torch.equal(ours[row], theirs), (trial, mass)
        assert torch.equal(ours[3], logits[3])
    logits = torch.tensor([LOGITS] * 300)
    typical = keep_typical(logits[:1].clone(), [0.3])[0]
    params = [SamplingParams(temperature=1.0, typical_p=0.3, seed=s) for s in range(300)]
    assert set(sample(logits, params, [0] * 300, torch.Generator())) == set(torch.isfinite(typical).nonzero()
                                                                           .flatten().tolist())
    with pytest.raises(ValueError, match="typical_p must be in"):
        SamplingParams(typical_p=0.0)


def test_a_penalised_request_gets_the_same_tokens_alone_and_in_a_batch(tiny_model_dir):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.7, presence_penalty=0.4, min_p=0.05, logit_bias=((17, 3.0),))
    prompt = list(range(40, 70))

    def run(requests, seed):
        return [r.token_ids for r in BatchRunner(make_engine(tiny_model_dir, seed=seed), max_running=len(requests),
                                                 max_step_tokens=64).run(requests)]

    alone = run([GenerationRequest(prompt, params)], 1)[0]
    others = [GenerationRequest(list(range(5, 5 + n)), SamplingParams(temperature=t, max_tokens=12, ignore_eos=True))
              for n, t in [(20, 0.0), (33, 1.0)]]
    assert run([others[0], GenerationRequest(prompt, params), others[1]], 5)[1] == alone
    plain = run([GenerationRequest(prompt, SamplingParams(temperature=0.8, seed=7, max_tokens=20,
                                                          ignore_eos=True))], 1)[0]
    assert alone != plain                               # the adjustments changed something


def test_greedy_with_a_frequency_penalty_repeats_less(tiny_model_dir):
    prompt = list(range(40, 48))

    def greedy(**penalty):
        [result] = BatchRunner(make_engine(tiny_model_dir), max_running=1, max_step_tokens=64).run(
            [GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **penalty))])
        return result.token_ids

    def most_repeated(tokens):
        return max(tokens.count(t) for t in set(tokens))

    assert most_repeated(greedy(frequency_penalty=2.0)) < most_repeated(greedy())


@pytest.mark.parametrize("field, value, words", [
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 10]"),
    ("repetition_penalty", 11.0, "repetition_penalty must be in (0, 10]"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("logit_bias", ((3, 101.0),), "logit_bias[3]"),
    ("logit_bias", ((-1, 1.0),), "logit_bias[-1]"),
    ("logit_bias", tuple((i, 1.0) for i in range(1025)), "at most 1024 tokens"),
])
def test_out_of_range_values_are_refused_by_name(field, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**{field: value})


def test_min_tokens_keeps_eos_and_stop_ids_off_until_then():
    # Token 6 is the likeliest: as EOS (or a stop id) it may come only from output index 3 on.
    logits = torch.tensor([LOGITS] * 4)
    eos = SamplingParams(temperature=0.0, min_tokens=3)
    stop_id = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(6,), ignore_eos=True)
    rows = [SequenceWork(seq_id=i, token_ids=[0], position=0, block_table=[0], sampling=p, num_generated=n)
            for i, (p, n) in enumerate([(eos, 2), (eos, 3), (stop_id, 0), (SamplingParams(temperature=0.0,
                                                                                          min_tokens=3, ignore_eos=True), 0)])]
    picks = [token for token, _ in sample_step(logits, rows, torch.Generator(), eos_ids=(6,))]
    assert picks == [0, 6, 0, 6]          # off, allowed at 3, a stop id off, EOS ignored so allowed


def test_a_request_that_would_end_at_once_runs_to_its_min_tokens(tiny_model_dir):
    eos = 2                                    # tests/tiny_models.py's EOS id

    def run(**extra):
        [result] = BatchRunner(make_engine(tiny_model_dir), max_running=1, max_step_tokens=64).run(
            [GenerationRequest(list(range(40, 50)), SamplingParams(temperature=0.0, max_tokens=20,
                                                                   logit_bias=((eos, 100.0),), **extra))])
        return result

    assert len(run().token_ids) == 1 and run().finish_reason.label == "stop"
    held = run(min_tokens=5)
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:-1]
    assert held.finish_reason.label == "stop"


def test_min_tokens_is_bounded_by_max_tokens_and_refused_with_a_schema():
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens=4\]"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens cannot be combined with json_schema"):
        SamplingParams(min_tokens=1, json_schema='{"type": "object"}')


INF = float("-inf")


def test_only_allowed_tokens_keep_their_logits_and_the_other_adjustments_follow():
    assert adjusted(SamplingParams(allowed_token_ids=(0, 3, 3)), LOGITS) == [2.0, INF, INF, -3.0, INF, INF, INF, INF]
    # A bias lifts an allowed token, not a masked one; a penalty leaves -inf as it is.
    got = adjusted(SamplingParams(allowed_token_ids=(0, 3), logit_bias=((3, 10.0), (6, 100.0)),
                                  repetition_penalty=2.0, frequency_penalty=1.0), LOGITS, [0, 6], 0)
    assert got == [1.0 - 1.0, INF, INF, 7.0, INF, INF, INF, INF]


def test_min_tokens_holds_an_allowed_end_off_unless_only_ends_are_allowed():
    rows = [SequenceWork(seq_id=i, token_ids=[0], position=0, block_table=[0], sampling=p)
            for i, p in enumerate([SamplingParams(temperature=0.0, min_tokens=2, allowed_token_ids=(6, 4)),
                                   SamplingParams(temperature=0.0, min_tokens=2, allowed_token_ids=(6,))])]
    picks = sample_step(torch.tensor([LOGITS, LOGITS]), rows, torch.Generator(), eos_ids=(6,))
    assert [token for token, _ in picks] == [4, 6]


def test_logprobs_are_the_models_not_the_allowed_ones():
    params = SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=(3, 7))
    [(token, logprobs)] = sample_step(torch.tensor([LOGITS]), [entry(params)], torch.Generator())
    total = math.log(sum(math.exp(v) for v in LOGITS))
    assert token == 7                                   # the likelier of the two allowed ...
    assert logprobs.logprob == pytest.approx(-0.5 - total, abs=1e-5)      # ... at its model logprob
    assert [t for t, _ in logprobs.top] == [6, 0]       # the model's likeliest, masked or not


ALLOWED = (7, 11, 13, 101, 150)
PROMPT = list(range(40, 70))


def decode(engine, requests: dict[int, SamplingParams], steps: int):
    """Each sequence (seq_id -> sampling) prefilled with PROMPT in one step, then decoded together
    for `steps` tokens; returns each one's generated tokens and their logprobs."""
    tokens = {s: list(PROMPT) for s in requests}
    logprobs = {s: [] for s in requests}
    for step in range(steps):
        batch = StepBatch([SequenceWork(s, tokens[s] if step == 0 else tokens[s][-1:],
                                        0 if step == 0 else len(tokens[s]) - 1, list(range(4 * s, 4 * s + 4)),
                                        params, num_generated=step) for s, params in requests.items()])
        for token in engine.step(batch).tokens:
            tokens[token.seq_id].append(token.token_id)
            logprobs[token.seq_id].append(token.logprobs)
    return {s: t[len(PROMPT):] for s, t in tokens.items()}, logprobs


def test_restricted_rows_sample_only_their_allowed_tokens_beside_unrestricted_ones(tiny_model_dir):
    steps = 20
    plain = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    requests = {1: SamplingParams(temperature=0.9, seed=3, max_tokens=64, ignore_eos=True),
                2: SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=3,
                                  allowed_token_ids=ALLOWED),
                3: SamplingParams(temperature=1.5, seed=11, max_tokens=64, ignore_eos=True, logprobs=0,
                                  allowed_token_ids=ALLOWED),
                4: plain}
    tokens, logprobs = decode(make_engine(tiny_model_dir), requests, steps)
    assert set(tokens[2]) <= set(ALLOWED) and set(tokens[3]) <= set(ALLOWED)
    assert len(set(tokens[3])) > 1                      # drawn, not one token over and over
    assert not set(tokens[4]) <= set(ALLOWED)           # the restriction changed the tokens
    for seq_id in (1, 3, 4):                            # the same tokens alone as in the batch
        assert decode(make_engine(tiny_model_dir), {seq_id: requests[seq_id]}, steps)[0][seq_id] == tokens[seq_id]

    # Each restricted token's logprob is the model's over the whole vocabulary, not renormalised
    # over the allowed ones.
    fresh = make_engine(tiny_model_dir)
    for seq_id in (2, 3):
        full = PROMPT + tokens[seq_id]
        reference = fresh.compute_logits(StepBatch([SequenceWork(9, full, 0, list(range(40, 44)))]))[9]
        reference = reference.double().log_softmax(dim=-1)
        for i, got in enumerate(logprobs[seq_id]):
            assert got.logprob == pytest.approx(reference[len(PROMPT) - 1 + i, tokens[seq_id][i]].item(), abs=1e-4)
    assert any(t not in ALLOWED for lp in logprobs[2] for t, _ in lp.top)   # the model's likeliest



def test_a_bad_word_is_banned_whole_or_by_its_last_token_after_the_rest():
    # Token 6 alone always; token 4 only when the output so far ends with 0 (the prompt does not count).
    words = SamplingParams(bad_words_ids=((6,), (0, 4)))
    assert adjusted(words, LOGITS, [1, 2, 6, 0], 2) == [2.0, -1.0, 0.5, -3.0, INF, 0.0, INF, -0.5]
    assert adjusted(words, LOGITS, [0], 1)[4] == 1.0 and adjusted(words, LOGITS, [0, 5], 1)[4] == 1.0
    with pytest.raises(ValueError, match="bad_words and allowed_token_ids"):
        SamplingParams(bad_words_ids=((6,),), allowed_token_ids=(1,))
    with pytest.raises(ValueError, match="bad_words and regex"):
        SamplingParams(bad_words_ids=((6,),), regex="a+")
    with pytest.raises(ValueError, match="bad_words must be 1 to"):
        SamplingParams(bad_words_ids=((),))


def decode_with_history(engine, params: SamplingParams, steps: int) -> list[int]:
    """One sequence decoded greedily as a worker feeds it: its tokens so far as the history."""
    tokens = list(PROMPT)
    for step in range(steps):
        batch = StepBatch([SequenceWork(1, tokens if step == 0 else tokens[-1:], 0 if step == 0 else len(tokens) - 1,
                                        list(range(4)), params, num_generated=step, history=list(tokens),
                                        output_start=len(PROMPT))])
        tokens += [token.token_id for token in engine.step(batch).tokens]
    return tokens[len(PROMPT):]


def test_bad_words_change_the_greedy_answer_where_they_would_come(tiny_model_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = decode_with_history(make_engine(tiny_model_dir), greedy, 12)
    k = next(i for i in range(1, len(plain)) if plain[i] not in plain[:i])      # a token new at k
    one = decode_with_history(make_engine(tiny_model_dir), SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, bad_words_ids=((plain[k],),)), 12)
    assert one[:k] == plain[:k] and plain[k] not in one
    two = decode_with_history(make_engine(tiny_model_dir), SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, bad_words_ids=((plain[k - 1], plain[k]),)), 12)
    assert two[:k] == plain[:k] and two[k] != plain[k]          # its last token, only after the first
