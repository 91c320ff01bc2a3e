"""Streaming detokenization: deltas add up to the real text, characters never arrive broken,
stop strings end the output exactly before them, and work per token stays bounded.

Uses the default model's real tokenizer (SmolLM2, byte-level BPE), the one users stream from.
"""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import example, given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models

from services.common.tokenizer import TextTokenizer
from services.engine.default_model import default_model_dir
from services.scheduler.detokenizer import IncrementalDetokenizer

ROOT = Path(__file__).resolve().parents[2]
IM_END = 2  # <|im_end|>, a special token
FFFD = "\ufffd"


@functools.cache
def load_text_tokenizer() -> TextTokenizer:
    return TextTokenizer.from_model_dir(default_model_dir(progress=False))


@pytest.fixture(scope="module")
def text_tokenizer() -> TextTokenizer:
    return load_text_tokenizer()


@pytest.fixture(scope="module")
def tok(text_tokenizer) -> Tokenizer:
    return text_tokenizer.tokenizer


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream(tok, ids, prompt_ids=(), **kwargs) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed `ids` one at a time; return the deltas, the flush() text and the detokenizer."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush(), detok


def byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte: the worst split a byte-level model can produce (GPT-2 byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    char_of = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    ids = [tok.token_to_id(char_of[b]) for b in data]
    assert None not in ids
    return ids


TEXTS = [
    "Hello, world!",
    "I'd like a 🍰 and a ☕, please 😀👍",
    "日本語のテキストです。中文也可以。",
    "café, naïve, Ærøskøbing, Привет мир",
    "  leading spaces,\ttabs,\n\nblank lines\n   and trailing   ",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # done\n",
    "👨‍👩‍👧‍👦 family 🇯🇵 flag",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_decoded_text(tok, text):
    ids = encode(tok, text)
    deltas, tail, detok = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert detok.text == text
    assert tail == ""  # the text ends on a whole character: nothing left to hold back
    assert FFFD not in "".join(deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_after_a_chat_prompt_are_the_reply_text(tok, text_tokenizer, text):
    prompt = text_tokenizer.encode_chat([{"role": "user", "content": "Say something 🍰"}])
    ids = encode(tok, text)
    deltas, tail, _ = stream(tok, ids, prompt_ids=prompt)
    assert "".join(deltas) + tail == text


def test_emoji_is_held_until_complete_then_streamed_whole(tok):
    ids = encode(tok, "a🍰b")
    assert len(ids) > 3  # the emoji really is split across tokens
    deltas, tail, _ = stream(tok, ids)
    assert not any(FFFD in d for d in deltas)
    assert "🍰" in deltas  # it arrives as one delta, on the token that completes it
    assert "".join(deltas) + tail == "a🍰b"


@pytest.mark.parametrize("text", ["🍰", "x日本語y", "é", "😀👍🇯🇵"])
def test_one_byte_per_token_never_streams_a_broken_character(tok, text):
    ids = byte_token_ids(tok, text.encode())
    deltas, tail, _ = stream(tok, ids)
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) + tail == text


def test_an_incomplete_character_at_the_end_is_flushed_as_is(tok):
    ids = byte_token_ids(tok, "ok🍰".encode()[:-1])
    deltas, tail, detok = stream(tok, ids)
    assert "".join(deltas) == "ok"
    assert tail == tok.decode(ids)[2:] and tail.endswith(FFFD)
    assert detok.text == tok.decode(ids)


def test_a_genuine_replacement_character_is_streamed(tok):
    text = "bad byte: \ufffd then more"
    deltas, tail, _ = stream(tok, encode(tok, text))
    assert "".join(deltas) + tail == text


def test_first_reply_token_keeps_its_leading_space(tok):
    prompt = encode(tok, "The capital of France is")
    reply = encode(tok, " Paris, of course.")
    deltas, tail, _ = stream(tok, reply, prompt_ids=prompt)
    assert deltas[0] == " Paris"
    assert "".join(deltas) + tail == " Paris, of course."


def test_reply_continuing_a_split_word_is_not_given_a_space(tok):
    prompt = encode(tok, "The capital of Fr")
    deltas, _, _ = stream(tok, encode(tok, "ance"), prompt_ids=prompt)
    assert "".join(deltas) == "ance"


def test_sentencepiece_style_leading_space_comes_from_the_prompt_context():
    # Metaspace decoders (Llama, Mistral, T5) drop the space of the first token they decode, so
    # " world" after the prompt "Hello" only survives if the prompt is decoded as context.
    sp = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2, "[UNK]": 3}, unk_token="[UNK]"))
    sp.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    assert sp.decode([1]) == "world"  # the quirk the prompt context is there for
    deltas, tail, _ = stream(sp, [1, 2, 1], prompt_ids=[0])
    assert deltas == [" world", "!", " world"]
    assert tail == ""


def test_special_tokens_are_skipped_by_default(tok):
    ids = encode(tok, "Hi there.") + [IM_END] + encode(tok, " More") + [IM_END]
    deltas, tail, _ = stream(tok, ids)
    assert "".join(deltas) + tail == "Hi there. More"
    deltas, tail, _ = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "Hi there.<|im_end|> More<|im_end|>"


def test_accepts_the_text_tokenizer_wrapper(text_tokenizer):
    ids = text_tokenizer.encode("Wrapped 🍰 tokenizer")
    deltas, tail, _ = stream(text_tokenizer, ids)
    assert "".join(deltas) + tail == "Wrapped 🍰 tokenizer"


# --- stop strings ---------------------------------------------------------------------------

def test_single_token_stop_string(tok):
    ids = encode(tok, "line one\nline two")
    assert tok.decode([ids[2]]) == "\n"
    deltas, tail, detok = stream(tok, ids, stop=["\n"])
    assert detok.stopped and detok.stop_string == "\n"
    assert "".join(deltas) + tail == "line one" == detok.text
    assert tail == ""


def test_stop_string_spanning_several_tokens(tok):
    text = "Sure, here it is.\n\nUser: and now something else"
    ids = encode(tok, text)
    stop = "\n\nUser:"
    assert len(encode(tok, stop)) > 1
    deltas, tail, detok = stream(tok, ids, stop=[stop])
    assert detok.stopped and detok.stop_string == stop
    assert "".join(deltas) + tail == "Sure, here it is."
    assert not any(stop in d or "User" in d for d in deltas)


def test_stopped_as_soon_as_the_stop_string_completes(tok):
    text = "Answer: 42\n\nUser: more"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, (), stop=["\n\nUser:"])
    for n, token_id in enumerate(ids, 1):
        detok.add(token_id)
        if detok.stopped:
            break
    assert tok.decode(ids[:n]).endswith("\n\nUser:")  # not a token later
    assert detok.text == "Answer: 42"
    # Tokens the engine sampled past the stop are ignored.
    assert [detok.add(i) for i in ids[n:]] == [""] * len(ids[n:])
    assert detok.flush() == "" and detok.text == "Answer: 42"


def test_stop_string_inside_a_token(tok):
    text = "The capital of France"
    ids = encode(tok, text)
    assert " capital" in [tok.decode([i]) for i in ids]
    deltas, tail, detok = stream(tok, ids, stop=["apit"])
    assert "".join(deltas) + tail == "The c"
    assert detok.stopped


def test_stop_string_inside_a_multibyte_character_sequence(tok):
    deltas, tail, detok = stream(tok, encode(tok, "Cake: 🍰🍰 yum"), stop=["🍰"])
    assert "".join(deltas) + tail == "Cake: "
    assert detok.stopped


def test_partial_stop_match_that_is_not_a_stop_is_emitted(tok):
    text = "Step one.\n\nUse it wisely."
    deltas, tail, detok = stream(tok, encode(tok, text), stop=["\n\nUser:"])
    assert not detok.stopped and detok.stop_string is None
    # Released as soon as " it" shows it was not the stop string, not only at flush().
    assert "".join(deltas) == text and tail == ""


def test_possible_stop_start_is_held_until_flush(tok):
    deltas, tail, detok = stream(tok, encode(tok, "Done.\n\nUs"), stop=["\n\nUser:"])
    assert "".join(deltas) == "Done."
    assert tail == "\n\nUs"
    assert not detok.stopped and detok.text == "Done.\n\nUs"


def test_first_completed_stop_string_wins(tok):
    text = "alpha beta gamma delta"
    deltas, tail, detok = stream(tok, encode(tok, text), stop=["gamma delta", "beta", "alpha beta g"])
    assert "".join(deltas) + tail == "alpha "
    assert detok.stop_string == "beta"


def test_stop_at_the_very_start_emits_nothing(tok):
    deltas, tail, detok = stream(tok, encode(tok, "User: hi"), stop=["User:"])
    assert deltas == [""] * len(deltas) and tail == "" and detok.stopped


def test_empty_stop_strings_are_ignored(tok):
    deltas, tail, detok = stream(tok, encode(tok, "plain text"), stop=["", "zzz"])
    assert "".join(deltas) + tail == "plain text" and not detok.stopped


PIECES = ["a", "b", " ", "\n", "User", ":", "Use", "r", "é", "🍰", "日本", "END", "E", "ND", "x"]


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=30),
       stops=st.lists(st.sampled_from(["\n\nUser:", "END", "🍰x", "aa", "r:", "b\n"]),
                      max_size=3),
       split_pieces=st.booleans())
@example(pieces=["a", "a"], stops=["aa"], split_pieces=True)
@example(pieces=["b", "\n", "\n", "User", ":"], stops=["\n\nUser:", "b\n"], split_pieces=True)
@example(pieces=["\n", "\n", "Use", "r", ":"], stops=["\n\nUser:"], split_pieces=False)
def test_stop_strings_match_a_simple_reference(pieces, stops, split_pieces):
    # Not a fixture argument: Hypothesis would print the whole tokenizer in a failure report.
    tok = load_text_tokenizer().tokenizer
    text = "".join(pieces)
    # Encoding piece by piece gives token boundaries the whole-text encoding would not.
    ids = [i for p in pieces for i in encode(tok, p)] if split_pieces else encode(tok, text)
    assert tok.decode(ids) == text
    # Reference: the output ends before the stop string occurrence that is completed first.
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[:min(hits)[1]] if hits else text
    deltas, tail, detok = stream(tok, ids, stop=stops)
    assert "".join(deltas) + tail == expected
    assert detok.stopped == bool(hits)
    assert not any(s in "".join(deltas) + tail for s in stops)
    assert FFFD not in "".join(deltas) + tail


# --- bounded work ---------------------------------------------------------------------------

class CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_work_per_token_is_bounded(tok, text_tokenizer):
    paragraph = "Streaming 🍰 text, 日本語 and café.\n    code = [1, 2]\n"
    ids = []
    while len(ids) < 2000:
        ids += encode(tok, paragraph)
    counting = CountingTokenizer(tok)
    prompt = text_tokenizer.encode_chat([{"role": "user", "content": "go " * 500}])
    deltas, tail, _ = stream(counting, ids, prompt_ids=prompt, stop=["\n\nUser:"])
    assert "".join(deltas) + tail == tok.decode(ids)
    assert max(counting.sizes) <= 12  # a small window, not the sequence so far
    assert len(counting.sizes) <= 2 * len(ids) + 2  # at most two decodes per token
    assert sum(counting.sizes) <= 12 * len(ids)


def test_endless_invalid_bytes_do_not_grow_the_window(tok):
    # Token 10003 is "о" plus the lead byte of another character: repeated, the text never ends
    # on a whole character. The output is still the faithful decode, with bounded work.
    ids = [10003] * 1000
    assert tok.decode(ids[:3]).endswith(FFFD)
    counting = CountingTokenizer(tok)
    deltas, tail, _ = stream(counting, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    assert max(counting.sizes) <= 20


def test_detokenizer_does_not_import_torch():
    code = "import sys, services.scheduler.detokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
