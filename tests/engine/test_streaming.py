"""Streaming mode (StreamingLLM attention sinks) is exact: the paged engine, keeping only the sink
block and the window's blocks and dropping the rest as the sequence grows, gives the logits of a
plain, unpaged reference written here from the definition (services/common/stream_window.py):
the query at text position t attends the first S tokens and the W most recent, each key rotated
by its position in that kept cache. Within 1e-4, over sequences several windows long and past
the model's context window (512 for the tiny models), prefilled in chunks or decoded a token at
a time, batched with other sequences, and preempted (every block dropped) then recomputed."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.step import SamplingParams, SequenceWork, StepBatch
from services.common.stream_window import StreamWindow, kept_blocks
from services.engine.engine import InvalidStepError
from tests.tiny_models import make_engine

BS = 16
TOLERANCE = 1e-4


def reference_logits(model, ids: list[int], window: StreamWindow) -> torch.Tensor:
    """Logits [len(ids), vocab] of streaming attention, token by token, from the checkpoint's own
    modules (transformers): keys and queries before rotation, rotated by cache position."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    inner, sinks, width = model.model, window.sink_tokens, window.window_tokens
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    n = len(ids)
    with torch.no_grad():
        x = inner.embed_tokens(torch.tensor(ids))
        for layer in inner.layers:
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            q = attn.q_proj(h).view(n, heads, dim)
            k = attn.k_proj(h).view(n, kv_heads, dim).repeat_interleave(heads // kv_heads, dim=1)
            v = attn.v_proj(h).view(n, kv_heads, dim).repeat_interleave(heads // kv_heads, dim=1)
            out = torch.empty(n, heads, dim)
            for t in range(n):
                start = max(sinks, t - width + 1)
                visible = [p for p in range(min(sinks, t + 1))] + list(range(start, t + 1))
                cache_pos = torch.tensor([p if p < sinks else sinks + p - start for p in visible])
                cos, sin = inner.rotary_emb(x, cache_pos.unsqueeze(0))
                # [1, heads, len, dim] as transformers lays them out
                qt = q[t].view(1, heads, 1, dim).expand(1, heads, len(visible), dim)
                kt = k[visible].transpose(0, 1).unsqueeze(0)
                q_rot, k_rot = apply_rotary_pos_emb(qt, kt, cos, sin)
                scores = (q_rot[0, :, -1:] @ k_rot[0].transpose(-1, -2)) * dim ** -0.5   # [heads, 1, len]
                out[t] = (torch.softmax(scores, dim=-1) @ v[visible].transpose(0, 1))[:, 0]
            x = x + attn.o_proj(out.view(n, heads * dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(inner.norm(x)).float()


class StreamingSequence:
    """One sequence's blocks as the scheduler keeps them in streaming mode: blocks granted for the
    next chunk, and those no later query reads dropped from the front after each step."""

    def __init__(self, seq_id: int, ids: list[int], window: StreamWindow, free: list[int]):
        self.seq_id, self.ids, self.window, self.free = seq_id, ids, window, free
        self.table: list[int] = []
        self.dropped = 0
        self.computed = 0
        self.most_blocks = 0

    def work(self, count: int, sampling: SamplingParams | None = None, generated: int = 0) -> SequenceWork:
        end = self.computed + count
        while len(self.table) < kept_blocks(end, self.dropped, BS):
            self.table.append(self.free.pop())
        self.most_blocks = max(self.most_blocks, len(self.table))
        extra = {} if sampling is None else {"sampling": sampling, "num_generated": generated}
        return SequenceWork(self.seq_id, self.ids[self.computed:end], self.computed, list(self.table),
                            window=self.window, dropped_blocks=self.dropped, **extra)

    def advance(self, count: int) -> None:
        self.computed += count
        drop = self.window.droppable(self.computed, self.dropped, BS)
        self.free.extend(self.table[1:1 + drop])
        del self.table[1:1 + drop]
        self.dropped += drop

    def preempt(self) -> None:
        self.free.extend(self.table)
        self.table, self.dropped, self.computed = [], 0, 0


def streamed_logits(engine, seq: StreamingSequence, chunks: list[int]) -> torch.Tensor:
    out = []
    for count in chunks:
        out.append(engine.compute_logits(StepBatch([seq.work(count)]))[seq.seq_id])
        seq.advance(count)
    return torch.cat(out)


def split(n: int, size: int) -> list[int]:
    return [min(size, n - i) for i in range(0, n, size)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, num_blocks=96)


@pytest.fixture(scope="module")
def ids():
    rng = random.Random(5)
    return [rng.randrange(5, 500) for _ in range(700)]     # past the tiny models' 512 positions


@pytest.fixture(scope="module")
def reference(tiny_reference, ids):
    return {w: reference_logits(tiny_reference, ids, w)
            for w in (StreamWindow(4, 60), StreamWindow(0, 60))}


@pytest.mark.parametrize("window", [StreamWindow(4, 60), StreamWindow(0, 60)], ids=["sinks", "window-only"])
@pytest.mark.parametrize("chunk", [1, 37, 128])
def test_streaming_matches_reference(engine, ids, reference, window, chunk):
    free = list(range(engine.kv_spec.num_blocks))
    seq = StreamingSequence(1, ids, window, free)
    got = streamed_logits(engine, seq, split(len(ids), chunk))
    assert (got - reference[window]).abs().max().item() < TOLERANCE
    # Bounded KV: never more than the sink block and the blocks of window + chunk.
    assert seq.most_blocks <= window.max_blocks(chunk, BS)
    assert seq.dropped > 0 and len(seq.table) <= window.max_blocks(1, BS)


def test_dense_and_streaming_agree_before_the_first_eviction(engine, tiny_reference, ids):
    """Until a token falls out of the window, streaming attention is ordinary causal attention."""
    window = StreamWindow(4, 60)
    seq = StreamingSequence(1, ids[:64], window, list(range(engine.kv_spec.num_blocks)))
    got = streamed_logits(engine, seq, [20, 44])
    with torch.no_grad():
        dense = tiny_reference(torch.tensor([ids[:64]])).logits[0].float()
    assert (got - dense).abs().max().item() < TOLERANCE


def test_preempted_and_recomputed(engine, ids, reference):
    """Preemption drops every block; recomputing from position 0 (in other chunks) continues with
    the logits of an uninterrupted run."""
    window = StreamWindow(4, 60)
    seq = StreamingSequence(1, ids, window, list(range(engine.kv_spec.num_blocks)))
    streamed_logits(engine, seq, split(400, 50))
    seq.preempt()
    streamed_logits(engine, seq, split(450, 128))
    rest = streamed_logits(engine, seq, [1] * 20 + split(len(ids) - 470, 64))
    assert (rest - reference[window][450:]).abs().max().item() < TOLERANCE


def test_batched_with_dense_and_other_streams(engine, tiny_reference, ids, reference):
    """Streaming decodes of several sequences attend together (padded to the longest), beside a
    streaming chunk and a dense sequence, each exact."""
    window = StreamWindow(4, 60)
    free = list(range(engine.kv_spec.num_blocks))
    a, b, c = (StreamingSequence(i, ids, window, free) for i in (1, 2, 3))
    for seq, upto in ((a, 300), (b, 520), (c, 90)):
        streamed_logits(engine, seq, split(upto, 128))
    dense_ids = ids[:40]
    dense_table = [free.pop() for _ in range(3)]
    dense_want = tiny_reference(torch.tensor([dense_ids])).logits[0].float()
    got = engine.compute_logits(StepBatch([
        a.work(1), b.work(1), c.work(30), SequenceWork(9, dense_ids, 0, dense_table)]))
    assert (got[1] - reference[window][300:301]).abs().max().item() < TOLERANCE
    assert (got[2] - reference[window][520:521]).abs().max().item() < TOLERANCE
    assert (got[3] - reference[window][90:120]).abs().max().item() < TOLERANCE
    assert (got[9] - dense_want.detach()).abs().max().item() < TOLERANCE


def test_generation_runs_past_the_context_window(engine, ids):
    """step() samples in streaming mode past the model's context (a dense sequence would stop
    with LENGTH there), and greedy tokens are the same whatever the chunking."""
    window = StreamWindow(4, 60)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def generate(chunk: int) -> list[int]:
        seq = StreamingSequence(1, list(ids[:500]), window, list(range(engine.kv_spec.num_blocks)))
        chunks = split(500, chunk)
        for count in chunks[:-1]:
            engine.compute_logits(StepBatch([seq.work(count)]))
            seq.advance(count)
        [token] = engine.step(StepBatch([seq.work(chunks[-1], params)])).tokens
        seq.advance(chunks[-1])
        out = [token.token_id]
        while len(out) < 40:
            seq.ids.append(out[-1])
            [token] = engine.step(StepBatch([seq.work(1, params, len(out))])).tokens
            seq.advance(1)
            out.append(token.token_id)
        assert token.finish_reason is not None and token.finish_reason.label == "length"
        assert seq.computed > 512
        return out

    assert generate(100) == generate(37)


def test_checks_name_the_problem(engine, ids):
    window = StreamWindow(4, 60)
    seq = StreamingSequence(1, ids, window, list(range(engine.kv_spec.num_blocks)))
    streamed_logits(engine, seq, [200])
    early = SequenceWork(1, ids[200:201], 200, list(seq.table), window=window, dropped_blocks=seq.dropped + 2)
    with pytest.raises(InvalidStepError, match="dropped .* still reads"):
        engine.compute_logits(StepBatch([early]))
    too_wide = SequenceWork(2, ids[:8], 0, [0], window=StreamWindow(4, 600))
    with pytest.raises(InvalidStepError, match="exceeds the model's context window of 512"):
        engine.compute_logits(StepBatch([too_wide]))
    many_sinks = SequenceWork(2, ids[:8], 0, [0], window=StreamWindow(20, 60))
    with pytest.raises(InvalidStepError, match="must fit the first KV block"):
        engine.compute_logits(StepBatch([many_sinks]))
