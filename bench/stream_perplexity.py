#!/usr/bin/env python
"""Perplexity of streaming mode (StreamingLLM attention sinks) against ordinary attention and a
plain window without sinks, on a long text, with our engine's own logits: the measurement of Xiao
et al. (ICLR 2024, figure 3), on the default model (SmolLM2-135M-Instruct) unless --model.

The text is the Book of Genesis, King James Version, from Debian's bible-kjv package (the `bible`
command; nothing is downloaded), verse references stripped. Its first N + 1 tokens are used
(N = 4 x the model's context, 32,768 for SmolLM2, or --tokens); each run computes the negative
log-likelihood of every next token on one sequence, prefilled in chunks:

  dense        ordinary attention over the first `context` tokens only (a dense sequence cannot
               go past the model's context), in chunks of 512.
  sinks        streaming mode: --sinks attention sinks and the --window most recent tokens, over
               all N tokens, in chunks of --chunk.
  window_only  the same window with no sinks (sink_tokens = 0).
  dense_shifted  ordinary attention again, over the `context` tokens from text position
               context / 2: a dense baseline for positions past the context (context ..
               1.5 x context, where each prediction has at least context / 2 tokens before it),
               to tell how hard the text is there from what streaming mode loses.

Each run has an engine of its own whose KV cache is just big enough for it, so a streaming run
that held more blocks than its window needs would fail rather than pass unnoticed.

    python bench/stream_perplexity.py [--json PATH] [--plot PNG] [--threads 2] [--tokens N]
                                      [--sinks 4] [--window 2048] [--chunk 256] [--model DIR]

JSON: model, text, tokens (N), context, sink_tokens, window_tokens, chunk, threads; each key names
the positions it is over: ppl_dense_within_context, ppl_sinks_within_context and
ppl_window_only_within_context over the dense run's (the first `context`, like for like);
ppl_sinks_all_tokens and ppl_window_only_all_tokens over all N (dense cannot run there);
ppl_dense_past_context (the dense_shifted run), ppl_sinks_past_context and
ppl_window_only_past_context over the same positions past the context; curves: perplexity of
consecutive buckets of 512 predictions (position: each bucket's first query position; dense only
up to its end; dense_shifted from position dense_shifted_start); seconds: compute wall time of
each run (engine loading excluded).

Other scripts call measure(model_dir, tokens, sinks, window, chunk, threads, progress), which
returns that dict without writing anything.
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.harness import make_parser, write_json  # noqa: E402
from services.common.step import SequenceWork, StepBatch  # noqa: E402
from services.common.stream_window import (DEFAULT_SINK_TOKENS, DEFAULT_WINDOW_TOKENS,  # noqa: E402
                                           StreamWindow, kept_blocks)
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402
from services.engine.kv_cache import DEFAULT_BLOCK_SIZE, bytes_per_block  # noqa: E402

TEXT_LABEL = "KJV Genesis (Debian bible-kjv)"
PASSAGE = "Genesis 1:1-50:26"
CONTEXT_MULTIPLE = 4        # default N: this many times the model's context, as in the paper's figure
DENSE_CHUNK = 512
STREAM_CHUNK = 256
BUCKET = 512                # predictions per point of the curves
PROGRESS_EVERY = 4096       # tokens between progress lines
Y_TICKS = (1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, 150, 200, 300, 500, 1000, 2000, 5000, 10000)
# The engine's dtype on CPU (fp32); the KV budget is computed in it.
KV_DTYPE = torch.float32

Say = Callable[[str], None]


# --- the text ----------------------------------------------------------------------------------

def kjv_text(passage: str = PASSAGE) -> str:
    """The passage as prose: `bible -f` prints one verse a line, "Ge1:1 In the beginning ...";
    the reference goes, verses of a chapter join into one paragraph, chapters are separated by a
    blank line (so the model reads a book, not a numbered list)."""
    if shutil.which("bible") is None:
        sys.exit("this benchmark needs the `bible` command: apt-get install bible-kjv")
    out = subprocess.run(["bible", "-f", passage], capture_output=True, text=True, check=True).stdout
    chapters: list[list[str]] = []
    last_chapter = None
    for line in out.splitlines():
        match = re.match(r"^(\w+?)(\d+):(\d+) (.*)$", line.strip())
        if not match:
            continue
        chapter = (match.group(1), match.group(2))
        if chapter != last_chapter:
            chapters.append([])
            last_chapter = chapter
        chapters[-1].append(match.group(4).strip())
    if not chapters:
        sys.exit(f"`bible -f {passage!r}` printed no verses")
    return "\n\n".join(" ".join(verses) for verses in chapters)


def text_tokens(model_dir: str, count: int) -> list[int]:
    """The first `count` + 1 tokens of the text (the last one is only a target); no BOS, since the
    SmolLM2 tokenizer adds none and the paper feeds raw text."""
    ids = TextTokenizer.from_model_dir(model_dir).encode(kjv_text(), add_special_tokens=True)
    if len(ids) < count + 1:
        sys.exit(f"the text has {len(ids)} tokens; {count + 1} are needed (lower --tokens)")
    return ids[:count + 1]


# --- running the engine ------------------------------------------------------------------------

def make_engine(model_dir: str, num_blocks: int, threads: int) -> Engine:
    """An engine whose KV cache holds exactly `num_blocks` blocks."""
    per_block = bytes_per_block(load_model_config(model_dir), DEFAULT_BLOCK_SIZE, KV_DTYPE)
    return Engine(EngineConfig(model_dir=model_dir, block_size=DEFAULT_BLOCK_SIZE,
                               kv_cache_bytes=num_blocks * per_block, num_threads=threads))


def token_nll(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """-log p(target) for each row of `logits` [n, vocab], in float64 (sums over 32k tokens)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1)


def reporter(say: Say, name: str, total: int) -> Callable[[int], None]:
    """Says "name: done/total tokens" each time another PROGRESS_EVERY tokens are done, and at the end."""
    started, next_at = time.perf_counter(), PROGRESS_EVERY

    def report(done: int) -> None:
        nonlocal next_at
        if done >= next_at or done == total:
            next_at = (done // PROGRESS_EVERY + 1) * PROGRESS_EVERY
            say(f"{name}: {done}/{total} tokens ({time.perf_counter() - started:.0f} s)")
    return report


def dense_nll(model_dir: str, ids: list[int], count: int, threads: int, say: Say) -> tuple[torch.Tensor, float]:
    """NLL of ids[1..count] with ordinary attention over ids[0..count-1] (count <= context), and
    the compute seconds."""
    engine = make_engine(model_dir, count // DEFAULT_BLOCK_SIZE + 1, threads)
    table = list(range(engine.kv_spec.num_blocks))    # one sequence: every block, in order
    report, out = reporter(say, "dense", count), []
    started = time.perf_counter()
    for start in range(0, count, DENSE_CHUNK):
        end = min(start + DENSE_CHUNK, count)
        work = SequenceWork(1, ids[start:end], start, table, sample=False)
        out.append(token_nll(engine.compute_logits(StepBatch([work]))[1], ids[start + 1:end + 1]))
        report(end)
    return torch.cat(out), time.perf_counter() - started


class StreamBlocks:
    """One streaming sequence's block table as the scheduler keeps it: blocks taken from the free
    list for the next chunk, and those no later query reads dropped from the front after it
    (as tests/engine/test_streaming.py's StreamingSequence)."""

    def __init__(self, window: StreamWindow, num_blocks: int):
        self.window = window
        self.free = list(range(num_blocks - 1, -1, -1))
        self.table: list[int] = []
        self.dropped = 0

    def work(self, ids: list[int], start: int, end: int) -> SequenceWork:
        while len(self.table) < kept_blocks(end, self.dropped, DEFAULT_BLOCK_SIZE):
            # An empty free list here means max_blocks() undercounts: let it fail loudly.
            self.table.append(self.free.pop())
        return SequenceWork(1, ids[start:end], start, list(self.table), sample=False,
                            window=self.window, dropped_blocks=self.dropped)

    def advance(self, computed: int) -> None:
        drop = self.window.droppable(computed, self.dropped, DEFAULT_BLOCK_SIZE)
        self.free.extend(self.table[1:1 + drop])
        del self.table[1:1 + drop]
        self.dropped += drop


def streaming_nll(model_dir: str, ids: list[int], count: int, window: StreamWindow, chunk: int,
                  threads: int, name: str, say: Say) -> tuple[torch.Tensor, float]:
    """NLL of ids[1..count] in streaming mode over ids[0..count-1], and the compute seconds."""
    num_blocks = window.max_blocks(chunk, DEFAULT_BLOCK_SIZE)
    engine = make_engine(model_dir, num_blocks, threads)
    blocks = StreamBlocks(window, engine.kv_spec.num_blocks)
    report, out = reporter(say, name, count), []
    started = time.perf_counter()
    for start in range(0, count, chunk):
        end = min(start + chunk, count)
        logits = engine.compute_logits(StepBatch([blocks.work(ids, start, end)]))[1]
        out.append(token_nll(logits, ids[start + 1:end + 1]))
        blocks.advance(end)
        report(end)
    return torch.cat(out), time.perf_counter() - started


# --- figures -----------------------------------------------------------------------------------

def perplexity(nll: torch.Tensor) -> float:
    return math.exp(nll.mean().item())


def curve(nll: torch.Tensor, bucket: int = BUCKET) -> list[float]:
    """Perplexity of each run of `bucket` consecutive predictions (a shorter last one included)."""
    return [perplexity(nll[i:i + bucket]) for i in range(0, len(nll), bucket)]


def windows(sinks: int, window: int, context: int) -> tuple[StreamWindow, StreamWindow]:
    """The sinks run's window and the window-only one; ValueError where the model or the block
    size cannot serve them (checked before any engine loads, rather than at its first step)."""
    pair = StreamWindow(sinks, window), StreamWindow(0, window)
    for w in pair:
        w.check(context, DEFAULT_BLOCK_SIZE)
    return pair


def measure(model_dir: str | None = None, tokens: int | None = None,
            sinks: int = DEFAULT_SINK_TOKENS, window: int = DEFAULT_WINDOW_TOKENS,
            chunk: int = STREAM_CHUNK, threads: int = 2, progress: bool = True) -> dict:
    """The three runs over the first `tokens` tokens of the text (None: 4 x the model's context);
    returns the JSON dict of the module docstring. `progress`: lines on stderr."""
    model_dir = str(model_dir or default_model_dir())
    context = load_model_config(model_dir).max_context
    count = tokens or CONTEXT_MULTIPLE * context
    with_sinks, without = windows(sinks, window, context)
    say: Say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    ids = text_tokens(model_dir, count)
    dense_count = min(count, context)
    say(f"{Path(model_dir).name}: {count} tokens of {TEXT_LABEL}, context {context}, "
        f"window {window}, sinks {sinks}, chunk {chunk}, {threads} threads")

    nll, seconds = {}, {}
    nll["dense"], seconds["dense"] = dense_nll(model_dir, ids, dense_count, threads, say)
    for name, w in (("sinks", with_sinks), ("window_only", without)):
        nll[name], seconds[name] = streaming_nll(model_dir, ids, count, w, chunk, threads, name, say)
    shift = context // 2
    past = {}
    if count >= shift + context:
        # nll["dense_shifted"][i] predicts text position shift + i + 1, as nll["sinks"][shift + i].
        nll["dense_shifted"], seconds["dense_shifted"] = dense_nll(model_dir, ids[shift:], context, threads, say)
        past = {"ppl_dense_past_context": perplexity(nll["dense_shifted"][context - shift:]),
                "ppl_sinks_past_context": perplexity(nll["sinks"][context:shift + context]),
                "ppl_window_only_past_context": perplexity(nll["window_only"][context:shift + context])}

    return {
        "model": Path(model_dir).name, "text": TEXT_LABEL, "tokens": count, "context": context,
        "sink_tokens": sinks, "window_tokens": window, "chunk": chunk, "threads": threads,
        "ppl_dense_within_context": perplexity(nll["dense"]),
        "ppl_sinks_all_tokens": perplexity(nll["sinks"]),
        "ppl_window_only_all_tokens": perplexity(nll["window_only"]),
        "ppl_sinks_within_context": perplexity(nll["sinks"][:dense_count]),
        "ppl_window_only_within_context": perplexity(nll["window_only"][:dense_count]),
        **past,
        "curves": {"bucket": BUCKET, "position": list(range(0, count, BUCKET)), "dense_shifted_start": shift,
                   **{name: curve(values) for name, values in nll.items()}},
        "seconds": seconds,
    }


def plot(path: Path, result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    curves = result["curves"]
    # Each point at the middle of its bucket.
    x = [p + curves["bucket"] / 2 for p in curves["position"]]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    window = result["window_tokens"]
    styles = (("dense", "#555555",
               f"dense (ordinary attention, up to the context): {result['ppl_dense_within_context']:.2f}"),
              ("sinks", "#1f618d",
               f"{result['sink_tokens']} sinks + window {window}: {result['ppl_sinks_all_tokens']:.2f}"),
              ("window_only", "#c0392b", f"window {window}, no sinks: {result['ppl_window_only_all_tokens']:.2f}"))
    if "dense_shifted" in curves:
        shift, ys = curves["dense_shifted_start"], curves["dense_shifted"]
        ax.plot([shift + curves["bucket"] / 2 + i * curves["bucket"] for i in range(len(ys))], ys, color="#888888",
                lw=1.2, ls=":", marker="s", ms=2.5, zorder=3,
                label=f"dense again from {shift} (a baseline past the context): "
                      f"{result['ppl_dense_past_context']:.2f} vs sinks {result['ppl_sinks_past_context']:.2f} "
                      f"on {result['context']}..{shift + result['context']}")
    for name, color, label in styles:
        ys = curves[name]
        # Within the context the sinks run all but covers dense: draw dense on top, dashed.
        dense = name == "dense"
        ax.plot(x[:len(ys)], ys, color=color, lw=1.4 if dense else 1.8, ls="--" if dense else "-",
                marker="o", ms=2.5 if dense else 3, zorder=3 if dense else 2, label=label)
    if result["context"] < result["tokens"]:     # a shorter --tokens run never reaches it
        ax.axvline(result["context"], color="black", ls="--", lw=1)
        ax.text(result["context"], 0.98, f"  model context ({result['context']})",
                transform=ax.get_xaxis_transform(), va="top", fontsize=9)
    ax.set_yscale("log")
    # Plain numbers on the log axis (3, 5, 10, 20), not 5x10^0, and few enough not to crowd.
    values = [v for name, _, _ in styles for v in curves[name]] + curves.get("dense_shifted", [])
    ax.set_yticks([v for v in Y_TICKS if min(values) / 1.2 <= v <= max(values) * 1.2])
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(0, result["tokens"])
    ax.set_xlabel("token position")
    ax.set_ylabel(f"perplexity (buckets of {curves['bucket']} tokens, log scale)")
    ax.set_title(f"{result['model']} on {result['text']}, {result['tokens']} tokens:\n"
                 f"window {result['window_tokens']}, sinks {result['sink_tokens']} vs none, "
                 f"chunks of {result['chunk']}")
    ax.grid(alpha=0.3, which="both")
    # Lower right: below the streaming curves past the context, clear of the context's label.
    ax.legend(title="run: perplexity over its tokens", fontsize=9, title_fontsize=9, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_report(result: dict) -> None:
    print(f"{result['model']}, {result['tokens']} tokens of {result['text']}, context {result['context']}")
    print(f"{'run':<13}{'ppl (its tokens)':>18}{'ppl (dense tokens)':>20}{'seconds':>10}")
    own = {"dense": "ppl_dense_within_context", "sinks": "ppl_sinks_all_tokens",
           "window_only": "ppl_window_only_all_tokens"}
    for name in ("dense", "sinks", "window_only"):
        print(f"{name:<13}{result[own[name]]:>18.3f}{result[f'ppl_{name}_within_context']:>20.3f}"
              f"{result['seconds'][name]:>10.1f}")
    if "ppl_dense_past_context" in result:
        print(f"past the context, the same positions: dense from {result['curves']['dense_shifted_start']} "
              f"{result['ppl_dense_past_context']:.3f}, sinks {result['ppl_sinks_past_context']:.3f}, "
              f"window only {result['ppl_window_only_past_context']:.3f}")


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, help="tokens of text (default: 4 x the model's context)")
    parser.add_argument("--sinks", type=int, default=DEFAULT_SINK_TOKENS, help="attention sinks of the sinks run")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW_TOKENS, help="recent tokens attended")
    parser.add_argument("--chunk", type=int, default=STREAM_CHUNK, help="prefill chunk of the streaming runs")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="write the perplexity curves here")
    args = parser.parse_args()
    if (args.tokens is not None and args.tokens < 1) or args.chunk < 1 or args.threads < 1:
        parser.error("--tokens, --chunk and --threads must be >= 1")
    model_dir = args.model or str(default_model_dir())
    try:
        windows(args.sinks, args.window, load_model_config(model_dir).max_context)
    except ValueError as exc:
        parser.error(str(exc))
    result = measure(model_dir, args.tokens, args.sinks, args.window, args.chunk, args.threads)
    print_report(result)
    write_json(args.json, result)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(args.plot, result)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
