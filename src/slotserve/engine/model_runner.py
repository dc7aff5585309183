"""Turns one step's scheduled sequences into a flat batch, runs the model, returns what each sequence wants."""

from __future__ import annotations

import enum
import itertools
import logging
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from slotserve import faults, host_memory
from slotserve.config import EngineConfig, ModelConfig, PrefillPrecision
from slotserve.distributed.group import UNSPLIT
from slotserve.faults import FaultPoint
from slotserve.kernels import norm_rotary_swiglu_argmax, small_gemm
from slotserve.kv_cache.block_table import cache_indices
from slotserve.layers.attention import (
    Attention,
    AttentionMetadata,
    GatherWorkspace,
    gather_max_tokens,
    kv_head_shard,
    paged_decode_available,
)
from slotserve.layers.sampler import Sampler, SamplingState, greedy
from slotserve.layers.verification import Append, sample_and_verify
from slotserve.models.fused_decode import MAX_TOKENS, FusedDecode
from slotserve.models.packing import pack_linears
from slotserve.multimodal.inputs import SeqVision, VisualRows
from slotserve.parallel import ubatch
from slotserve.parallel.ubatch import OverlapGate, UbatchPool

logger = logging.getLogger("slotserve")


class Want(enum.Enum):
    """What a step gives back for one scheduled sequence (in its `SeqResult`)."""

    LAST = "last"  # the logits of its last new position: `logits` [1, vocab]
    ALL = "all"  # the logits of every new position: `logits` [new tokens, vocab]
    # The argmax of its last position's logits alone, `tokens`: the first index among ties, what the sampler's
    # greedy rows take when nothing processes the logits.
    GREEDY = "greedy"
    HIDDEN = "hidden"  # its last position's final hidden state, for pooling: `hidden` [1, hidden_size]
    NONE = "none"  # nothing: a prompt chunk before its last


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `token_ids` are computed at positions start_pos, start_pos+1, ...; the last
    `num_draft` of them are proposed tokens (speculative decoding), whose rows it wants as well as the last
    (LAST, GREEDY: one row more each)."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    want: Want = Want.LAST
    vision: SeqVision | None = None  # a vision-language model's positions and image rows; never sent to workers
    num_draft: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.want, Want):
            raise TypeError(f"want: must be a Want, got {self.want!r}")


@dataclass(frozen=True)
class SeqResult:
    """What a step gave for one sequence: the field its `Want` names (float32), the others None. `logits` and
    `tokens` hold a row for each wanted position (1 + num_draft)."""

    logits: torch.Tensor | None = None
    tokens: list[int] | None = None
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class UbatchPolicy:
    """Micro-batch overlap (parallel/ubatch.py): a step of at least the threshold's tokens runs as `count`
    micro-batches; `count` 1: never."""

    count: int = 1
    decode_threshold: int = 32  # for steps whose every sequence computes one token
    prefill_threshold: int = 512  # for the others
    timeout_s: float = 120.0  # for each wait of a micro-batch
    adaptive: bool = True  # split only the kinds of steps that measure faster split (OverlapGate)

    @classmethod
    def of(cls, config: EngineConfig) -> UbatchPolicy:
        return cls(config.ubatches, config.ubatch_decode_threshold, config.ubatch_prefill_threshold,
                   config.distributed_timeout, config.ubatch_adaptive)

    def count_for(self, seqs: list[ScheduledSeq]) -> int:
        """How many micro-batches this step would run as (1: not split)."""
        decode, tokens = _step_kind(seqs)
        threshold = self.decode_threshold if decode else self.prefill_threshold
        return self.count if self.count > 1 and tokens >= max(threshold, self.count) else 1


def split_tokens(seqs: list[ScheduledSeq], n: int) -> list[list[ScheduledSeq]]:
    """The step's tokens in `n` consecutive parts of near-equal size (the first `tokens % n` one longer). A
    sequence across a boundary is cut into pieces: each computes its tokens at their positions (a later one
    attends to the earlier one's keys, which its micro-batch wrote first), and only the last keeps a want of
    one row (LAST, GREEDY, HIDDEN); every piece of a Want.ALL wants its rows."""
    total = sum(len(s.token_ids) for s in seqs)
    sizes = [total // n + (i < total % n) for i in range(n)]
    parts: list[list[ScheduledSeq]] = [[] for _ in range(n)]
    part, room = 0, sizes[0]
    for seq in seqs:
        done = 0
        while done < len(seq.token_ids):
            if not room:
                part += 1
                room = sizes[part]
            take = min(room, len(seq.token_ids) - done)
            last = done + take == len(seq.token_ids)
            want = seq.want if last or seq.want is Want.ALL else Want.NONE
            parts[part].append(replace(seq, token_ids=seq.token_ids[done:done + take], start_pos=seq.start_pos + done,
                                       want=want))
            done += take
            room -= take
    return parts


@dataclass
class FlatBatch:
    """One forward's inputs: the sequences' new tokens side by side, and which rows leave the model."""

    input_ids: torch.Tensor
    positions: torch.Tensor  # [tokens], or [3, tokens] (M-RoPE) where a sequence computes image tokens
    meta: AttentionMetadata
    keep: torch.Tensor | None  # the rows whose final hidden state is needed; None: all
    visual: VisualRows | None = None  # the image tokens' rows and encoder outputs


class ModelRunner:
    """Owns the model and its paged KV cache; stateless across steps beyond the cache contents."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 decode_mode: str | None = None, ubatching: UbatchPolicy | None = None,
                 prefill: PrefillPrecision = PrefillPrecision.AUTO) -> None:
        """decode_mode: how decode rows read the cache (layers/attention.py); None: "paged" where the CPU
        kernel runs, else "batched". ubatching: which steps run as micro-batches (under tensor parallel).
        prefill: what packed weights' calls of many rows multiply in."""
        self.model, self.cfg = model, cfg
        self.ubatching = ubatching or UbatchPolicy()
        self.overlap = True  # this rank's vote on splitting steps; a benchmark switches it off to compare
        split = self.ubatching.count > 1
        self.ubatch_pool = UbatchPool(self.ubatching.count, self.ubatching.timeout_s) if split else None
        self.gate = OverlapGate() if split and self.ubatching.adaptive else None
        self.block_size, self.num_blocks = block_size, num_blocks
        self.sampler = Sampler()
        self.workspace = GatherWorkspace()
        *_, param = model.parameters()  # the text model's last: a vision tower, listed first, may run in bfloat16
        self.device, self.dtype = param.device, param.dtype
        self.decode_mode = decode_mode or ("paged" if paged_decode_available(self.device, self.dtype) else "batched")
        # Build the native kernels (layers/linear.py, norm.py, rotary.py) now, not in the middle of a step.
        cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
        self.native_gemm = cpu_fp32 and small_gemm.available()
        self.native_row_ops = cpu_fp32 and norm_rotary_swiglu_argmax.available()
        self.packing_report = pack_linears(model, prefill)  # which linears run packed (models/packing.py)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        kv_heads = layers[0].num_kv_heads  # this rank's, under tensor parallel
        self.gather_limit = gather_max_tokens(kv_heads, cfg.head_dim, self.dtype)
        shape = (cfg.num_hidden_layers, num_blocks * block_size, kv_heads, cfg.head_dim)
        self.k_cache = host_memory.zeros(shape, self.dtype, self.device)
        self.v_cache = host_memory.zeros(shape, self.dtype, self.device)
        for i, attn in enumerate(layers):
            attn.k_cache, attn.v_cache = self.k_cache[i], self.v_cache[i]
        # Decode steps of a Qwen model through one native call (models/fused_decode.py), where it runs: not under
        # tensor parallel, whose collectives sit between the layers.
        parallel = getattr(model, "parallel", UNSPLIT)
        self.group = parallel.group
        if self.ubatch_pool is not None:
            self.ubatch_pool.rank = self.group.rank
        self._fuses = self.decode_mode == "paged" and cpu_fp32 and parallel.group.size == 1
        self.rebind()

    def rebind(self) -> None:
        """Binds the fused decode step to the model as it is now. The kernel reads the model's tensors through
        the pointers it took when bound (and holds the tensors, so those stay valid): code that replaces a
        weight, a module, a packing or a KV cache of the model once the runner is built calls this."""
        self.fused = FusedDecode.bind(self.model) if self._fuses else None

    @staticmethod
    def cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
        """Of one rank's cache, which holds its KV heads alone."""
        elem = torch.empty(0, dtype=dtype).element_size()
        kv_heads = kv_head_shard(cfg.num_key_value_heads, 0, tensor_parallel_size).size
        return 2 * cfg.num_hidden_layers * kv_heads * cfg.head_dim * elem

    def execute(self, seqs: list[ScheduledSeq]) -> list[SeqResult]:
        """Runs one forward over all sequences' new tokens; per sequence, what its `want` asks for.
        BlockTableError where a sequence's block table does not hold its positions."""
        if any(s.num_draft for s in seqs):
            return self._verify(seqs)
        if (out := self._decode(seqs)) is not None:
            return out
        return self._forward(seqs)

    def _verify(self, seqs: list[ScheduledSeq]) -> list[SeqResult]:
        """`execute` of a step with proposed tokens: each of a verified sequence's tokens computes as a decode row
        of its own (one sequence's rows attend to the keys of those before, which the step writes first), so each
        gets the bits it would get decoded alone, one step at a time, and the step can run fused."""
        rows: list[ScheduledSeq] = []
        for s in seqs:
            if not s.num_draft:
                rows.append(s)
                continue
            first = len(s.token_ids) - 1 - s.num_draft  # the tokens before the last computed are no decode rows
            if first:
                rows.append(replace(s, token_ids=s.token_ids[:first], want=Want.NONE, num_draft=0))
            rows += [replace(s, token_ids=[t], start_pos=s.start_pos + first + j, num_draft=0)
                     for j, t in enumerate(s.token_ids[first:])]
        results = self._decode(rows) or self._forward(rows)
        out, at = [], 0
        for s in seqs:
            if not s.num_draft:
                out.append(results[at])
                at += 1
                continue
            at += len(s.token_ids) - 1 - s.num_draft > 0
            mine = results[at:at + 1 + s.num_draft]
            at += 1 + s.num_draft
            out.append(SeqResult(tokens=[r.tokens[0] for r in mine]) if s.want is Want.GREEDY
                       else SeqResult(logits=torch.cat([r.logits for r in mine])))
        return out

    def sample(self, results: list[SeqResult], states: list[SamplingState | None], drafts: list[list[int]],
               append: Append) -> None:
        """Gives each sequence that has a state its tokens of this step through `append` (None: it samples nothing
        this step): the proposed tokens it keeps, then one of its own (layers/verification.py), from the
        argmax the step took where it wanted one, else from its rows of logits by its sampling state."""
        rows = [r.logits if s is not None and r.tokens is None else None for r, s in zip(results, states, strict=True)]
        picks = [r.tokens if s is not None else None for r, s in zip(results, states, strict=True)]
        sample_and_verify(self.sampler, rows, picks, drafts, states, append)

    def _decode(self, seqs: list[ScheduledSeq]) -> list[SeqResult] | None:
        """`execute` of a step whose every sequence computes one token, through the fused kernel; None where the
        step is not one for it. At batch 1 every torch op costs ~0.1 ms here, run after the weight stream has
        flushed the caches, so this path has ~none."""
        if self.fused is None or not 0 < len(seqs) <= MAX_TOKENS or any(len(s.token_ids) != 1 for s in seqs):
            return None
        # A vision-language model's text token: M-RoPE at its position plus its sequence's offset, on every axis.
        if any(s.vision is not None and (s.vision.positions is not None or s.vision.images) for s in seqs):
            return None
        offsets = [s.vision.offset if s.vision else 0 for s in seqs] if any(s.vision for s in seqs) else None
        wants = [s.want for s in seqs]
        wants_logits, wants_pick = Want.LAST in wants or Want.ALL in wants, Want.GREEDY in wants
        step = self.fused([s.token_ids[0] for s in seqs], [s.start_pos for s in seqs],
                          [s.block_table for s in seqs], self.block_size, logits=wants_logits, argmax=wants_pick,
                          rope_offsets=offsets)
        logits, picks = step.logits, step.argmax
        if (wants_logits and logits is None) or (wants_pick and picks is None):  # no head bound
            with torch.inference_mode():
                logits = self.model.compute_logits(step.hidden[:len(seqs)])
                picks = greedy(logits).tolist() if wants_pick else None
        rows = None if logits is None else [logits] if len(seqs) == 1 else logits.split(1)
        out = []
        for i, want in enumerate(wants):
            if want in (Want.LAST, Want.ALL):
                out.append(SeqResult(logits=rows[i]))
            elif want is Want.GREEDY:
                out.append(SeqResult(tokens=[picks[i]]))
            else:
                out.append(SeqResult(hidden=step.hidden[i:i + 1].clone()) if want is Want.HIDDEN else SeqResult())
        return out

    def close(self) -> None:
        """Stops the micro-batch threads, if any."""
        if self.ubatch_pool is not None:
            self.ubatch_pool.close()

    def _forward(self, seqs: list[ScheduledSeq]) -> list[SeqResult]:
        """`execute` layer by layer, as one batch or as micro-batches."""
        rows = [_wanted_rows(seq) for seq in seqs]  # of each sequence's new tokens, those leaving the model
        # Only under micro-batching: a step of one rank pays nothing for it.
        eligible = self.ubatching.count > 1 and self.ubatching.count_for(seqs) > 1
        n = self._micro_batches(seqs, eligible)
        start = time.perf_counter()
        if n == 1:
            hidden = self._run(self._flatten(seqs))
        else:
            pieces = split_tokens(seqs, n)
            parts = self.ubatch_pool.run(lambda i: self._prepare(pieces[i]), lambda _i, batch: self._run(batch))
            hidden = torch.cat(parts)  # each piece's rows in order: those of the whole step
        out = self._results(seqs, rows, hidden)
        if eligible and self.gate is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            decode, tokens = _step_kind(seqs)
            self.gate.record(decode, tokens, n > 1, time.perf_counter() - start)
        return out

    def _micro_batches(self, seqs: list[ScheduledSeq], eligible: bool) -> int:
        """How many micro-batches the ranks agree to run this step as: all must want it (one small vote, which
        also checks that every rank runs a step of as many tokens)."""
        if self.ubatching.count == 1:
            return 1
        wants = eligible and self.overlap and (self.gate is None or self.gate.wants(*_step_kind(seqs)))
        tokens = sum(len(s.token_ids) for s in seqs)
        yes, total = self.group.sum_over_ranks([int(wants), tokens])
        if total != tokens * self.group.size:
            raise RuntimeError(f"rank {self.group.rank}: the ranks' steps differ ({tokens} tokens here, "
                               f"{total} over {self.group.size} ranks)")
        return self.ubatching.count if yes == self.group.size else 1

    def _prepare(self, seqs: list[ScheduledSeq]) -> FlatBatch:
        """A micro-batch's batch, built on its thread before the start."""
        if faults.fires(FaultPoint.UBATCH_STALL):  # a test's: a micro-batch that does not come
            logger.error("a micro-batch thread stalls on purpose (%s)", faults.FAULT_ENV)
            ubatch.current().aborted.wait(2 * self.ubatching.timeout_s)
        return self._flatten(seqs)

    def _flatten(self, seqs: list[ScheduledSeq]) -> FlatBatch:
        input_ids, positions, indices, needed = [], [], [], []
        for seq in seqs:
            end = seq.start_pos + len(seq.token_ids)
            indices.extend(cache_indices(seq.block_table, seq.start_pos, end, self.block_size))
            needed.extend(len(input_ids) + r for r in _wanted_rows(seq))
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, end))
        meta = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in seqs],
            seq_lens=[s.start_pos + len(s.token_ids) for s in seqs],
            cache_indices=self._tensor(indices),
            block_tables=[s.block_table for s in seqs],
            block_size=self.block_size,
            decode_mode=self.decode_mode,
            gather_limit=self.gather_limit,
            workspace=self.workspace,  # shared by micro-batches: one computes at a time, none yields in attention
        )
        # Only the rows asked for leave the model (row j of its output is token needed[j]).
        keep = self._tensor(needed) if len(needed) < len(input_ids) else None
        if any(seq.vision is not None for seq in seqs):
            vision_positions, visual = self._vision_positions(seqs)
            return FlatBatch(self._tensor(input_ids), vision_positions, meta, keep, visual)
        return FlatBatch(self._tensor(input_ids), self._tensor(positions), meta, keep)

    def _vision_positions(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, VisualRows | None]:
        """The M-RoPE positions of a vision-language model's batch ([3, tokens] where any sequence gives its own,
        else [tokens]) and its image tokens' rows."""
        spans, pieces, row = [], [], 0
        for seq in seqs:
            vision = seq.vision or SeqVision(None, 0, [])
            spans.append(vision.positions if vision.positions is not None
                         else torch.arange(seq.start_pos, seq.start_pos + len(seq.token_ids)) + vision.offset)
            pieces.extend((row + first, image, part) for first, image, part in vision.images)
            row += len(seq.token_ids)
        if any(span.dim() == 2 for span in spans):
            spans = [span.expand(3, -1) for span in spans]
        positions = torch.cat(spans, dim=-1).to(self.device)
        return positions, VisualRows.gather(pieces, self.device) if pieces else None

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def _run(self, batch: FlatBatch) -> torch.Tensor:
        if batch.visual is not None:
            return self.model(batch.input_ids, batch.positions, batch.meta, batch.keep, visual=batch.visual)
        return self.model(batch.input_ids, batch.positions, batch.meta, batch.keep)

    @torch.inference_mode()
    def _results(self, seqs: list[ScheduledSeq], rows: list[range], hidden: torch.Tensor) -> list[SeqResult]:
        """Per sequence what it wants, from the final hidden states of its `rows`."""
        starts = list(itertools.accumulate((len(r) for r in rows), initial=0))[:-1]  # of each row range in needed
        wanted = [j for seq, start, r in zip(seqs, starts, rows, strict=True) if seq.want is not Want.HIDDEN
                  for j in range(start, start + len(r))]
        # wanted: increasing rows of hidden, so as many as it has are all of them, in order.
        chosen = hidden if len(wanted) == len(hidden) else hidden[self._tensor(wanted)]
        logits = self.model.compute_logits(chosen) if wanted else None
        if wanted and logits is None:  # a worker rank: the driver has the logits
            return []
        out: list[SeqResult] = []
        offset = 0
        for seq, start, r in zip(seqs, starts, rows, strict=True):
            if seq.want is Want.HIDDEN:
                out.append(SeqResult(hidden=hidden[start:start + len(r)].float()))
            else:
                out.append(SeqResult(logits=logits[offset:offset + len(r)]) if len(r) else SeqResult())
                offset += len(r)
        picks = [i for i, seq in enumerate(seqs) if seq.want is Want.GREEDY]
        if picks:
            tokens = greedy(torch.cat([out[i].logits for i in picks])).tolist()
            at = 0
            for i in picks:
                n = len(out[i].logits)
                out[i] = SeqResult(tokens=tokens[at:at + n])
                at += n
        return out


def _step_kind(seqs: list[ScheduledSeq]) -> tuple[bool, int]:
    """Whether every sequence computes one token, and the step's tokens."""
    return all(len(s.token_ids) == 1 for s in seqs), sum(len(s.token_ids) for s in seqs)


def _wanted_rows(seq: ScheduledSeq) -> range:
    """Which of a sequence's new tokens leave the model for what it wants."""
    n = len(seq.token_ids)
    if seq.want in (Want.LAST, Want.GREEDY):
        return range(n - 1 - seq.num_draft, n)
    if seq.want is Want.HIDDEN:
        return range(n - 1, n)
    return range(n) if seq.want is Want.ALL else range(0)
