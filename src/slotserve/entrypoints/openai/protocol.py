"""Request bodies of the OpenAI-compatible API (pydantic), and their translation to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slotserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields both endpoints share, OpenAI's plus vLLM's extensions."""

    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, suffix, ...) are accepted and ignored

    model: str | None = None
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
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

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
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


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


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

