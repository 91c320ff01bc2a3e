"""Streaming detokenization: deltas add up to the real text, characters never arrive broken, and
work per token stays bounded (stop strings: test_stop_strings.py).

Uses the default model's real tokenizer (SmolLM2, byte-level BPE), the one users stream from.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models

from tests.unit.detok_helpers import FFFD, byte_token_ids, encode, stream

ROOT = Path(__file__).resolve().parents[2]
IM_END = 2  # <|im_end|>, a special token


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
