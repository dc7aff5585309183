"""The synchronous engine: add requests, call `step()` until none is unfinished, read the outputs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from slotserve.config import EngineConfig, ModelConfig, parse_device, parse_dtype
from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq
from slotserve.engine.request import Request
from slotserve.engine.scheduler import Scheduler
from slotserve.kv_cache.manager import KVCacheManager
from slotserve.layers.sampler import Sampler, SamplingState, prompt_logprobs
from slotserve.model_store import resolve_model
from slotserve.models.loader import load_model
from slotserve.outputs import PositionLogprobs, RequestOutput
from slotserve.sampling_params import SamplingParams
from slotserve.tokenizer import Tokenizer

logger = logging.getLogger("slotserve")

_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_cache_usage: float
    num_blocks: int
    max_model_len: int
    prefix_cache_hit_rate: float
    num_preemptions: int


@dataclass
class _Group:
    """A user request: its n sampled sequences and what is shared between them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        path = resolve_model(config.model)
        self.device = parse_device(config.device)
        self.dtype = parse_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.model, self.model_config = load_model(path, self.dtype, self.device, config.max_model_len)
        self.tokenizer = Tokenizer.from_dir(path)
        self.eos_token_ids = _eos_ids(self.model_config, self.tokenizer)

        cfg = self.model_config
        budget = config.kv_cache_memory or self._default_kv_budget()
        bytes_per_block = ModelRunner.cache_bytes_per_token(cfg, self.dtype) * config.block_size
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes cannot hold one block of {bytes_per_block} bytes")
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, num_blocks * config.block_size)
        self.runner = ModelRunner(self.model, cfg, num_blocks, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler()
        self._groups: dict[str, _Group] = {}
        self.load_seconds = time.perf_counter() - start
        logger.info("loaded %s (%s, %s, %s) in %.1f s; KV cache: %d blocks x %d tokens = %d tokens; max_model_len %d",
                    config.model, cfg.architecture, self.device, str(self.dtype).removeprefix("torch."),
                    self.load_seconds, num_blocks, config.block_size, num_blocks * config.block_size,
                    self.max_model_len)

    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return _CPU_KV_CACHE_BYTES

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queues a request; bad input raises ValueError naming the problem and changes nothing."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, "
                                 f"{self.model_config.vocab_size})")
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        children = [self._child(request_id, i, text, token_ids, params, max_tokens) for i in range(params.n)]
        self._groups[request_id] = _Group(request_id, text, token_ids, children)
        for child in children:
            self.scheduler.add(child)

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
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

    def _child(self, request_id: str, index: int, text: str | None, token_ids: list[int],
               params: SamplingParams, max_tokens: int) -> Request:
        if params.n > 1 and params.seed is not None:
            # Each of the n samples gets its own seeded stream; together they stay reproducible.
            params = replace(params, seed=(params.seed + index) % 2**64)
        sampling = SamplingState.new(params, token_ids, self.eos_token_ids, self.model_config.vocab_size,
                                     self.device)
        return Request(
            request_id=request_id, index=index, prompt=text, prompt_token_ids=token_ids, params=params,
            sampling=sampling, detokenizer=IncrementalDetokenizer(self.tokenizer, params), max_tokens=max_tokens,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.pop(request_id, None)
            for child in group.children if group else []:
                if not child.finished:
                    self.scheduler.finish(child, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.pool.usage, num_blocks=self.kv.pool.num_blocks, max_model_len=self.max_model_len,
            prefix_cache_hit_rate=self.kv.stats.hit_rate, num_preemptions=self.scheduler.num_preemptions,
        )

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass over every scheduled request; returns the requests that progressed."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        seqs = []
        for req, num_new in plan.scheduled:
            start = req.num_computed_tokens
            samples = start + num_new == req.num_tokens
            scores_prompt = req.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt_token_ids)
            seqs.append(ScheduledSeq(req.all_token_ids[start:start + num_new], start, req.block_table,
                                     logits="all" if scores_prompt else "last" if samples else "none"))
        logits = self.runner.execute(seqs)
        sampling: list[tuple[Request, torch.Tensor]] = []
        for (req, num_new), seq, seq_logits in zip(plan.scheduled, seqs, logits, strict=True):
            if seq.logits == "all":
                self._score_prompt(req, seq.start_pos, seq_logits)
            req.num_computed_tokens += num_new
            self.kv.register_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                sampling.append((req, seq_logits[-1:]))
        if sampling:
            sampled = self.sampler(torch.cat([row for _, row in sampling]), [r.sampling for r, _ in sampling])
            now = time.monotonic()
            for i, (req, _) in enumerate(sampling):
                self._append(req, sampled.token_ids[i], sampled.logprobs[i], now)
        return self._outputs({req.request_id for req, _ in sampling})

    def _score_prompt(self, req: Request, start: int, rows: torch.Tensor) -> None:
        """Prompt logprobs of the positions this chunk predicts (row j scores prompt token start + j + 1)."""
        tokens = req.prompt_token_ids[start:start + len(rows) + 1]
        entries = prompt_logprobs(rows[:len(tokens) - 1], tokens, req.params.prompt_logprobs)
        for position in entries[1:]:
            self._name_tokens(position)
        req.prompt_logprobs += entries[1:] if start else entries

    def _append(self, req: Request, token: int, logprobs: PositionLogprobs | None, now: float) -> None:
        req.output_token_ids.append(token)
        req.sampling.append(token)
        req.first_token_time = req.first_token_time or now
        if req.params.logprobs is not None:
            self._name_tokens(logprobs)
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs[token].logprob
        params = req.params
        enough = len(req.output_token_ids) >= params.min_tokens
        is_eos = enough and not params.ignore_eos and token in self.eos_token_ids
        is_stop_token = enough and token in params.stop_token_ids
        update = req.detokenizer.update([token], stop_terminated=is_eos or is_stop_token)
        if is_eos:
            self.scheduler.finish(req, "stop")
        elif is_stop_token:
            self.scheduler.finish(req, "stop", token)
        elif update.stop_string is not None:
            self.scheduler.finish(req, "stop", update.stop_string)
        elif len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self.scheduler.finish(req, "length")
            req.detokenizer.flush()

    def _name_tokens(self, position: PositionLogprobs | None) -> None:
        for token_id, entry in (position or {}).items():
            entry.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _outputs(self, request_ids: set[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            group = self._groups[request_id]
            done = all(c.finished for c in group.children)
            outputs.append(RequestOutput(
                request_id=request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                outputs=[c.completion() for c in group.children], finished=done,
                prompt_logprobs=group.children[0].prompt_logprobs,
                metrics=_metrics(group.children[0]),
            ))
            if done:
                del self._groups[request_id]
        return outputs


def _metrics(req: Request) -> dict[str, float]:
    if req.first_token_time is None:
        return {}
    return {"time_to_first_token": req.first_token_time - req.arrival_time}


def _eos_ids(cfg: ModelConfig, tokenizer: Tokenizer) -> frozenset[int]:
    ids = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


