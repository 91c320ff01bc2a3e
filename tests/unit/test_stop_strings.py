"""Stop strings: the output ends exactly before the first one that completes, whatever the token
boundaries (SmolLM2's real tokenizer); the last chunk names the one that matched."""
from __future__ import annotations

from hypothesis import example, given, settings, strategies as st

from services.common.priority import MEDIUM
from services.common.proto.qos.v1 import common_pb2
from services.common.step import FinishReason, SamplingParams
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.output import merge, token_chunk
from services.scheduler.request import Phase, Request
from tests.unit.detok_helpers import FFFD, encode, load_text_tokenizer, stream


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


def test_the_stop_string_is_kept_when_asked_and_nothing_after_it(tok):
    # vLLM's include_stop_str_in_output: the output ends with the stop string, not before it.
    text = "Sure, here it is.\n\nUser: and now something else"
    for stop in ("\n\nUser:", "here"):
        deltas, tail, detok = stream(tok, encode(tok, text), stop=[stop], include_stop=True)
        assert detok.stop_string == stop
        assert "".join(deltas) + tail == text[:text.index(stop) + len(stop)] == detok.text


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


class PieceDecoder:
    """Token i decodes to PIECES[i]: every added token is one delta, so a test picks the splits."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def quadratic_reference(deltas: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    """The stop check as it was before it went linear (a find per stop string, then every end of
    the text tried against every stop string's start): what each delta releases, plus flush()."""
    stops = list(dict.fromkeys(s for s in stops if s))
    hold_max = max((len(s) for s in stops), default=1) - 1
    pending, released = "", []
    for n, delta in enumerate([*deltas, ""]):
        final = n == len(deltas)
        buf = pending + delta
        cut = None
        for s in stops:
            i = buf.find(s)
            if i >= 0 and (cut is None or (i + len(s), i) < (cut[0] + len(cut[1]), cut[0])):
                cut = (i, s)
        if cut is not None:
            return [*released, buf[:cut[0]]], cut[1]
        if final or not stops:
            released.append(buf)
            pending = ""
            continue
        hold = next((k for k in range(min(len(buf), hold_max), 0, -1)
                     if any(s.startswith(buf[-k:]) for s in stops)), 0)
        released.append(buf[:len(buf) - hold])
        pending = buf[len(buf) - hold:]
    return released, None


SMALL_PIECES = ["a", "b", "ab", "ba", "aab", "abab", "c", "aaaa"]


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.integers(0, len(SMALL_PIECES) - 1), max_size=40),
       stops=st.lists(st.text("abc", min_size=0, max_size=7), max_size=4))
@example(pieces=[5, 5, 0], stops=["ababa", "ba"])
@example(pieces=[7, 7], stops=["aaaaab", "aaa"])
def test_stop_check_releases_exactly_what_the_quadratic_one_did(pieces, stops):
    # Few letters, so stop strings overlap themselves and each other (where matchers go wrong).
    detok = IncrementalDetokenizer(PieceDecoder(SMALL_PIECES), (), stop=stops)
    released = [detok.add(i) for i in pieces]
    if not detok.stopped:
        released.append(detok.flush())
    expected, stop_string = quadratic_reference([SMALL_PIECES[i] for i in pieces], stops)
    assert [r for r in released if r] == [r for r in expected if r]
    assert detok.stop_string == stop_string


class CountingStop(str):
    """A stop string that counts the characters read from it: s[k] reads one, startswith(t)
    reads len(t) (what the slice that made t copied)."""
    reads = 0

    def __getitem__(self, index):
        CountingStop.reads += 1
        return str.__getitem__(self, index)

    def startswith(self, prefix, *args):
        CountingStop.reads += len(prefix)
        return str.startswith(self, prefix, *args)


def test_a_1024_character_stop_string_costs_work_linear_in_the_text():
    # The longest stop string the fronts take, against text that matches all of it but the last
    # character again and again, one character per token: the held text is ~1,000 characters.
    stop = CountingStop("a" * 1023 + "b")
    text = ("a" * 1023 + "c") * 4 + "a" * 1023 + "b" + "after"
    letters = sorted(set(text))
    CountingStop.reads = 0
    detok = IncrementalDetokenizer(PieceDecoder(letters), (), stop=[stop])
    for ch in text:
        detok.add(letters.index(ch))
    assert detok.stopped and detok.text == ("a" * 1023 + "c") * 4
    # Linear: a few reads per character of text and of the stop string (quadratic: ~2.6 million).
    assert CountingStop.reads < 4 * (len(text) + len(stop))


def test_a_stop_string_counts_only_after_min_tokens(tok):
    text = "a\nb\nc\nd"
    ids = encode(tok, text)
    newline = [n for n, i in enumerate(ids, 1) if tok.decode([i]) == "\n"]      # tokens up to each "\n"
    assert len(newline) == 3
    _, _, first = stream(tok, ids, stop=["\n"])
    assert first.text == "a"
    # With min_tokens past the first "\n" (not the second), the second one stops it.
    deltas, tail, held = stream(tok, ids, stop=["\n"], min_tokens=newline[0] + 1)
    assert held.stopped and held.text == "".join(deltas) + tail == "a\nb"
    # The whole text within min_tokens: no stop at all.
    _, _, none = stream(tok, ids, stop=["\n"], min_tokens=len(ids))
    assert not none.stopped and none.text == text


def test_the_last_chunk_names_the_stop_string_merged_or_not(tok):
    """The scheduler's last chunk says which stop string ended the request (vLLM's stop_reason,
    SGLang's matched), also when chunks queued behind a slow stream are merged into one."""
    ids = encode(tok, "one, two. three")
    for stop, expected in ((["."], "."), (["never"], "")):
        request = Request(request_id="r", seq_id=1, priority=MEDIUM, tenant="", prompt_ids=[3, 4],
                          sampling=SamplingParams(max_tokens=100),
                          detokenizer=IncrementalDetokenizer(tok, [3, 4], stop=stop))
        request.phase = Phase.RUNNING
        merged, chunks = common_pb2.GenerateChunk(), []
        for k, token_id in enumerate(ids):
            request.add_output(token_id)
            last = None if k < len(ids) - 1 else FinishReason.LENGTH
            chunks.append(token_chunk(request, token_id, last, "cpu", 0.0))
            if chunks[-1].finish_reason:
                break
        for c in chunks:
            merge(merged, c)
        assert chunks[-1].stop_string == merged.stop_string == expected, stop
        assert all(not c.stop_string for c in chunks[:-1])
