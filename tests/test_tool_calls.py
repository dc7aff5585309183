"""Tool calls and reasoning through `LLM.chat` and a real server, on a tiny random Qwen3 with the real Qwen3 chat
template: `tool_choice` "required" and a named function always give calls whose arguments validate against the
tool's schema (streamed or not, `finish_reason` "tool_calls"), the history with calls and tool results renders,
and `--reasoning-parser qwen3` splits the think block out exactly, streamed or not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from slotserve import LLM, SamplingParams
from tests.servers import MODEL, Server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_offline_chat_required_and_named_tool_calls(tiny_qwen3):
    with LLM(str(tiny_qwen3), kv_cache_memory=16 << 20) as llm:
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s) for s in range(4)]
        for out in llm.chat([ASK] * 4, params, tools=TOOLS, tool_choice="required", use_tqdm=False):
            calls = out.outputs[0].tool_calls
            assert calls, out.outputs[0].text
            for call in calls:
                check_call(call.name, call.arguments)
        named = {"type": "function", "function": {"name": "get_time"}}
        for out in llm.chat([ASK] * 2, params[:2], tools=TOOLS, tool_choice=named, use_tqdm=False):
            assert [c.name for c in out.outputs[0].tool_calls] == ["get_time"]
        with pytest.raises(ValueError, match="tool_choice: names the function 'nope'"):
            llm.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    s = Server(tiny_qwen3, "--reasoning-parser", "qwen3")
    yield s
    s.stop()


def test_required_tool_calls_streamed_and_not(server):
    """One call each (parallel_tool_calls false): a random model that may call again never stops calling."""
    client = server.client(max_retries=0)
    many = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=120, seed=1, temperature=1.0).choices[0].message
    assert many.tool_calls and all(check_call(c.function.name, c.function.arguments) is None for c in many.tool_calls)
    for seed in range(3):
        once = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                    max_tokens=120, seed=seed, temperature=1.0)
        choice = client.chat.completions.create(**once).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            assert call.id and call.type == "function"
            check_call(call.function.name, call.function.arguments)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**once, stream=True):
            delta = chunk.choices[0].delta
            for piece in delta.tool_calls or []:
                entry = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = piece.id or entry["id"]
                entry["name"] += piece.function.name or ""
                entry["arguments"] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
        assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_a_named_tool_and_the_round_trip(server):
    client = server.client(max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call.function.name, call.function.arguments)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The history as the template rendered it: the call's arguments an object (not a JSON string in a string).
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert f'"arguments": {json.dumps(json.loads(call.function.arguments), ensure_ascii=False)}' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt


@pytest.mark.parametrize("body,match", [
    ({"tools": [{"type": "function", "function": {}}]}, "tools\\[0\\].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice: must be"),
    ({"tool_choice": "required"}, "'required' needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tool_requests_get_a_400(server, body, match):
    with pytest.raises(openai.BadRequestError, match=match):
        server.client(max_retries=0).chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **body)


# The think tags as the tokenizer's own tokens (<think> 151667, </think> 151668), as the model writes them.
THINKING = ('start: <[151667]> "\\n" /[a-z]{2,8}( [a-z]{2,8}){0,3}/ "\\n" <[151668]> "\\n\\n" '
            '/[a-z]{2,8}( [a-z]{2,8}){0,2}/')



def test_the_reasoning_parser_splits_the_think_block(server):
    """The answer is forced through the think block's shape (a regex), so the split is known: the reasoning between
    the tags, the content after them; streamed pieces add up to the same."""
    client = server.client(max_retries=0)
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=1.0, seed=4,
                  extra_body={"guided_grammar": THINKING})
    message = client.chat.completions.create(**kwargs).choices[0].message
    raw = client.completions.create(model=MODEL, prompt=rendered_prompt(), max_tokens=200, temperature=1.0,
                                    seed=4, extra_body={"guided_grammar": THINKING}).choices[0].text
    inside, after = raw.removeprefix("<think>").split("</think>")
    assert message.reasoning_content == inside and message.content == after.lstrip("\n")
    reasoning = content = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    off = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}, "guided_regex": "[a-z]{2,8}"}).choices[0].message
    assert getattr(off, "reasoning_content", None) is None and off.content


def rendered_prompt() -> str:
    """The chat prompt as the server renders it (the same template, with thinking on)."""
    from slotserve.tokenizer import Tokenizer
    from tests.conftest import QWEN_TOKENIZER_DIR

    return Tokenizer.from_dir(QWEN_TOKENIZER_DIR).apply_chat_template(ASK, add_generation_prompt=True)
