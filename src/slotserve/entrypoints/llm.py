"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from slotserve.config import EngineConfig
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.protocol import KVSave
from slotserve.entrypoints.openai.chat_output import check_tools, tool_grammar
from slotserve.entrypoints.openai.tool_calls import messages_for_template, parse_tool_calls
from slotserve.model_store import DEFAULT_MODEL
from slotserve.multimodal.chat import flatten_messages
from slotserve.multimodal.prompts import ImageLike
from slotserve.outputs import EmbeddingOutput, RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams
from slotserve.tokenizer import Tokenizer

# A prompt: text, token ids, or vLLM's dict form with images:
# {"prompt": text or "prompt_token_ids": ids, "multi_modal_data": {"image": an image or a list of them}}.
Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """Loads a model once and runs batches of prompts or chats through the engine."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(**vars(config))

    def shutdown(self) -> None:
        """Stops the model's worker ranks (tensor parallel); they also stop when this process exits."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completes each prompt (text, token ids, or a dict with images); outputs come back in the prompts'
        order."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._submit(prompts, _per_prompt(sampling_params, len(prompts)), use_tqdm)

    def save_cache(self, prompt: Prompt, name: str | None = None) -> RequestOutput:
        """Computes the prompt's KV (reusing what is cached) and writes its full blocks to the disk tier
        (`kv_offload_dir`); returns once they are on disk, `num_saved_tokens` saying how many tokens they hold.
        A `name` keeps them from the directory's eviction until another save of that name replaces them."""
        request_id = f"offline-{next(self._ids)}"
        text, images = _with_images(prompt)
        self.engine.add_request(request_id, text, SamplingParams(temperature=0, max_tokens=1), images, KVSave(name))
        return self._run([request_id], use_tqdm=False)[0]

    def _submit(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams | PoolingParams],
                use_tqdm: bool) -> list:
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(f"offline-{next(self._ids)}")
                text, images = _with_images(prompt)
                self.engine.add_request(ids[-1], text, p, images)
        except ValueError:
            self.engine.abort_request(ids)  # a bad prompt in the list leaves nothing half-queued
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingOutput]:
        """One vector per prompt (the engine must run with task "embed"), in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._submit(prompts, [pooling_params or PoolingParams()] * len(prompts), use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        tool_choice: str | dict[str, Any] = "auto",
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates the reply. A message's
        content may be a list of parts: text, and images (`{"type": "image_url", "image_url": {"url": ...}}`
        or `{"type": "image", "image": <a PIL image, bytes or a path>}`). With `tools` (OpenAI's form), each
        output's `tool_calls` holds the calls parsed out of its text; `tool_choice` "required" or a named
        function makes the model call (grammar-enforced), "none" leaves the text unparsed."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        functions = check_tools(tools, tool_choice)
        grammar = tool_grammar(functions, tool_choice, {t: self.engine.tokenizer.backend.token_to_id(t)
                                                        for t in ("<tool_call>", "</tool_call>")})
        if grammar is not None:
            params = _per_prompt(sampling_params, len(conversations))
            if any(p.structured_outputs is not None for p in params):
                raise ValueError("tool_choice: a required or named tool call cannot be combined with another "
                                 "constraint (structured_outputs)")
            sampling_params = [replace(p, structured_outputs=grammar) for p in params]
        prompts = [self.render_chat(c, chat_template_kwargs, tools, add_generation_prompt) for c in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        if functions and tool_choice != "none":
            for out in outputs:
                for comp in out.outputs:
                    comp.tool_calls = parse_tool_calls(comp.text).tool_calls
        return outputs

    def render_chat(self, messages: list[Message], chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> Prompt:
        """The conversation as a prompt: its text, or with images the dict form `generate` takes."""
        flat, images = flatten_messages(messages_for_template(messages))
        text = self.engine.tokenizer.apply_chat_template(
            flat, tools=tools, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
        return {"prompt": text, "multi_modal_data": {"image": images}} if images else text

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields the text of one completion piece by piece as the engine produces it."""
        request_id = f"offline-{next(self._ids)}"
        text, images = _with_images(prompt)
        self.engine.add_request(request_id, text, sampling_params, images)
        sent = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == request_id:
                        text = out.outputs[0].text
                        if len(text) > sent:
                            yield text[sent:]
                            sent = len(text)
        finally:
            self.engine.abort_request(request_id)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput | EmbeddingOutput]:
        done: dict[str, RequestOutput | EmbeddingOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm or len(request_ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            self.engine.abort_request([i for i in request_ids if i not in done])
        return [done[i] for i in request_ids]


def _with_images(prompt: Prompt) -> tuple[str | list[int], list[ImageLike]]:
    """A prompt's text or token ids, and its images."""
    if not isinstance(prompt, dict):
        return prompt, []
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise ValueError(f"prompt: unknown keys {sorted(unknown)}")
    text = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if text is None:
        raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    data = prompt.get("multi_modal_data") or {}
    if set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: only 'image' is supported, got {sorted(data)}")
    images = data.get("image", [])
    return text, list(images) if isinstance(images, list | tuple) else [images]


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
    return list(params)
