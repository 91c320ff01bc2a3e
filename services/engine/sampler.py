"""Token sampling for a batch of sequences with per-sequence parameters.

Before sampling, a row's logits are adjusted as its parameters ask, in vLLM's order and with its
formulas (so a request moved between the two samples alike): every token but its allowed ones
-inf; the logit bias added; the repetition penalty on every token of the prompt or output (a
positive logit divided by it, a negative one multiplied); the frequency penalty times each
token's count in the output and the presence penalty once for each token in it, subtracted;
while a sequence has fewer than min_tokens, its EOS and stop token ids are -inf. Greedy rows
then take the argmax; the others are tempered, lose the tokens less likely than min_p times the
likeliest, then top-k and top-p, then those outside the locally typical set (typical_p). Every
adjustment reads only the row's own logits and tokens, so it holds alone or in any batch, after a
preemption's recompute and after a failover (the resumed tokens are output).

Sampling draws one uniform number a row and takes the token where the row's cumulative
probability passes it (inverse CDF). A seeded sequence draws it from a generator seeded by
(seed, output index), so its tokens depend only on its own logits: the same alone or in any
batch, and after a preemption recompute.
"""
from __future__ import annotations

import array
from collections.abc import Sequence

import torch

from services.common.step import SamplingParams, SequenceWork, TokenLogprobs

_MASK_64 = (1 << 63) - 1
ARGMAX_CHUNK = 128        # columns per chunk of argmax_rows' first pass
CANDIDATES = (128, 1024)  # tokens sorted for top-k / top-p, in turn, before whole rows (_filter_top_k_top_p)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of a [B, V] tensor, the same indices (the first of equal maxima).

    On CPU, torch's argmax over a row is ~10x slower than its max reduction (measured on this
    project's machine: 2.2 ms against 0.25 ms for 20 rows of a 49,152-token vocabulary, a tenth of
    a small model's decode step), so: the max of each 128-column chunk, the argmax of those, then
    the argmax inside the winning chunk, and a look at the last V % 128 columns."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 4 * ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    body = vocab - vocab % ARGMAX_CHUNK
    chunks = logits[:, :body].unflatten(1, (-1, ARGMAX_CHUNK))
    best = chunks.amax(dim=-1).argmax(dim=-1)
    chosen = best * ARGMAX_CHUNK + chunks[torch.arange(rows), best].argmax(dim=-1)
    if body < vocab:
        tail_max, tail_index = logits[:, body:].max(dim=-1)
        # Strictly greater: among equal maxima the earlier column wins, as in argmax.
        later = tail_max > logits.gather(1, chosen.unsqueeze(1)).squeeze(1)
        chosen = torch.where(later, tail_index + body, chosen)
    return chosen


def seed_for_token(seed: int, output_index: int) -> int:
    # A fixed 64-bit mix (not Python's hash) so streams are stable across processes and runs.
    return (seed * 6364136223846793005 + output_index * 1442695040888963407 + 1) & _MASK_64


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf. logits: [B, V], already tempered.
    The nucleus is taken over the top-k's renormalised probabilities.

    Sorting whole rows cost 62 ms for 32 rows of a 49,152-token vocabulary on this project's
    2-core machine (a bf16 decode step of those rows is ~25 ms), and a nucleus is most often a
    few dozen tokens (SmolLM2 on prose at temperature 0.7, top_p 0.95: median 11, 90th
    percentile 180). So each row's likeliest CANDIDATES[0] tokens are sorted first (topk, and
    at least its top-k), the rows whose nucleus did not close inside them CANDIDATES[1], and
    the rest whole. Which of equal logits ranks first at a boundary is the sort's choice."""
    vocab = logits.shape[-1]
    k = [kk if 0 < kk < vocab else vocab for kk in top_k]
    probs = logits.softmax(dim=-1)          # over the whole vocabulary, once for every tier
    keep = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
    rows = list(range(len(k)))
    for tier in (*CANDIDATES, vocab):
        width = min(vocab, max([tier] + [k[r] for r in rows if k[r] < vocab]))
        index = torch.tensor(rows, device=logits.device)
        some = logits[index] if len(rows) < len(k) else logits
        values, order = some.topk(width, dim=-1) if width < vocab else some.sort(dim=-1, descending=True)
        kept, closed = _kept(values, order, [k[r] for r in rows], [top_p[r] for r in rows],
                             probs[index] if len(rows) < len(k) else probs)
        if width == vocab:
            closed[:] = True
        for n in closed.nonzero().squeeze(1).tolist():
            keep[rows[n]] = kept[n]
        rows = [r for r, done in zip(rows, closed.tolist()) if not done]
        if not rows:
            break
    return logits.masked_fill(~keep, float("-inf"))


def _kept(values: torch.Tensor, order: torch.Tensor, k: list[int], top_p: list[float],
          probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over each row's likeliest tokens (`values` descending, their ids `order`: all of them or a
    prefix; `probs` [B, V] the rows' whole-vocabulary probabilities): which tokens stay [B, V],
    and whether the row's top-k / nucleus closed inside them."""
    width, vocab = values.shape[-1], probs.shape[-1]
    ranks = torch.arange(width, device=values.device)
    cut = torch.tensor(k, device=values.device)
    remove = ranks.unsqueeze(0) >= cut.unsqueeze(1)
    # A top-k row's probabilities are its k tokens' renormalised (all inside `values`); another
    # row's are over the whole vocabulary.
    within = values.masked_fill(remove, float("-inf")).softmax(dim=-1)
    ranked = torch.where((cut < vocab).unsqueeze(1), within, probs.gather(1, order))
    p = torch.tensor(top_p, device=values.device, dtype=torch.float32)
    # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
    # top_p 1 drops nothing (the sum before a tail token may round up to 1).
    cumulative = ranked.cumsum(dim=-1)
    remove |= ((cumulative - ranked) >= p.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
    remove[:, 0] = False
    unfiltered = (cut >= vocab) & (p >= 1.0)          # a row sampled beside filtered ones keeps all
    # Closed inside: a top-k row always (width covers every k); a nucleus row where the mass it
    # reached passes top_p.
    closed = torch.where(cut < vocab, cut <= width, cumulative[:, -1] >= p) | unfiltered
    keep = torch.zeros(probs.shape, dtype=torch.bool, device=values.device).scatter_(1, order, ~remove)
    keep[unfiltered] = True
    return keep, closed


def token_index(token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """token_ids (non-empty) as an int64 index tensor on `device`. Through an array: torch.tensor
    of a 4,096-int tuple took 450 us here, the array's buffer 65 us."""
    return torch.frombuffer(array.array("q", token_ids), dtype=torch.int64).to(device)


def keep_only(line: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Every logit of `line` [V] but those of token_ids set to -inf, in place (a duplicate id is
    harmless: it writes its own value back twice)."""
    ids = token_index(token_ids, line.device)
    kept = line[ids]
    line.fill_(float("-inf"))
    line[ids] = kept


def banned_now(words: Sequence[Sequence[int]], history: Sequence[int], output_start: int) -> list[int]:
    """The tokens bad words forbid next (vLLM's rule): a one-token word's token always; a longer
    word's last token when the output so far ends with its other tokens (the prompt does not count)."""
    output = len(history) - output_start
    banned = []
    for word in words:
        before = len(word) - 1
        if before <= output and (before == 0 or list(history[len(history) - before:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def adjust_logits(logits: torch.Tensor, entries: list[SequenceWork], eos_ids: Sequence[int] = ()) -> None:
    """Row i of logits [B, V] adjusted in place for entries[i]'s allowed tokens, bias and
    penalties (the module docstring), and its stop tokens (`eos_ids` unless it ignores EOS) off
    while it has fewer than min_tokens; rows that ask none are left as they are. A token a grammar
    masked off (-inf) stays off.

    The allowed mask comes first, as in vLLM; any order would give the same logits: a bias, a
    penalty or min_tokens leaves -inf as it is, and each changes a token by its own logit alone."""
    vocab = logits.shape[-1]
    for row, entry in enumerate(entries):
        p = entry.sampling
        line = logits[row]
        if p.allowed_token_ids:
            keep_only(line, p.allowed_token_ids)
        if p.bad_words_ids:
            banned = banned_now(p.bad_words_ids, entry.history, entry.output_start)
            if banned:
                line[token_index(banned, line.device)] = float("-inf")
        if p.min_tokens > entry.num_generated:
            ends = [*p.stop_token_ids, *(() if p.ignore_eos else eos_ids)]
            # A row allowed only tokens that end it keeps them on: with them off, no token could come.
            if ends and not (p.allowed_token_ids and set(p.allowed_token_ids) <= set(ends)):
                line[torch.tensor(ends, device=logits.device)] = float("-inf")
        if not p.penalised:
            continue
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            line.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=logits.device,
                                                 dtype=logits.dtype))
        if p.repetition_penalty != 1.0 and entry.history:
            seen = torch.tensor(entry.history, device=logits.device).unique()
            values = line[seen]
            line[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output = entry.history[entry.output_start:]
        if (p.frequency_penalty or p.presence_penalty) and output:
            counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=vocab)[:vocab]
            line -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty * (counts > 0).to(logits.dtype)


def _keep_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """probs [B, V] with each row's tokens below min_p times its likeliest set to 0."""
    floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=probs.device,
                                                            dtype=probs.dtype).unsqueeze(1)
    return probs.masked_fill(probs < floor, 0.0)


def keep_typical(logits: torch.Tensor, mass: list[float]) -> torch.Tensor:
    """logits [B, V] (tempered; -inf where dropped already) with each row's tokens outside its
    locally typical set at -inf (Meister et al. 2022, as transformers' TypicalLogitsWarper and
    TGI's typical_p): tokens ordered by how far their information -log p lies from the row's
    entropy, the fewest of them whose probability makes up `mass` are kept (at least one). A
    row's mass of 1 keeps every token.

    The nearest tokens are found among the CANDIDATES nearest first (a top-k), the whole row
    sorted only when those do not make up the mass: sorting 49,152 tokens cost 4.6 ms a row here,
    a seventh of a decode step that every other row of the batch waits for."""
    logp = logits.log_softmax(dim=-1)
    probs = logp.exp()
    entropy = -(logp * probs).nansum(dim=-1, keepdim=True)          # (-inf x 0 is NaN: left out)
    distance = (-logp - entropy).abs()
    wanted = torch.tensor(mass, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    vocab = logits.shape[-1]
    for k in (*(c for c in CANDIDATES if c < vocab), vocab):
        if k < vocab:
            nearest, order = (-distance).topk(k, dim=-1)
            nearest = -nearest
        else:
            nearest, order = distance.sort(dim=-1)
        # the first position where the probability of the nearest so far reaches the mass
        last = (probs.gather(-1, order).cumsum(dim=-1) < wanted).sum(dim=-1, keepdim=True)
        if k == vocab or bool((last < k).all()):
            break
    threshold = nearest.gather(-1, last.clamp(max=k - 1))
    drop = (distance > threshold) & (wanted < 1.0)     # (a mass of 1: the sum may reach 1 early)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
           generator: torch.Generator) -> list[int]:
    """Pick one token per row of logits [B, V] (float32, adjusted already); returns the token ids."""
    chosen = argmax_rows(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in random_rows],
                             device=logits.device, dtype=logits.dtype)
        tempered = logits[rows] / temps.unsqueeze(1)
        if any(params[i].min_p for i in random_rows):
            kept = _keep_min_p(tempered.softmax(dim=-1), [params[i].min_p for i in random_rows])
            tempered = tempered.masked_fill(kept == 0, float("-inf"))
        if any(params[i].top_k or params[i].top_p < 1.0 for i in random_rows):
            tempered = _filter_top_k_top_p(tempered, [params[i].top_k for i in random_rows],
                                           [params[i].top_p for i in random_rows])
        if any(params[i].typical_p < 1.0 for i in random_rows):
            tempered = keep_typical(tempered, [params[i].typical_p for i in random_rows])
        # The draws live on the CPU in float64; the engine's generator is on its device (CUDA and
        # NPU draw float32 there).
        wide = generator.device.type == "cpu"
        draws = torch.rand(len(random_rows), generator=generator, device=generator.device,
                           dtype=torch.float64 if wide else torch.float32).cpu().double()
        for row, i in enumerate(random_rows):
            if params[i].seed is not None:
                own = torch.Generator()
                own.manual_seed(seed_for_token(params[i].seed, num_generated[i]))
                draws[row] = torch.rand(1, generator=own, dtype=torch.float64)
        chosen[rows] = _inverse_cdf(tempered.softmax(dim=-1), draws)
    return chosen.tolist()


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Row i's token where its cumulative probability first passes draws[i] (uniform in [0, 1),
    float64) of its total: a draw from probs [B, V] with one number a row. (An exponential race
    over every token, before, cost 31 ms of noise for 32 rows of a 49,152-token vocabulary.) A
    token of probability 0 is never picked: the cumulative sum does not pass anything there."""
    cdf = probs.cumsum(dim=-1)
    target = (draws * cdf[:, -1].double().cpu()).float().to(probs.device)     # draws: CPU, float64
    picked = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    over = picked >= probs.shape[-1]        # the draw rounded up to the total: the last possible token
    if over.any():
        rows = over.nonzero().squeeze(1)
        picked[rows] = probs.shape[-1] - 1 - (probs[rows].flip(-1) > 0).to(torch.uint8).argmax(dim=-1)
    return picked


def logprob_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """A copy of the logits of the rows that ask for logprobs (None if none does), taken before
    the allowed mask, bias and penalties: logprobs are the model's (after any grammar mask), as
    vLLM reports them by default. Only asking rows pay: a log-softmax over the vocabulary cost
    1.2 ms of a 16 ms bench-model decode step."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    return logits[torch.tensor(rows, device=logits.device)].float() if rows else None


def _picked_and_top(logits: torch.Tensor, targets: Sequence[int], k: int,
                    ranks: bool = False) -> tuple[list, list, list, list | None]:
    """Row i's log-probability of targets[i], its k likeliest tokens' values and ids (lists), and
    with `ranks` each target's 1-based rank (1 + the tokens likelier than it)."""
    logprobs = logits.float().log_softmax(dim=-1)
    picked = logprobs.gather(1, torch.tensor(targets, device=logits.device).unsqueeze(1)).squeeze(1)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    # (int32: summing the booleans as int64 took twice as long, ~80 ms for 512 rows of 49,152 here)
    rank = ((logprobs > picked.unsqueeze(1)).sum(dim=-1, dtype=torch.int32) + 1).tolist() if ranks else None
    return picked.tolist(), values.tolist(), ids.tolist(), rank


def token_logprobs(asked: torch.Tensor | None, chosen: list[int],
                   params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Each asking row's chosen token's log-probability and its `params.logprobs` most likely
    tokens', from `asked` (logprob_rows: its rows are the asking rows, in order); None for rows
    that did not ask."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if asked is None:
        return out
    picked, top_values, top_ids, _ = _picked_and_top(asked, [chosen[i] for i in rows],
                                                  max(params[i].logprobs for i in rows))
    for n, i in enumerate(rows):
        k = params[i].logprobs
        # Tokens a grammar masked off have no probability: they are no one's "most likely".
        top = tuple((int(t), v) for t, v in zip(top_ids[n][:k], top_values[n][:k]) if v != float("-inf"))
        out[i] = TokenLogprobs(picked[n], top)
    return out


def target_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> tuple[TokenLogprobs, ...]:
    """Row i's logprob of targets[i] and its k most likely tokens' (prompt logprobs: the model's
    own, no grammar or penalty applies to a prompt)."""
    picked, top_values, top_ids, ranks = _picked_and_top(logits, targets, k, ranks=True)
    return tuple(TokenLogprobs(v, tuple(zip(map(int, ids), values)), rank)
                 for v, ids, values, rank in zip(picked, top_ids, top_values, ranks))


@torch.inference_mode()      # the logits are the model's inference tensors; adjust_logits writes them
def sample_step(logits: torch.Tensor, entries: list[SequenceWork], generator: torch.Generator,
                masks=None, eos_ids: Sequence[int] = ()) -> list[tuple[int, TokenLogprobs | None]]:
    """A step's sampling: one (token id, logprobs or None) per entry, row i of logits [B, V].
    `masks` (grammar.StepMasks): the constrained rows' grammar masks, applied first; the sampled
    tokens then advance their grammars."""
    if masks is not None:
        masks.apply(logits)
    params = [s.sampling for s in entries]
    asked = logprob_rows(logits, params)
    adjust_logits(logits, entries, eos_ids)
    ids = sample(logits, params, [s.num_generated for s in entries], generator)
    if masks is not None:
        masks.advance(ids)
    return list(zip(ids, token_logprobs(asked, ids, params)))
