"""The synchronous engine: add requests, call `step()` until none is unfinished, read the outputs.

Input processing (tokenize, validate), the engine core (schedule, run, sample) and output
processing (detokenize, stop strings) run inline here, one after the other; the server runs the
same three parts in separate threads and processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slotserve import host_memory
from slotserve.config import EngineConfig, ModelConfig
from slotserve.engine.engine_core import EngineCore
from slotserve.engine.input_processor import InputProcessor
from slotserve.engine.model_runner import ModelRunner
from slotserve.engine.output_processor import OutputProcessor
from slotserve.engine.protocol import EngineStats, KVSave
from slotserve.engine.scheduler import Scheduler
from slotserve.kv_cache.manager import KVCacheManager
from slotserve.model_store import resolve_model
from slotserve.multimodal.prompts import ImageLike, ImagePrompting
from slotserve.outputs import EmbeddingOutput, RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams
from slotserve.tokenizer import Tokenizer

__all__ = ["EngineStats", "LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model(config.model)
        self.tokenizer = Tokenizer.from_dir(path)
        host_memory.trim_heap()  # what parsing its JSON freed, before the model loads beside it
        self.core = EngineCore(config, path, self.tokenizer.eos_token_id)
        prompting = ImagePrompting.for_model(path, self.core.model_config, config.limit_mm_per_prompt,
                                             config.image_min_pixels, config.image_max_pixels)
        self.input_processor = InputProcessor(self.tokenizer, self.core.vocab_size, self.core.max_model_len,
                                              self.core.task, self.core.model_config.hidden_size, prompting)
        self.output_processor = OutputProcessor(self.tokenizer)

    def shutdown(self) -> None:
        """Stops the model's other ranks, where it has any (tensor parallel); also at exit."""
        self.core.shutdown()

    # The core's parts, for stats, benchmarks and tests.
    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def dtype(self) -> torch.dtype:
        return self.core.worker.dtype

    @property
    def load_seconds(self) -> float:
        return self.core.load_seconds

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def kv(self) -> KVCacheManager:
        return self.core.kv

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def task(self) -> str:
        return self.core.task

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None = None, images: Sequence[ImageLike] = (),
                    kv_save: KVSave | None = None) -> None:
        """Queues a request (PoolingParams: an embedding request; `images`: for a vision-language model, in the
        order of the prompt's image placeholders); bad input raises ValueError naming the problem and changes
        nothing."""
        if request_id in self.output_processor:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        default = PoolingParams() if self.core.task == "embed" else SamplingParams()
        processed = self.input_processor.process(request_id, prompt, params or default, images, kv_save)
        self.output_processor.add_request(processed)
        added = []
        try:
            for seq in processed.sequences:
                self.core.add_request(seq)
                added.append(seq.request_id)
        except ValueError:  # all of its sequences or none, and nothing left behind
            self.core.abort_requests(added)
            self.output_processor.abort_request(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def step(self) -> list[RequestOutput | EmbeddingOutput]:
        """One forward pass over every scheduled request; returns the requests that progressed."""
        processed = self.output_processor.process(self.core.step())
        self.core.abort_requests(processed.stopped, reason="stop")
        return [*processed.request_outputs, *processed.embeddings]
