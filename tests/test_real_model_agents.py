"""Structured outputs and tool calls on the bundled model (Qwen2.5-Coder-0.5B-Instruct) through the official
openai client: a pydantic model parsed for 20 prompts of 20, one without bounds of its own 10 times of 10, JSON
objects that parse, regexes and choices that match, and a tool round trip, streamed and not."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from slotserve.model_store import DEFAULT_MODEL
from tests.servers import MODEL, Server

pytestmark = pytest.mark.real_model

TOPICS = ["Paris", "a red bicycle", "the Python language", "a cup of coffee", "Mount Everest", "a laptop",
          "the Moon", "a violin", "an oak tree", "the Nile", "a chess game", "a lighthouse", "a pizza",
          "the ocean", "a train", "a library", "a honeybee", "a volcano", "a guitar", "a snowflake"]


class Thing(BaseModel):
    name: str = Field(max_length=40)
    category: Literal["place", "object", "living", "idea"]
    rating: int = Field(ge=1, le=5)
    tags: list[str] = Field(max_length=3)


class City(BaseModel):  # no bounds of its own: the engine's keep its strings and numbers from running away
    name: str
    country: str
    population_millions: float


WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def client():
    server = Server(DEFAULT_MODEL, "--kv-cache-memory", "256M")
    yield server.client(max_retries=0)
    server.stop()


def test_parse_gives_a_pydantic_object_for_every_prompt(client):
    parsed = 0
    for topic in TOPICS:
        reply = client.chat.completions.parse(
            model=MODEL, response_format=Thing, max_tokens=120, temperature=0.7, seed=1,
            messages=[{"role": "user", "content": f"Describe {topic} as JSON with name, category, rating, tags."}])
        parsed += isinstance(reply.choices[0].message.parsed, Thing)
    assert parsed == len(TOPICS)


def test_parse_of_an_unbounded_schema_ends_every_time(client):
    for seed in range(10):
        reply = client.chat.completions.parse(
            model=MODEL, response_format=City, max_tokens=200, temperature=0.7, seed=seed,
            messages=[{"role": "user", "content": "Describe Tokyo."}])  # unbounded, 3 of 10 ran to 200 tokens
        assert reply.choices[0].finish_reason == "stop" and isinstance(reply.choices[0].message.parsed, City)


def test_json_objects_regexes_and_choices(client):
    for topic in TOPICS[:5]:
        reply = client.chat.completions.create(
            model=MODEL, response_format={"type": "json_object"}, max_tokens=150, temperature=0.7, seed=2,
            messages=[{"role": "user", "content": f"Give facts about {topic} as a JSON object."}])
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
        date = client.chat.completions.create(
            model=MODEL, max_tokens=20, extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
            messages=[{"role": "user", "content": f"A date related to {topic}?"}]).choices[0].message.content
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)
        pick = client.chat.completions.create(
            model=MODEL, max_tokens=10, extra_body={"guided_choice": ["good", "bad", "neutral"]},
            messages=[{"role": "user", "content": f"Is {topic} good?"}]).choices[0].message.content
        assert pick in ("good", "bad", "neutral")


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, stream):
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kwargs = dict(model=MODEL, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                  temperature=0)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kwargs):
            for piece in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = piece.id or entry["id"]
                entry["name"] += piece.function.name or ""
                entry["arguments"] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        (call,) = calls.values()
        call_id, name, arguments = call["id"], call["name"], call["arguments"]
    else:
        choice = client.chat.completions.create(messages=messages, **kwargs).choices[0]
        finish = choice.finish_reason
        (call,) = choice.message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert finish == "tool_calls" and name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature_c": 21,
                                                                                  "sky": "sunny"})}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60,
                                            temperature=0).choices[0]
    assert answer.finish_reason == "stop" and "21" in answer.message.content
