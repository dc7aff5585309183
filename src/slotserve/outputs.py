"""What the engine hands back: typed results per request and per sampled sequence."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model wrote; `arguments` is a JSON object as a string, OpenAI's form."""

    id: str
    name: str
    arguments: str


@dataclass
class Logprob:
    """One candidate token at one position: its log-probability, its rank (1 = most likely), its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position's candidates keyed by token id: the chosen token plus the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    tool_calls: list[ToolCall] | None = None  # `LLM.chat` with tools: the calls parsed out of `text`

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    num_saved_tokens: int = 0  # a KV save request: prompt tokens whose blocks it wrote to disk


@dataclass
class EmbeddingOutput:
    """The vector of one embedding request (last-token pooled, normalised as the model asks)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    finished: bool = True
    num_cached_tokens: int = 0
