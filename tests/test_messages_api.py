"""POST /v1/messages through the official `anthropic` client, on a real server over a tiny random Qwen3 run with
`--reasoning-parser qwen3`: answers equal those of chat completions for the same conversation, streams come as
Anthropic's events in order and add up to the whole answer, tool_use blocks make the round trip through
tool_result, stop sequences end the answer with their stop reason, and errors take Anthropic's shape."""

from __future__ import annotations

import base64
import json

import anthropic
import httpx
import jsonschema
import pytest

from slotserve.faults import FaultPoint, fault_spec
from tests.helpers import THINKING
from tests.servers import MODEL, Server, reasoning_server
from tests.test_qwen3_vl_api import PREPROCESSOR, png

ASK = "What is the weather in Paris?"
NO_THINK = {"type": "disabled"}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}}]
# This SDK no longer sends sampling fields of its own; the server takes temperature, top_p and top_k still.
GREEDY = {"temperature": 0}
# A few words, then the end: the answer ends its turn.
WORDS = {**GREEDY, "guided_regex": "[a-z]{3,8}( [a-z]{3,8}){3,5}"}


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    yield from reasoning_server(tiny_qwen3)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_create_answers_as_chat_completions_does(server, client):
    message = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", messages=user(ASK),
                                     thinking=NO_THINK, extra_body=GREEDY)
    chat = server.client().chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and block.text
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                          chat.usage.completion_tokens)
    blocks = client.messages.create(
        model=MODEL, max_tokens=12, extra_body=GREEDY, thinking=NO_THINK,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is the weather "},
                                               {"type": "text", "text": "in Paris?"}]}])
    assert blocks.content[0].text == block.text and blocks.usage.input_tokens == message.usage.input_tokens


def test_stream_events_in_order(server, client):
    kwargs = dict(model=MODEL, max_tokens=40, messages=user(ASK), thinking=NO_THINK)
    whole = client.messages.create(**kwargs, extra_body=WORDS)
    assert whole.stop_reason == "end_turn"
    with client.messages.stream(**kwargs, extra_body=WORDS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens

    events = []
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=60,
                      json={**kwargs, **WORDS, "stream": True}) as response:
        assert response.status_code == 200
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    names = [e["type"] for e in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(e["delta"]["text"] for e in events[2:-3]) == text
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_a_tool_use_round_trip(server, client):
    kwargs = dict(model=MODEL, max_tokens=80, messages=user(ASK), thinking=NO_THINK, tools=TOOLS,
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    first = client.messages.create(**kwargs)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    assert final.stop_reason == "tool_use"

    result = json.dumps({"temperature": 21})
    answer = client.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, thinking=NO_THINK, tools=TOOLS, messages=[
            *user(ASK), {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}])
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    chat = server.client().chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, tools=CHAT_TOOLS,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, messages=[
            {"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": use.id, "content": result}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert "".join(b.text for b in answer.content if b.type == "text") == (chat.choices[0].message.content or "")


def test_stop_sequences(client):
    kwargs = dict(model=MODEL, max_tokens=24, messages=user(ASK), thinking=NO_THINK,
                  extra_body={**GREEDY, "ignore_eos": True})
    full = client.messages.create(**kwargs)
    assert full.stop_reason == "max_tokens"
    text = full.content[0].text
    stop = text[5:9]  # four characters that usually straddle a token boundary
    cut = client.messages.create(**kwargs, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[: text.index(stop)]
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == cut.content[0].text and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_output_config_json_schema(client):
    message = client.messages.create(model=MODEL, max_tokens=80, messages=user(ASK), thinking=NO_THINK, extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), WEATHER)


def test_thinking_blocks(server, client):
    """The answer is forced through the think block's shape, so the split is known and equals chat's."""
    kwargs = dict(model=MODEL, max_tokens=200, messages=user(ASK),
                  extra_body={"temperature": 1.0, "seed": 4, "guided_grammar": THINKING})
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    chat = server.client().chat.completions.create(model=MODEL, messages=user(ASK), max_tokens=200, temperature=1.0,
                                                   extra_body={"seed": 4, "guided_grammar": THINKING})
    expected = chat.choices[0].message
    assert (message.content[0].thinking, message.content[1].text) == (expected.reasoning_content, expected.content)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == \
        [b.model_dump(exclude_none=True) for b in message.content]


@pytest.mark.parametrize("body,status", [
    ({"messages": user("hi")}, 400),  # no max_tokens
    ({"max_tokens": 0, "messages": user("hi")}, 400),
    ({"max_tokens": 8, "messages": []}, 400),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]}, 400),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, 400),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400),
    ({"max_tokens": 8, "messages": user("hi"), "tool_choice": {"type": "any"}}, 400),
    ({"max_tokens": 8, "messages": user("hi"), "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400),
    ({"max_tokens": 8, "messages": user("hi"), "model": "claude-opus"}, 404),
])
def test_bad_input_gets_an_anthropic_error(server, body, status):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, **body} if "model" not in body else body)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert error["error"]["message"]


def test_the_sdk_raises_on_bad_input(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=8, messages=user("hi"), extra_body={"temperature": -1})
    assert info.value.status_code == 400 and info.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in info.value.body["error"]["message"]


def test_the_api_key_as_anthropic_sends_it(tiny_qwen3):
    srv = Server(tiny_qwen3, "--api-key", "s3cret")
    try:
        with pytest.raises(anthropic.AuthenticationError) as info:
            anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=user("hi"))
        assert info.value.body["error"]["type"] == "authentication_error"
        reply = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=user("hi"), extra_body={"ignore_eos": True})
        assert reply.usage.output_tokens == 2 and reply.stop_reason == "max_tokens"
    finally:
        assert srv.stop() == 0


def test_an_engine_failure_mid_stream_is_an_error_event(tiny_qwen3):
    srv = Server(tiny_qwen3, "--engine-death-exit-delay", "2", env=fault_spec(FaultPoint.CORE_STEP, 6))
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as info, client.messages.stream(
                model=MODEL, max_tokens=200, messages=user(ASK), extra_body={"ignore_eos": True}) as stream:
            seen.extend(event.type for event in stream)
        assert seen[0] == "message_start" and "message_stop" not in seen
        error = info.value.body
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error", error
        assert "fails on purpose" in error["error"]["message"] or "engine" in error["error"]["message"]
    finally:
        srv.stop()


def test_an_image_block_reaches_a_vision_model(tmp_path):
    from tests.test_qwen3_vl import build_tiny_vl

    build_tiny_vl(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    data = base64.b64encode(png(5)).decode()
    url = f"data:image/png;base64,{data}"
    chat_messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": "Describe it."}]}]
    blocks = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                        "data": data}},
                                           {"type": "text", "text": "Describe it."}]}]
    srv = Server(tmp_path)
    try:
        message = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=blocks, extra_body={**GREEDY, "ignore_eos": True})
        chat = srv.client().chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=chat_messages,
                                                    extra_body={"ignore_eos": True})
        assert message.usage.input_tokens == chat.usage.prompt_tokens
        assert message.content[0].text == chat.choices[0].message.content
    finally:
        assert srv.stop() == 0
