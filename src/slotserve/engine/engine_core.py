"""The engine core: schedule, run the model, sample. Tokenized requests in, new token ids out.

It knows nothing of text: detokenization and stop strings belong to the output processor, so the
loop that drives the model never waits on them (in the server they run in another thread).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from slotserve.config import EngineConfig, ModelConfig, SpeculativeMethod
from slotserve.engine.diagnostics import StepLog, StepRecord
from slotserve.engine.executor import Executor, start_executor
from slotserve.engine.kv_offload import KVBlockIO, PendingSave, SaveTracker, model_key
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, SeqResult, Want
from slotserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    KVDiskStats,
    SpeculationStats,
)
from slotserve.engine.scheduler import Scheduler, Stop
from slotserve.engine.sequence import Sequence
from slotserve.engine.speculative import (
    DraftProposer,
    DraftSlots,
    NgramProposer,
    check_speculation,
    load_draft,
)
from slotserve.engine.worker import Rank, Worker
from slotserve.engine.worker_process import ReportKind
from slotserve.kv_cache.disk_tier import DiskTier, WriteJob
from slotserve.kv_cache.manager import KVCacheManager
from slotserve.layers.sampler import Sampled, SamplingState, prompt_logprobs
from slotserve.models.pooling import PoolingConfig, load_pooling_config, resolve_task
from slotserve.multimodal.inputs import RequestImages
from slotserve.structured_outputs import Grammar, GrammarCompiler

logger = logging.getLogger("slotserve")

_CPU_KV_CACHE_BYTES = 1 << 30
_IDLE_WAIT_S = 0.05  # a step with nothing to run but saves being written waits this long for one to finish


class EngineCore:
    """The model's ranks (this process's `Worker` is rank 0; an executor runs the others), the scheduler over
    their KV cache, and the sequences in flight."""

    def __init__(self, config: EngineConfig, model_path: Path, tokenizer_eos_id: int | None = None) -> None:
        start = time.perf_counter()
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size: {config.data_parallel_size} replicas run behind a server's front "
                             "end (`slotserve serve`); one engine core is one replica")
        self.config = config
        tp = config.tensor_parallel_size
        self.workers: Executor | None = None
        self.worker: Worker | None = None
        self.disk: DiskTier | None = None
        self.saves = SaveTracker()
        # Told when a thread of the engine's own dies (the disk writer); the engine-core process ends the engine.
        self.on_thread_death: Callable[[str, BaseException], None] | None = None
        if tp > 1:
            check_split(ModelConfig.from_dir(model_path), config)
            # Started before this process is pinned, so each worker inherits all the host's cores to take its share.
            self.workers = start_executor(config, model_path)
        # Collected without `shutdown` (an `LLM` dropped), the engine still stops its other ranks.
        self._finalizer = weakref.finalize(self, _stop_ranks, self.workers)
        try:
            rank = Rank(0, tp, self.workers.init_method) if self.workers is not None else Rank()
            self.worker = Worker(config, model_path, rank, check=self.workers.check if self.workers else None)
            self._load(config, model_path, tokenizer_eos_id, start)
        except Exception:
            self.shutdown()
            raise

    def _load(self, config: EngineConfig, model_path: Path, tokenizer_eos_id: int | None, start: float) -> None:
        worker = self.worker
        self.model, self.model_config, self.device = worker.model, worker.model_config, worker.device
        self.eos_token_ids = eos_token_ids(self.model_config, tokenizer_eos_id)
        pooling = load_pooling_config(Path(model_path))
        self.task = resolve_task(config.task, self.model_config.architecture, pooling)
        self.pooling = pooling or PoolingConfig()

        spec = config.speculative_config
        draft = None
        if spec is not None:
            check_speculation(config, self.model_config)
            if spec.method is SpeculativeMethod.DRAFT_MODEL:
                draft = load_draft(config, self.model_config, worker.dtype, worker.device)
        budget = config.kv_cache_memory or self._default_kv_budget()
        bytes_per_block = worker.cache_bytes_per_block()
        if draft is not None:  # each block holds both models' keys and values of its positions
            bytes_per_block += ModelRunner.cache_bytes_per_token(draft[1], worker.dtype) * config.block_size
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes cannot hold one block of {bytes_per_block} bytes")
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, num_blocks * config.block_size)
        if self.workers is not None:
            self.workers.wait_for(ReportKind.LOADED)
            self.workers.allocate_cache(num_blocks)
        self.runner = worker.allocate_cache(num_blocks)
        self.proposer: NgramProposer | DraftProposer | None = None
        if spec is not None:
            self.proposer = NgramProposer(spec) if draft is None else DraftProposer(
                ModelRunner(*draft, num_blocks, config.block_size, prefill=config.prefill_precision),
                config.max_num_batched_tokens)
        self.speculation = SpeculationStats()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 *self._disk_tier(model_path))
        self._draft_slots = None if spec is None else DraftSlots(spec.num_speculative_tokens,
                                                                 spec.disable_by_batch_size,
                                                                 current=self.proposer.current)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.eos_token_ids,
                                   self.max_model_len, self._draft_slots)
        self.requests: dict[str, Sequence] = {}
        self.step_log = StepLog()
        self.grammars = GrammarCompiler(Path(model_path) / "tokenizer.json", self.vocab_size,
                                        sorted(self.eos_token_ids))
        self.load_seconds = time.perf_counter() - start
        logger.info("loaded %s (%s) in %.1f s; %s", config.model, self._placement(), self.load_seconds,
                    "; ".join(self._setup(num_blocks)))

    def _disk_tier(self, model_path: Path) -> tuple[DiskTier | None, KVBlockIO | None]:
        """The prefix cache's disk tier over this runner's cache, where --kv-offload-dir asks for one."""
        config = self.config
        if config.kv_offload_dir is None:
            return None, None
        data = KVBlockIO(self.runner.k_cache, self.runner.v_cache, config.block_size)
        layout = (self.model_config.num_hidden_layers, *self.runner.k_cache.shape[2:])
        key = model_key(Path(model_path), self.worker.dtype, config.block_size, layout)
        self.disk = DiskTier(config.kv_offload_dir, key, config.kv_offload_bytes, on_error=self._disk_failed)
        return self.disk, data

    def _disk_failed(self, error: BaseException) -> None:
        """The writer thread died (a bug, not a full disk): the engine ends, here or at its next step. Its reason
        is recorded before the waiting saves wake, so the first reason is the writer's."""
        if self.on_thread_death is not None:
            self.on_thread_death("KVDiskWriter", error)
        self.saves.event.set()

    def _placement(self) -> str:
        """The load line's architecture, device, dtype, threads and cores, and how the model is split."""
        cpu, config = self.worker.cpu, self.config
        cores = cpu.cpu_affinity
        split = ""
        if config.tensor_parallel_size > 1:
            split = (f", tensor parallel {config.tensor_parallel_size} ({config.distributed_executor_backend.value})"
                     + (f", expert parallel ({config.expert_comm.value})" if config.enable_expert_parallel else ""))
        on = f" on cores {','.join(map(str, cores))}" if cores else ""
        return (f"{self.model_config.architecture}, {self.device}, {str(self.worker.dtype).removeprefix('torch.')}, "
                + (f"{cpu.threads} threads per rank" + (f", rank 0{on}" if on else "") if split
                   else f"{cpu.threads} threads{on}") + split)

    def _setup(self, num_blocks: int) -> list[str]:
        """The load line's parts on the KV cache and the kernels each step runs."""
        block_size, runner = self.config.block_size, self.runner
        parts = [f"KV cache: {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens",
                 f"max_model_len {self.max_model_len}", f"decode attention: {runner.decode_mode}"]
        if runner.native_gemm:
            parts.append("small-batch GEMM: native")
        if runner.packing_report.packed:
            parts.append(runner.packing_report.summary())
        if runner.fused:
            parts.append("decode steps: fused")
        if self.worker.vision_dtype is not None:
            parts.append(f"vision tower: {str(self.worker.vision_dtype).removeprefix('torch.')}")
        if self.worker.weights_in_huge_pages:
            parts.append("weights in huge pages")
        spec = self.config.speculative_config
        if spec is not None:
            parts.append(f"speculative decoding: {spec.method.value}" + (f" {spec.model}" if spec.model else "")
                         + f", {spec.num_speculative_tokens} tokens")
        if self.disk is not None:
            parts.append(f"KV disk tier: {self.disk.dir} ({self.disk.num_files} blocks, "
                         f"{self.disk.bytes_used / 2**20:.0f} of {self.config.kv_offload_bytes / 2**20:.0f} MiB)")
        return parts

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return _CPU_KV_CACHE_BYTES

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        if request.kv_save is not None and self.disk is None:
            raise ValueError("kv_save: this engine has no KV disk tier; start it with --kv-offload-dir")
        sampling = SamplingState.new(request.params, request.prompt_token_ids, sorted(self.eos_token_ids),
                                     self.vocab_size, self.device)
        if request.params.structured_outputs is not None:  # compiled on the grammar thread; it waits till then
            sampling.grammar = Grammar(self.grammars.submit(request.params.structured_outputs))
        seq = Sequence(request.request_id, request.prompt_token_ids, request.params, sampling, request.max_tokens,
                       prompt_logprobs=[] if request.params.prompt_logprobs is not None else None,
                       pooling=request.pooling, images=self._images(request), kv_save=request.kv_save)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def _images(self, request: EngineCoreRequest) -> RequestImages | None:
        """The request's images in its slot; ValueError where the model takes none or they do not fit."""
        if not request.images and self.model_config.vision is None:
            return None
        if request.images and self.model_config.vision is None:
            raise ValueError(f"images: {self.model_config.architecture} is a text model; it takes no images")
        prompt = len(request.prompt_token_ids)
        for image in request.images:
            if not 0 <= image.offset < image.end <= prompt:
                raise ValueError(f"images: tokens {image.offset}..{image.end} lie outside the prompt of {prompt}")
        return RequestImages.of(request.images, prompt, self.model.spatial_merge_size)

    def _encode_images(self, plan: list[tuple[Sequence, int]]) -> None:
        """Runs the vision tower, in one call, over the images this step's chunks reach that are not encoded yet."""
        todo = [(seq.images, i) for seq, num_new in plan if seq.images is not None
                for i in seq.images.unencoded(seq.num_computed_tokens, seq.num_computed_tokens + num_new)]
        if not todo:
            return
        inputs = [images.inputs[i] for images, i in todo]
        encoded = self.model.encode_images([image.pixel_values() for image in inputs],
                                           [image.grid_thw for image in inputs])
        for (images, i), image, out in zip(todo, inputs, encoded, strict=True):
            if len(out.embeds) != image.num_tokens:
                raise ValueError(f"images: an image of grid {image.grid_thw} gives {len(out.embeds)} tokens, its "
                                 f"prompt holds {image.num_tokens}")
            images.encoded[i] = out

    def abort_requests(self, request_ids: list[str], reason: str = "abort") -> None:
        """Finishes these requests in whatever state they are (unknown ids are ignored) and frees
        their blocks."""
        for request_id in request_ids:
            seq = self.requests.pop(request_id, None)
            if seq is not None:
                self.scheduler.finish(seq, reason)

    def speculate(self, on: bool) -> None:
        """Lets the scheduler leave room for proposals again, or no more (a benchmark compares both on one engine);
        without a speculative_config there are none either way."""
        self.scheduler.draft_slots = self._draft_slots if on else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.saves.pending)

    def stats(self) -> EngineStats:
        prefix, disk = self.kv.stats, None
        if self.disk is not None:
            s = self.disk.stats
            disk = KVDiskStats(self.disk.num_files, self.disk.bytes_used, self.disk.max_bytes, s.bytes_read,
                               s.bytes_written, s.corrupt_files, s.write_errors, s.dropped_writes, s.evicted_files)
        pool = self.kv.pool
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free, max_model_len=self.max_model_len,
            prefix_cache_queried_tokens=prefix.queried_tokens, prefix_cache_hit_tokens=prefix.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions, speculation=replace(self.speculation),
            prefix_cache_disk_hit_tokens=prefix.disk_hit_tokens, kv_disk=disk,
        )

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """One forward pass over every scheduled sequence; an output for each that sampled a token or ended."""
        began = time.perf_counter()
        saved = self._finished_saves()
        plan = self.scheduler.schedule()
        failed = saved + self._failed_grammars(plan.scheduled)
        if not plan.scheduled:
            if not failed and self.saves.pending:
                self.saves.event.wait(_IDLE_WAIT_S)  # nothing to run until the writer finishes a save
            return failed
        if self.proposer is not None:
            self._propose(plan.scheduled)
        scheduled = time.perf_counter()
        self._encode_images(plan.scheduled)  # the vision tower's time counts as the model's
        seqs = [self._scheduled_seq(seq, num_new) for seq, num_new in plan.scheduled]
        results = self.execute(seqs)
        ran = time.perf_counter()
        states: list[SamplingState | None] = []
        for (seq, num_new), sched, result in zip(plan.scheduled, seqs, results, strict=True):
            if sched.want is Want.ALL:
                self._score_prompt(seq, sched.start_pos, result.logits)
            seq.num_computed_tokens += num_new - sched.num_draft  # proposed tokens count once kept
            self.kv.register_full_blocks(seq)
            done = seq.num_computed_tokens >= seq.num_tokens
            states.append(seq.sampling if done and seq.pooling is None else None)
        taken: list[list[Sampled]] = [[] for _ in seqs]
        stops: list[Stop | None] = [None] * len(seqs)

        def append(i: int, sampled: Sampled) -> bool:
            taken[i].append(sampled)
            stops[i] = self.scheduler.append_token(plan.scheduled[i][0], sampled.token)
            return stops[i] is None

        self.runner.sample(results, states, [seq.draft_token_ids for seq, _ in plan.scheduled], append)
        outputs = []
        for (seq, _), result, tokens, stop in zip(plan.scheduled, results, taken, stops, strict=True):
            if seq.draft_token_ids:
                self._verified(seq, len(tokens) - 1, stop)
            if tokens and stop is not None and seq.kv_save is not None:
                self._save(seq, self._output(seq, tokens, stop))
            elif tokens:
                outputs.append(self._output(seq, tokens, stop))
            elif seq.pooling is not None and seq.num_computed_tokens >= seq.num_tokens:
                outputs.append(self._pool(seq, result.hidden[-1]))
        end = time.perf_counter()
        decoding, k = self.scheduler.slots
        if (self._draft_slots is not None and decoding == len(plan.scheduled) and decoding
                and (not k or self.proposer.steady)):  # a decode step whose time is its K's: timed
            self._draft_slots.record(decoding, k, end - began)
        self.step_log.add(StepRecord(time.time(), end - began, scheduled - began, ran - scheduled, end - ran,
                                     len(seqs), sum(len(s.token_ids) for s in seqs)))
        return failed + outputs

    def _save(self, seq: Sequence, output: EngineCoreOutput) -> None:
        """Hands a finished save request's prompt blocks to the disk writer; its output waits till they are written
        (its blocks stay referenced till then, so the writer reads them in place)."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.prompt_token_ids))
        block_ids, writes = self.kv.save_job_blocks(seq)
        job = WriteJob(writes, name=seq.kv_save.name, token_ids=list(seq.prompt_token_ids),
                       block_size=self.config.block_size)
        self.saves.add(PendingSave(block_ids, output, job))
        self.disk.submit(job)

    def _finished_saves(self) -> list[EngineCoreOutput]:
        """The outputs of saves whose blocks the writer has finished, their blocks released."""
        if self.disk is not None and self.disk.error is not None:
            raise RuntimeError(f"the KV disk writer died: {type(self.disk.error).__name__}: {self.disk.error}")
        outputs = []
        for save in self.saves.done():
            self.kv.release(save.block_ids)
            save.output.num_saved_tokens = save.job.leading * self.config.block_size
            outputs.append(save.output)
        return outputs

    def _propose(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Fills the room the scheduler left decoding sequences with proposed tokens; what stays empty is not
        computed."""
        room = [(i, seq, num_new - 1) for i, (seq, num_new) in enumerate(scheduled)
                if num_new > seq.num_tokens - seq.num_computed_tokens]
        if not room:
            return
        proposals = self.proposer.propose([seq for _, seq, _ in room], [k for _, _, k in room])
        for (i, seq, k), drafts in zip(room, proposals, strict=True):
            seq.draft_token_ids = drafts[:k]
            scheduled[i] = (seq, 1 + len(seq.draft_token_ids))
            if not drafts:
                self._draft_slots.note(seq, 0)

    def _verified(self, seq: Sequence, kept: int, stop: Stop | None) -> None:
        """After a step verified the sequence's proposed tokens, of which it kept `kept`: their keys stay (those of
        the rejected ones are overwritten later), and the draft model's cache is valid up to the first rejected."""
        self.speculation.proposed += len(seq.draft_token_ids)
        self.speculation.accepted += kept
        self.speculation.verified += 1
        self._draft_slots.note(seq, kept)
        seq.draft_token_ids = []
        if stop is None:
            seq.num_computed_tokens += kept
            self.kv.register_full_blocks(seq)
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)

    @staticmethod
    def _scheduled_seq(seq: Sequence, num_new: int) -> ScheduledSeq:
        """A sequence's share of the step, and what the step gives back for it."""
        start = seq.num_computed_tokens
        drafts = seq.draft_token_ids
        last_chunk = start + num_new - len(drafts) == seq.num_tokens
        scores_prompt = seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt_token_ids)
        want = (Want.HIDDEN if seq.pooling else Want.ALL if scores_prompt
                else Want.GREEDY if seq.sampling.takes_argmax() else Want.LAST)
        vision = seq.images.vision(start, start + num_new) if seq.images is not None else None
        return ScheduledSeq(seq.token_ids(start, start + num_new - len(drafts)) + drafts, start, seq.block_table,
                            want=want if last_chunk or scores_prompt else Want.NONE, vision=vision,
                            num_draft=len(drafts))

    def _failed_grammars(self, scheduled: list[tuple[Sequence, int]]) -> list[EngineCoreOutput]:
        """Ends the scheduled requests whose grammar failed to compile for this tokenizer (the front end checked it
        without one), taking them out of the step."""
        failed = [seq for seq, _ in scheduled if seq.sampling.grammar is not None and seq.sampling.grammar.error]
        for seq in failed:
            logger.error("request %s: %s", seq.request_id, seq.sampling.grammar.error)
            self.requests.pop(seq.request_id, None)
            self.scheduler.finish(seq, "abort")
        scheduled[:] = [(seq, n) for seq, n in scheduled if seq not in failed]
        return [EngineCoreOutput(seq.request_id, [], finish_reason="abort") for seq in failed]

    def execute(self, seqs: list[ScheduledSeq]) -> list[SeqResult]:
        """One forward pass over these sequences on every rank (`ModelRunner.execute`); a failed collective
        becomes the WorkerError that says which rank failed (a failed micro-batch here: its UbatchError)."""
        if self.workers is None:
            return self.runner.execute(seqs)
        self.workers.send_step(seqs)
        try:
            return self.runner.execute(seqs)
        except RuntimeError as e:  # a collective failed (a worker died or stopped answering), or a micro-batch
            explained = self.workers.explain(e)
            if explained is e:
                raise
            raise explained from e

    def worker_failure(self) -> str | None:
        """Why the model's other ranks can no longer run (one is gone); None while they can, or with none."""
        return None if self.workers is None else self.workers.failure()

    def shutdown(self, kill: bool = False) -> None:
        """Stops the model's other ranks and leaves their process group; with `kill`, for an engine that is
        dying, ends them at once and leaves the group as it is (a thread may still be in a collective).
        Idempotent. This process may use all the cores it could before the engine pinned it again."""
        if getattr(self, "grammars", None) is not None:
            self.grammars.shutdown()
        if self.disk is not None and not kill:
            self.disk.close()  # the evicted blocks still queued are written
        if kill and self.workers is not None:
            self.workers.kill()
        self._finalizer()
        if self.worker is not None:
            self.worker.close(leave_group=not kill)

    def _pool(self, seq: Sequence, hidden: torch.Tensor) -> EngineCoreOutput:
        """The embedding of a prefilled request (last-token pooling); the request ends here and its
        blocks are freed: no KV is kept after an embedding."""
        vector = hidden[: seq.pooling.dimensions] if seq.pooling.dimensions else hidden
        normalize = self.pooling.normalize if seq.pooling.normalize is None else seq.pooling.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq, "stop")
        return EngineCoreOutput(seq.request_id, [], embedding=vector.tolist(), finish_reason="stop",
                                num_cached_tokens=seq.num_cached_tokens)

    def _score_prompt(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """Prompt logprobs of the positions this chunk predicts (row j scores prompt token start + j + 1)."""
        tokens = seq.prompt_token_ids[start:start + len(rows) + 1]
        entries = prompt_logprobs(rows[:len(tokens) - 1], tokens, seq.params.prompt_logprobs)
        seq.prompt_logprobs += entries[1:] if start else entries

    def _output(self, seq: Sequence, tokens: list[Sampled], stop: Stop | None) -> EngineCoreOutput:
        """The output of the tokens the sequence took this step (the scheduler appended them)."""
        first = len(seq.output_token_ids) == len(tokens)
        if stop is not None:
            self.requests.pop(seq.request_id, None)
        return EngineCoreOutput(
            seq.request_id, [t.token for t in tokens],
            new_logprobs=[t.logprobs for t in tokens] if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if first else None,
            finish_reason=stop.reason if stop else None, stop_reason=stop.token if stop else None,
            num_cached_tokens=seq.num_cached_tokens,
        )


def _stop_ranks(workers: Executor | None) -> None:
    if workers is not None:
        workers.shutdown()


def check_split(cfg: ModelConfig, config: EngineConfig) -> None:
    """ValueError, naming the setting, where the model does not split over the ranks asked for."""
    tp = config.tensor_parallel_size
    problems = []
    if cfg.vision is not None:
        problems.append("vision tower (a vision-language model runs on one rank)")
    if cfg.num_attention_heads % tp:
        problems.append(f"{cfg.num_attention_heads} attention heads")
    kv = cfg.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(f"{kv} KV heads (the ranks must split them or share each evenly)")
    if cfg.intermediate_size % tp:
        problems.append(f"an MLP width of {cfg.intermediate_size}")
    if cfg.num_experts and config.enable_expert_parallel and cfg.num_experts % tp:
        problems.append(f"{cfg.num_experts} experts")
    if cfg.num_experts and not config.enable_expert_parallel and cfg.moe_intermediate_size % tp:
        problems.append(f"an expert width of {cfg.moe_intermediate_size} (--enable-expert-parallel splits the "
                        "experts instead)")
    if problems:
        raise ValueError(f"tensor_parallel_size: {tp} ranks cannot split {cfg.architecture}'s "
                         + ", ".join(problems))


def eos_token_ids(cfg: ModelConfig, tokenizer_eos: int | None) -> frozenset[int]:
    """The model's end tokens: config.json, generation_config.json and the tokenizer's eos."""
    ids = set(cfg.eos_token_ids)
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(ids)
