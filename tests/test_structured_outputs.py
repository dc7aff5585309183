"""Constrained decoding on a tiny random Qwen3 (whose free output is noise, so a valid output is the grammar's
work): JSON schemas, any JSON object, regexes, choices and grammars always match; bad constraints are
ValueErrors naming the field; a request waits for its grammar while others run; a constrained request gives
the same output alone and batched."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from slotserve import LLM, SamplingParams, StructuredOutputsParams
from slotserve.structured_outputs import (
    INTEGER_BOUND,
    NUMBER_BOUND,
    NUMBER_STEP,
    STRING_MAX_LENGTH,
    GrammarCompiler,
    GrammarError,
    bounded,
)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
PROMPTS = ["Hello", "Write a list", "Answer in JSON", "One two three"]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), kv_cache_memory=32 << 20) as llm:
        yield llm


def generate(llm, constraint: StructuredOutputsParams, prompts=PROMPTS, **kwargs) -> list:
    settings = {"max_tokens": 96, "temperature": 0.8, "seed": 3, **kwargs}
    params = SamplingParams(structured_outputs=constraint, **settings)
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schema_outputs_validate(llm):
    for out in generate(llm, StructuredOutputsParams(json=SCHEMA)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_choice_and_grammar_outputs_match(llm):
    for out in generate(llm, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}")):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text), out.text
    choices = ["yes", "no", "it depends"]
    texts = {out.text for out in generate(llm, StructuredOutputsParams(choice=choices), temperature=1.5)}
    assert texts <= set(choices)
    for out in generate(llm, StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ("," [a-c]+)* ")"')):
        assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", out.text) or out.finish_reason == "length", out.text


def test_json_object_is_an_object_when_complete(llm):
    for out in generate(llm, StructuredOutputsParams(json_object=True), max_tokens=200):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # a noisy model may write one long string; what it wrote is still a prefix of an object
            assert out.text.startswith("{")


@pytest.mark.parametrize("constraint,match", [
    (dict(regex="(("), "structured_outputs: regex: .*unclosed group"),
    (dict(json={"type": "objekt"}), "structured_outputs: json: Invalid type: objekt"),
    (dict(json="{not json"), "structured_outputs: "),
    (dict(grammar="root ::= ("), "structured_outputs: "),
])
def test_bad_constraints_are_value_errors_and_queue_nothing(llm, constraint, match):
    with pytest.raises(ValueError, match=match):
        generate(llm, StructuredOutputsParams(**constraint))
    assert not llm.engine.has_unfinished_requests()


def test_a_constraint_takes_exactly_one_form():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice: must be a non-empty list"):
        StructuredOutputsParams(choice=[])


def test_constrained_output_is_the_same_alone_and_batched(llm):
    """Seeded sampling under a grammar, as every request's sampling, does not depend on its batch."""
    constraint = StructuredOutputsParams(json=SCHEMA)
    alone = generate(llm, constraint, prompts=PROMPTS[:1])[0].text
    others = [SamplingParams(max_tokens=40, temperature=0.8, seed=9),
              SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(regex="[a-z ]+"), seed=5,
                             temperature=1.0)]
    params = [SamplingParams(max_tokens=96, temperature=0.8, seed=3, structured_outputs=constraint), *others]
    batched = llm.generate(PROMPTS[:1] + PROMPTS[1:3], params, use_tqdm=False)
    assert batched[0].outputs[0].text == alone


def test_open_strings_and_numbers_get_bounds_and_what_the_schema_says_is_kept():
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "code": {"type": "string", "maxLength": 3},
        "id": {"type": "string", "pattern": "a+"},
        "kind": {"type": "string", "enum": ["x", "y"]}, "note": {"type": ["string", "null"], "minLength": 2},
        "count": {"type": "integer", "minimum": 0}, "score": {"type": "number", "maximum": 5, "multipleOf": 0.5},
        "big": {"type": "integer", "minimum": 10**20}, "ratio": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "pick": {"anyOf": [{"$ref": "#/$defs/word"}, {"type": "integer"}]}},
        "$defs": {"word": {"type": "string"}}}
    original = json.dumps(schema)
    out = bounded(schema)
    assert json.dumps(schema) == original  # a copy
    p = out["properties"]
    assert p["name"] == {"type": "string", "maxLength": STRING_MAX_LENGTH}
    assert p["code"]["maxLength"] == 3 and "maxLength" not in p["id"] and "maxLength" not in p["kind"]
    assert p["note"]["maxLength"] == STRING_MAX_LENGTH
    assert p["count"] == {"type": "integer", "minimum": 0, "maximum": INTEGER_BOUND}
    assert p["score"] == {"type": "number", "maximum": 5, "multipleOf": 0.5, "exclusiveMinimum": -NUMBER_BOUND}
    assert p["big"] == {"type": "integer", "minimum": 10**20}  # a bound below its minimum would leave no value
    assert p["ratio"] == {"type": "number", "exclusiveMinimum": -NUMBER_BOUND, "exclusiveMaximum": NUMBER_BOUND,
                          "multipleOf": NUMBER_STEP}
    assert p["tags"]["items"]["maxLength"] == out["$defs"]["word"]["maxLength"] == STRING_MAX_LENGTH
    assert p["pick"]["anyOf"][1]["maximum"] == INTEGER_BOUND


@pytest.fixture(scope="module")
def compiler(tiny_qwen3):
    from slotserve.config import ModelConfig

    compiler = GrammarCompiler(tiny_qwen3 / "tokenizer.json", ModelConfig.from_dir(str(tiny_qwen3)).vocab_size, [0])
    yield compiler
    compiler.shutdown()


def _accepts(compiler, constraint: dict | StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint's grammar (a schema: json) takes `text` whole, token by token, as a model writes."""
    params = constraint if isinstance(constraint, StructuredOutputsParams) else StructuredOutputsParams(json=constraint)
    matcher = compiler.submit(params).result().deep_copy()
    tokens = compiler._tokenizer.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens)


@pytest.mark.parametrize(("value", "takes"), [
    ("48.8566", True), ("-0.1", True), ("0.3", True), ("1234567890123456", True), ("2.0123456789", True),
    ("12345678901234567", False), ("3.14159265358979323846", False), ("1e5", False),
])
def test_a_number_has_at_most_16_integer_digits_and_10_decimals(compiler, value, takes):
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
              "additionalProperties": False}
    assert _accepts(compiler, schema, f'{{"x":{value}}}') is takes


def test_strings_and_integers_end_where_the_schema_leaves_them_open(compiler):
    def obj(value: dict) -> dict:
        return {"type": "object", "properties": {"x": value}, "required": ["x"], "additionalProperties": False}

    assert _accepts(compiler, obj({"type": "string"}), '{"x":"' + "ab" * (STRING_MAX_LENGTH // 2) + '"}')
    assert not _accepts(compiler, obj({"type": "string"}), '{"x":"' + "ab" * STRING_MAX_LENGTH + '"}')
    assert _accepts(compiler, obj({"type": "string", "maxLength": 1000}), '{"x":"' + "ab" * 300 + '"}')
    assert _accepts(compiler, obj({"type": "integer"}), '{"x":-9999999999999999}')
    assert not _accepts(compiler, obj({"type": "integer"}), '{"x":99999999999999999}')


def test_a_json_object_holds_any_values_bounded_alike(compiler):
    any_object = StructuredOutputsParams(json_object=True)
    assert _accepts(compiler, any_object, '{"a":[1,{"b":"x"}],"c":null,"d":true,"e":-2.5}')
    assert not _accepts(compiler, any_object, '{"a":"' + "ab" * STRING_MAX_LENGTH + '"}')


def test_equal_constraints_compile_once(llm):
    compiler = llm.engine.core.grammars
    a = compiler.submit(StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.submit(StructuredOutputsParams(json={"properties": {"x": {"type": "integer"}}, "type": "object"}))
    assert a is b


def test_a_request_waits_for_its_grammar_while_others_run(tiny_qwen3, monkeypatch):
    """The grammar compiles on its own thread: while it does, the request is not scheduled and the others are."""
    from slotserve.structured_outputs import GrammarCompiler

    gate = threading.Event()
    compile_grammar = GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, params: gate.wait(30) and compile_grammar(self,
                                                                                                           params))
    with LLM(str(tiny_qwen3), kv_cache_memory=16 << 20) as llm:
        engine = llm.engine
        engine.add_request("constrained", "Hi", SamplingParams(max_tokens=4, temperature=0,
                                                               structured_outputs=StructuredOutputsParams(regex="a+")))
        engine.add_request("free", "Hi", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        finished = {}
        while "free" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert "constrained" not in finished and len(engine.scheduler.waiting) == 1
        gate.set()
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert re.fullmatch("a+", finished["constrained"].outputs[0].text)
        engine.kv.pool.check_whole()


def test_a_grammar_that_fails_in_the_core_ends_its_request_alone(tiny_qwen3, monkeypatch):
    from slotserve.structured_outputs import GrammarCompiler

    def fail(self, params):
        raise GrammarError("structured_outputs: regex: too large for this tokenizer")

    monkeypatch.setattr(GrammarCompiler, "_compile", fail)
    with LLM(str(tiny_qwen3), kv_cache_memory=16 << 20) as llm:
        outs = llm.generate(["Hi", "Hi"], [SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(
            regex="a+")), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)], use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "abort" and len(outs[1].outputs[0].token_ids) == 3
        llm.engine.kv.pool.check_whole()


@pytest.mark.slow
def test_bench_structured_prints_its_figures(tiny_qwen3):
    import subprocess
    import sys

    from tests.helpers import assert_figures

    out = subprocess.run([sys.executable, "-m", "slotserve.entrypoints.cli", "--log-level", "WARNING", "bench",
                          "structured", "-m", str(tiny_qwen3), "--kv-cache-memory", "16M", "--batch", "4",
                          "--steps", "2", "--schemas", "1", "--repeats", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert_figures(figures, "decode_step_ms.0_constrained", "decode_step_ms.1_constrained",
                   "decode_step_ms.4_constrained", "mask_ms_per_step.batch_1", "mask_ms_per_step.batch_4",
                   "schema_compile_ms.first_ms", "schema_compile_ms.median_ms")


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    from tests.servers import Server

    s = Server(tiny_qwen3)
    yield s
    s.stop()


def test_the_openai_client_parses_a_pydantic_model(server):
    """`client.chat.completions.parse` sends the model's JSON schema (strict) as response_format."""
    from typing import Literal

    from pydantic import BaseModel, Field

    from tests.servers import MODEL

    class City(BaseModel):
        name: str = Field(max_length=10)
        country: Literal["France", "Italy", "Spain"]
        population_millions: int = Field(ge=0, le=50)

    client = server.client(max_retries=0)
    for seed in range(3):
        reply = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A city?"}],
                                              response_format=City, max_tokens=80, seed=seed, temperature=1.0)
        assert isinstance(reply.choices[0].message.parsed, City)
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0,
                                    extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", out.choices[0].text)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON?"}],
                                         max_tokens=200, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
