"""POST /v1/responses through the official `openai` client, on a real server over a tiny random Qwen3 run with
`--reasoning-parser qwen3`: answers equal those of chat completions for the same conversation, streams come as the
Responses events in order and add up to the whole answer, tool calls make the round trip, `text_format` parses,
`previous_response_id` continues a stored conversation, and errors are OpenAI error bodies."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from slotserve.entrypoints.openai.errors import ServerError
from slotserve.entrypoints.openai.responses import MessageItem, ResponseStore
from slotserve.faults import FaultPoint, fault_spec
from tests.helpers import THINKING
from tests.servers import MODEL, Server, reasoning_server
from tests.test_qwen3_vl_api import PREPROCESSOR, data_url, png

ASK = "What is the weather in Paris?"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}}]
# A few words, then the end: the answer finishes (status completed).
WORDS = {**NO_THINK, "guided_regex": "[a-z]{3,8}( [a-z]{3,8}){3,5}"}


class Weather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    yield from reasoning_server(tiny_qwen3)


@pytest.fixture(scope="module")
def client(server):
    return server.client(max_retries=0)


def test_create_answers_as_chat_completions_does(client):
    kwargs = dict(model=MODEL, max_output_tokens=12, temperature=0, extra_body=NO_THINK)
    response = client.responses.create(instructions="Be brief.", input=ASK, **kwargs)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, extra_body=NO_THINK, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The same conversation as message items with content parts, the instructions as a developer message.
    items = client.responses.create(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]}], **kwargs)
    assert items.output_text == response.output_text and items.usage.input_tokens == usage.input_tokens


def test_stream_events_in_order(client):
    kwargs = dict(model=MODEL, input=ASK, temperature=0, max_output_tokens=40, extra_body=WORDS)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    # How many deltas depends on how fast the client reads: a slow reader gets them merged.
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == whole.output_text and whole.status == "completed"
    assert events[-2].item.id == events[2].item.id == final.output[0].id
    assert final.usage.output_tokens == whole.usage.output_tokens

    cut = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=3, stream=True,
                                       extra_body={**NO_THINK, "ignore_eos": True}))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.usage.output_tokens == 3
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_function_call_round_trip(client):
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice=named, max_output_tokens=80,
                                    temperature=0, extra_body=NO_THINK)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    events = list(client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice=named,
                                          max_output_tokens=80, temperature=0, extra_body=NO_THINK, stream=True))
    calls = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [(c.name, c.arguments) for c in calls] == [(call.name, call.arguments)] and deltas == call.arguments

    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 21})}
    kwargs = dict(model=MODEL, tools=TOOLS, max_output_tokens=8, temperature=0, extra_body=NO_THINK)
    chained = client.responses.create(previous_response_id=first.id, input=[result], **kwargs)
    whole = client.responses.create(input=[{"role": "user", "content": ASK},
                                           {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                            "arguments": call.arguments}, result], **kwargs)
    chat = client.chat.completions.create(
        model=MODEL, tools=CHAT_TOOLS, max_tokens=8, temperature=0, extra_body=NO_THINK, messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}])
    assert chained.usage.input_tokens == whole.usage.input_tokens == chat.usage.prompt_tokens
    assert chained.output_text == whole.output_text == (chat.choices[0].message.content or "")


def test_parse_with_a_pydantic_model_and_json_object(client):
    parsed = client.responses.parse(model=MODEL, input=ASK, text_format=Weather, max_output_tokens=80,
                                    temperature=0, extra_body=NO_THINK)
    assert isinstance(parsed.output_parsed, Weather)
    assert parsed.output_parsed == Weather.model_validate_json(parsed.output_text)
    anything = client.responses.create(model=MODEL, input=ASK, text={"format": {"type": "json_object"}},
                                       max_output_tokens=200, temperature=0, extra_body=NO_THINK)
    assert anything.status == "completed" and isinstance(json.loads(anything.output_text), dict)
    assert anything.text.format.type == "json_object"


def test_previous_response_id_continues_the_stored_conversation(server, client):
    kwargs = dict(model=MODEL, max_output_tokens=6, temperature=0, extra_body={**NO_THINK, "ignore_eos": True})
    first = client.responses.create(input="Hello", **kwargs)
    second = client.responses.create(previous_response_id=first.id, input="And then?", **kwargs)
    explicit = client.responses.create(input=[{"role": "user", "content": "Hello"},
                                              {"role": "assistant", "content": first.output_text},
                                              {"role": "user", "content": "And then?"}], **kwargs)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens + 6
    assert second.output_text == explicit.output_text
    third = client.responses.create(previous_response_id=second.id, input="Go on.", **kwargs)
    assert third.usage.input_tokens > second.usage.input_tokens + 6

    unstored = client.responses.create(input="Hello", store=False, **kwargs)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(previous_response_id=unstored.id, input="x", **kwargs)
    raw = httpx.post(f"{server.url}/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert raw.status_code == 404
    error = raw.json()["error"]
    assert error["type"] == "NotFoundError" and error["code"] == 404 and error["param"] == "previous_response_id"


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(capacity=2)
    item = MessageItem(role="user", content="hi")
    store.put("a", [item])
    store.put("b", [item])
    assert store.get("a") == (item,)  # now b is the least recently used
    store.put("c", [item, item])
    with pytest.raises(ServerError) as info:
        store.get("b")
    assert info.value.status == 404
    assert store.get("a") == (item,) and store.get("c") == (item, item)


def test_reasoning_output_items(client):
    """The answer is forced through the think block's shape, so the split is known and equals chat's."""
    kwargs = dict(model=MODEL, input=ASK, max_output_tokens=200, temperature=1.0,
                  extra_body={"seed": 4, "guided_grammar": THINKING})
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0].content[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=200,
                                          temperature=1.0, extra_body={"seed": 4, "guided_grammar": THINKING})
    message = chat.choices[0].message
    assert (reasoning, response.output_text) == (message.reasoning_content, message.content) and reasoning
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (streamed, text) == (reasoning, response.output_text)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"] and [e.output_index for e in events
                                                  if e.type == "response.output_item.done"] == [0, 1]


@pytest.mark.parametrize("body,param", [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, None),
    ({"input": [{"role": "robot", "content": "hi"}]}, None),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, None),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "temperature": -1}, "temperature"),
])
def test_bad_requests_get_an_openai_400(server, body, param):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "BadRequestError" and error["code"] == 400
    if param is not None:
        assert error["param"] == param, error


def test_an_engine_failure_mid_stream_ends_it_with_an_error_event(tiny_qwen3):
    srv = Server(tiny_qwen3, "--engine-death-exit-delay", "2", env=fault_spec(FaultPoint.CORE_STEP, 6))
    try:
        events = list(srv.client(max_retries=0).responses.create(
            model=MODEL, input=ASK, max_output_tokens=200, stream=True, extra_body={**NO_THINK, "ignore_eos": True}))
        assert events[0].type == "response.created" and events[-1].type == "error", [e.type for e in events]
        assert "fails on purpose" in events[-1].message or "engine" in events[-1].message
        assert [e.sequence_number for e in events] == list(range(len(events)))
    finally:
        srv.stop()


def test_an_input_image_reaches_a_vision_model(tmp_path):
    from tests.test_qwen3_vl import build_tiny_vl

    build_tiny_vl(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    url = data_url(png(5))
    srv = Server(tmp_path)
    try:
        client = srv.client(max_retries=0)
        response = client.responses.create(
            model=MODEL, max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True}, input=[
                {"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                             {"type": "input_text", "text": "Describe it."}]}])
        chat = client.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe it."}]}])
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.output_text == chat.choices[0].message.content
    finally:
        assert srv.stop() == 0
