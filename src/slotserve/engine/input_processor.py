"""Front-end request handling: tokenize, validate against the model's limits, fan n out into sequences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from slotserve import structured_outputs
from slotserve.engine.protocol import EngineCoreRequest, KVSave, ProcessedRequest
from slotserve.multimodal.image_input import ImageInput
from slotserve.multimodal.prompts import ImageLike, ImagePrompting
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams
from slotserve.tokenizer import Tokenizer


class TaskMismatchError(ValueError):
    """A generation request to an embedding engine, or the other way round."""


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, task: str = "generate",
                 hidden_size: int | None = None, image_prompting: ImagePrompting | None = None) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.task, self.hidden_size = task, hidden_size
        self.image_prompting = image_prompting  # None: a text model

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                images: Sequence[ImageLike] = (), kv_save: KVSave | None = None) -> ProcessedRequest:
        """Bad input raises ValueError naming the field and the problem. `kv_save`: a save of the prompt's KV."""
        pooling = isinstance(params, PoolingParams)
        if pooling and self.task != "embed":
            raise TaskMismatchError("this model is served for generation; start it with --task embed "
                                    "to compute embeddings")
        if not pooling and self.task == "embed":
            raise TaskMismatchError("this model is served for embeddings (task embed); it does not generate text")
        if isinstance(prompt, str):
            # A cheap bound before the costly step: no token stands for more characters than the longest.
            limit = self.max_model_len * self.tokenizer.max_token_chars
            if len(prompt) > limit:
                raise ValueError(f"prompt: {len(prompt)} characters cannot fit the context of {self.max_model_len} "
                                 f"tokens")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        placed = []
        if images and self.image_prompting is None:
            raise ValueError("images: this is a text model; it takes no images")
        if self.image_prompting is not None:
            token_ids, placed = self.image_prompting.place(token_ids, images)
        if pooling:
            return self._embedding(request_id, text, token_ids, params, placed)
        self._check_token_ids(params)
        if params.structured_outputs is not None:
            structured_outputs.check(params.structured_outputs)
        max_tokens = self.resolve_max_tokens(len(token_ids), params)
        sequences = []
        for index in range(params.n):
            seq_params = params
            if params.n > 1 and params.seed is not None:
                # Each of the n samples gets its own seeded stream; together they stay reproducible.
                seq_params = replace(params, seed=(params.seed + index) % 2**64)
            sequences.append(EngineCoreRequest(f"{request_id}#{index}", token_ids, seq_params, max_tokens,
                                               images=placed, kv_save=kv_save))
        return ProcessedRequest(request_id, text, token_ids, sequences)

    def _check_token_ids(self, params: SamplingParams) -> None:
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def _embedding(self, request_id: str, text: str | None, token_ids: list[int], params: PoolingParams,
                   images: list[ImageInput]) -> ProcessedRequest:
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"input: {len(token_ids)} tokens do not fit the context of {self.max_model_len} tokens")
        if params.dimensions is not None and self.hidden_size and params.dimensions > self.hidden_size:
            raise ValueError(f"dimensions: at most {self.hidden_size} for this model, got {params.dimensions}")
        # Prefill only: the sampling parameters are never used.
        seq = EngineCoreRequest(f"{request_id}#0", token_ids, SamplingParams(max_tokens=1), 0, pooling=params,
                                images=images)
        return ProcessedRequest(request_id, text, token_ids, [seq])

    def resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(f"prompt: {prompt_len} tokens do not fit the context of {limit} tokens "
                             f"(at least one token must be generated)")
        if params.max_tokens is None:
            return limit - prompt_len
        if prompt_len + params.max_tokens > limit:
            raise ValueError(f"max_tokens: {params.max_tokens} plus the prompt's {prompt_len} tokens exceed the "
                             f"context of {limit} tokens; ask for at most {limit - prompt_len}")
        return params.max_tokens
