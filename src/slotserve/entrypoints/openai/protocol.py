"""Request bodies of the OpenAI-compatible API (pydantic), their limits, and their translation to SamplingParams."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from slotserve.entrypoints.openai.errors import ServerError, bad_request
from slotserve.entrypoints.openai.limits import RequestLimits
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams

ROLES = ("system", "developer", "user", "assistant", "tool")
# vLLM's fields that the Responses and Messages APIs take too (as the SDKs' extra_body), beside their own.
SAMPLING_EXTENSIONS = frozenset({
    "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
    "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "chat_template_kwargs"})
# OpenAI's own cap on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields both endpoints share, OpenAI's plus vLLM's extensions."""

    # Fields that change nothing in the answer (user, metadata, ...) are accepted and ignored; OpenAI
    # fields this server does not implement are named in a 400 (see `unsupported`).
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    id_slot: int | None = None  # llama.cpp's: the slot (/slots) this request's prompt is kept as
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # OpenAI fields not implemented here, each with the values that mean "not used".
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def unsupported(self) -> None:
        """A 400 naming the first OpenAI field that asks for something this server does not do."""
        reject_unsupported(self, self.unsupported_fields)

    def check_limits(self, limits: RequestLimits, num_prompts: int) -> None:
        if self.n * num_prompts > limits.max_n:
            raise bad_request(f"n: at most {limits.max_n} sequences per request (n times the prompts), got "
                              f"{self.n * num_prompts}", "n")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        for name, values in (("stop", stops), ("stop_token_ids", self.stop_token_ids or [])):
            if len(values) > limits.max_stop:
                raise bad_request(f"{name}: at most {limits.max_stop} entries, got {len(values)}", name)
        if self.logit_bias and len(self.logit_bias) > limits.max_logit_bias:
            raise bad_request(f"logit_bias: at most {limits.max_logit_bias} entries, got {len(self.logit_bias)}",
                              "logit_bias")

    def structured(self) -> StructuredOutputsParams | None:
        """The one constraint the request gives, in any of its forms; ValueError naming the field otherwise."""
        given: dict[str, StructuredOutputsParams] = {}
        kinds = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
        for name, kind in kinds.items():
            if getattr(self, name) is not None:
                given[name] = StructuredOutputsParams(**{kind: getattr(self, name)})
        if self.structured_outputs is not None:
            fields = set(StructuredOutputsParams.__dataclass_fields__)
            unknown = set(self.structured_outputs) - fields
            if unknown:
                raise ValueError(f"structured_outputs: unknown fields {sorted(unknown)}; the fields are "
                                 f"{', '.join(sorted(fields))}")
            given["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
        form = self.response_format
        if form is not None and form.get("type") != "text":
            given["response_format"] = _response_format(form)
        if len(given) > 1:
            raise ValueError(f"{', '.join(given)}: give one constraint, not several")
        return next(iter(given.values()), None)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """ValueError (naming the field) for values out of range."""
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias: keys must be token ids") from None
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured(),
        )


def reject_unsupported(body: BaseModel, fields: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first of `fields` (each with the values that mean "not used") that `body` uses."""
    values = {**(body.model_extra or {}), **{k: getattr(body, k) for k in type(body).model_fields}}
    for name, unused in fields.items():
        if name in values and values[name] not in unused:
            raise bad_request(f"{name}: not supported by this server", name)


def sampling_extensions(body: BaseModel) -> dict[str, Any]:
    """The vLLM sampling fields a body of another API (Responses, Messages) carries beside its own, to be passed
    on to the chat request it becomes."""
    return {k: v for k, v in (body.model_extra or {}).items() if k in SAMPLING_EXTENSIONS}


def _response_format(form: dict[str, Any]) -> StructuredOutputsParams:
    kind = form.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = form.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema: must be an object with a 'schema' object")
        return StructuredOutputsParams(json=spec.get("schema", {}))
    raise ValueError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)

    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "audio": (None,), "modalities": (None, ["text"]),
        "prediction": (None,), "functions": (None,), "function_call": (None, "none"),
        "web_search_options": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    }

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not messages:
            raise ValueError("must not be empty")
        for i, message in enumerate(messages):
            if message.get("role") not in ROLES:
                raise ValueError(f"[{i}].role must be one of {', '.join(ROLES)}, got {message.get('role')!r}")
        return messages



class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(x, int) for x in self.input):
            return [self.input]
        return list(self.input)

    def check_limits(self, limits: RequestLimits, num_prompts: int) -> None:
        if num_prompts > MAX_EMBEDDING_INPUTS:
            raise bad_request(f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, got {num_prompts}", "input")


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", bound=BaseModel)


def parse_body(data: bytes, model: type[Body]) -> Body:
    """The request body as `model`, or a 400 that says what is wrong with it."""
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    bad = _invalid_text(value)
    if bad is not None:
        raise bad_request(f"{bad}: not valid Unicode (a lone surrogate)", bad)
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise bad_request(f"{where}: {message}" if where else message, where or None) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


def _invalid_text(value: Any, where: str = "") -> str | None:
    """The path of the first string (or key) holding a lone surrogate, which JSON allows and UTF-8 does not."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, path or "body"))
                stack.append((child, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def require_model(body: BaseModel, served: str) -> None:
    model = getattr(body, "model", None)
    if model is not None and model != served:
        raise ServerError(404, "NotFoundError", f"model {model!r} does not exist; this server serves {served!r}",
                          "model")
