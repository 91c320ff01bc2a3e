"""Laying out a step for the model: the order of its tokens in the flat batch, where each one's
K/V is written, and what each attends to (services/engine/model.py: AttentionLayout).

    layout = StepLayouter(block_size, device, decode_kernel=True, prompts_by_kernel=True)
    ordered, token_ids, attention = layout(batch.sequences)     # entries already checked

Where the paged attention kernel attends decodes (`decode_kernel`, the default on CPU), each decode
is a row of it, read from the cache in place. With `prompts_by_kernel`, every token of a prompt
chunk is a row too, at its own context length (kernels/paged_attention.c: it tiles a chunk's rows
against its keys in place, faster than SDPA over a gathered copy). With both, a token is computed
exactly as a decode of its position and inside a prompt, so (with the linear layers on the C
kernel) its logits do not depend on what else ran in its step, on how its prompt was chunked, or
on whether it is being recomputed (a preempted or moved sequence): Engine.batch_invariant.
Otherwise (GPU, NPU, the kernel off) a chunk attends with torch's SDPA over its gathered context
(or over its own K/V when it starts a prompt). Streaming-mode entries always take the windowed
path (model.windowed_attention).
"""
from __future__ import annotations

import torch

from services.common.kv_blocks import blocks_for_tokens as blocks_for
from services.common.step import SequenceWork
from services.common.stream_window import kept_blocks, table_index
from services.engine.model import AttentionLayout, ContextAttention, PagedDecodes


def batch_invariant_on_this_host(dtype: torch.dtype) -> bool:
    """Whether a CPU engine in `dtype` here, with its default settings, computes every token the same
    way whatever its batch, chunking or recompute: the linear kernel takes the dtype (bf16 needs
    avx512_bf16) and the paged attention kernel builds (a C compiler). Engine.batch_invariant says
    it of one engine (all of its layers on the kernel, a head size the attention kernel takes)."""
    from services.engine.linear_kernel import load_linear_kernel
    from services.engine.paged_attention import load_paged_kernel
    linear = load_linear_kernel()
    return linear is not None and dtype in linear.dtypes and load_paged_kernel() is not None


# What one more decode group costs (a gather and an attention call in every layer), in padded KV
# blocks of one sequence: measured on 2 EPYC cores, a call costs about as much as 10 blocks.
GROUP_COST_BLOCKS = 10


def group_decodes(decodes: list[SequenceWork], block_size: int) -> list[list[SequenceWork]]:
    """Decodes in groups of similar context length, each padded to its longest context.

    Sorted by length, split where that minimises padded blocks + GROUP_COST_BLOCKS per group
    (dynamic programming over the points where the block count changes: few). Fixed log2
    buckets padded a batch-32 benchmark step by 21%."""
    ordered = sorted(decodes, key=lambda s: s.end)
    blocks = [blocks_for(s.end, block_size) for s in ordered]
    cuts = [0] + [i + 1 for i in range(len(ordered)) if i + 1 == len(ordered) or blocks[i + 1] != blocks[i]]
    best, previous = [0] + [float("inf")] * (len(cuts) - 1), [0] * len(cuts)
    for j in range(1, len(cuts)):
        for i in range(j):
            cost = best[i] + (cuts[j] - cuts[i]) * blocks[cuts[j] - 1] + GROUP_COST_BLOCKS
            if cost < best[j]:
                best[j], previous[j] = cost, i
    groups, j = [], len(cuts) - 1
    while j > 0:
        groups.append(ordered[cuts[previous[j]]:cuts[j]])
        j = previous[j]
    return groups[::-1]


class StepLayouter:
    def __init__(self, block_size: int, device: torch.device, decode_kernel: bool, prompts_by_kernel: bool):
        self.block_size, self.device = block_size, device
        self.decode_kernel, self.prompts_by_kernel = decode_kernel, prompts_by_kernel

    def __call__(self, sequences: list[SequenceWork]) -> tuple[list[SequenceWork], torch.Tensor, AttentionLayout]:
        """Flat order: kernel decodes, prompt chunks on the kernel, decode groups, chunks that
        continue a prompt, streaming groups, then chunks that start a prompt (their own K/V are
        their whole context, no gather needed)."""
        block_size = self.block_size
        dense = [s for s in sequences if s.window is None]
        decodes = [s for s in dense if len(s.token_ids) == 1]
        continued = [s for s in dense if len(s.token_ids) > 1 and s.position > 0]
        fresh = [s for s in dense if len(s.token_ids) > 1 and s.position == 0]

        ordered: list[SequenceWork] = []
        cached: list[ContextAttention] = []
        paged = prompts = None
        if decodes and self.decode_kernel:
            # The kernel reads each context in place at its own length: one set, no groups.
            paged = self._kernel_rows(decodes)
            ordered.extend(decodes)
            decodes = []
        if (continued or fresh) and self.prompts_by_kernel:
            prompts = self._kernel_rows(continued + fresh)
            ordered.extend(continued + fresh)
            continued, fresh = [], []
        for members in [*group_decodes(decodes, block_size), *([seq] for seq in continued)]:
            cached.append(self._context_attention(members, len_before=sum(
                len(s.token_ids) for s in ordered)))
            ordered.extend(members)
        for members in self._streaming_groups([s for s in sequences if s.window is not None]):
            cached.append(self._windowed_attention(members, len_before=sum(
                len(s.token_ids) for s in ordered)))
            ordered.extend(members)
        fresh_spans = []
        for seq in fresh:
            fresh_spans.append((sum(len(s.token_ids) for s in ordered), len(seq.token_ids)))
            ordered.append(seq)

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in ordered:
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.position, seq.end))
            table, dropped = seq.block_table, seq.dropped_blocks
            for pos in range(seq.position, seq.end):
                slots.append(table[table_index(pos, dropped, block_size)] * block_size + pos % block_size)
        device = self.device
        layout = AttentionLayout(positions=torch.tensor(positions, device=device),
                                 slots=torch.tensor(slots, device=device),
                                 cached=cached, fresh=fresh_spans, decodes=paged, prompts=prompts,
                                 max_position=max(positions))
        return ordered, torch.tensor(token_ids, device=device), layout

    @staticmethod
    def _streaming_groups(streaming: list[SequenceWork]) -> list[list[SequenceWork]]:
        """Streaming decodes with the same window attend together; each chunk alone."""
        decodes: dict = {}
        groups = []
        for seq in streaming:
            if len(seq.token_ids) == 1:
                decodes.setdefault(seq.window, []).append(seq)
            else:
                groups.append([seq])
        return [*decodes.values(), *groups]

    def _kernel_rows(self, sequences: list[SequenceWork]) -> PagedDecodes:
        """One kernel row per token: its sequence's block table and the keys up to its own."""
        widest = max(blocks_for(s.end, self.block_size) for s in sequences)
        tables = torch.tensor([(s.block_table + [0] * widest)[:widest] for s in sequences], dtype=torch.int64)
        lengths = [position + 1 for s in sequences for position in range(s.position, s.end)]
        if len(lengths) > len(sequences):      # prompt chunks: each table once per token, in torch
            tables = tables.repeat_interleave(torch.tensor([len(s.token_ids) for s in sequences]), dim=0)
        return PagedDecodes(num_seqs=len(lengths), block_tables=tables,
                            context_lens=torch.tensor(lengths, dtype=torch.int64))

    def _windowed_attention(self, members: list[SequenceWork], len_before: int) -> ContextAttention:
        """Attention of streaming sequences (one chunk, or decodes sharing a window) over the blocks
        they keep: the mask is the window rule of services/common/stream_window.py, by the text
        position of every gathered slot."""
        block_size, device = self.block_size, self.device
        window = members[0].window
        num_blocks = max(kept_blocks(s.end, s.dropped_blocks, block_size) for s in members)
        block_ids = [b for s in members for b in (s.block_table + [0] * num_blocks)[:num_blocks]]
        slots = torch.arange(num_blocks * block_size, device=device)
        dropped = torch.tensor([[s.dropped_blocks * block_size] for s in members], device=device)
        # Slot i of a row holds text position i in the sink block, i + dropped blocks after it.
        keys = torch.where(slots < block_size, slots, slots + dropped).unsqueeze(1)      # [seqs, 1, K]
        queries = torch.tensor([list(range(s.position, s.end)) for s in members], device=device)
        query_positions = queries.unsqueeze(-1)                                          # [seqs, Q, 1]
        mask = (keys <= query_positions) & (
            (keys < window.sink_tokens) | (keys > query_positions - window.window_tokens))
        return ContextAttention(
            start=len_before, num_queries=sum(len(s.token_ids) for s in members),
            num_seqs=len(members), num_blocks=num_blocks,
            block_ids=torch.tensor(block_ids, device=device), mask=mask.unsqueeze(1),
            sinks=window.sink_tokens,
            sink_positions=queries.flatten().clamp(max=window.cache_tokens - 1))

    def _context_attention(self, members: list[SequenceWork], len_before: int) -> ContextAttention:
        """Attention over cached context for one decode group or one continued prefill chunk."""
        block_size, device = self.block_size, self.device
        num_blocks = max(blocks_for(s.end, block_size) for s in members)
        block_ids = [b for s in members for b in (s.block_table + [0] * num_blocks)[:num_blocks]]
        keys = torch.arange(num_blocks * block_size, device=device)
        # Query at position p sees keys 0..p: causal within a chunk, padding hidden for a group.
        query_positions = torch.tensor([list(range(s.position, s.end)) for s in members], device=device)
        mask = (keys.view(1, 1, -1) <= query_positions.unsqueeze(-1)).unsqueeze(1)
        return ContextAttention(
            start=len_before, num_queries=sum(len(s.token_ids) for s in members),
            num_seqs=len(members), num_blocks=num_blocks,
            block_ids=torch.tensor(block_ids, device=device), mask=mask)
