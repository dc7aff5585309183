"""Turns one step's scheduled sequences into a flat batch, runs the model, returns what each sequence wants."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from slotserve import host_memory
from slotserve.config import ModelConfig
from slotserve.distributed.group import UNSPLIT
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
from slotserve.layers.sampler import greedy
from slotserve.models.fused_decode import MAX_TOKENS, FusedDecode
from slotserve.models.packing import pack_linears


class Want(enum.Enum):
    """What a step gives back for one scheduled sequence (in its `SeqResult`)."""

    LAST = "last"  # the logits of its last new position: `logits` [1, vocab]
    ALL = "all"  # the logits of every new position: `logits` [new tokens, vocab]
    # The argmax of its last position's logits alone, `token`: the first index among ties, what the sampler's
    # greedy rows take when nothing processes the logits.
    GREEDY = "greedy"
    HIDDEN = "hidden"  # its last position's final hidden state, for pooling: `hidden` [1, hidden_size]
    NONE = "none"  # nothing: a prompt chunk before its last


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `token_ids` are computed at positions start_pos, start_pos+1, ..."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    want: Want = Want.LAST

    def __post_init__(self) -> None:
        if not isinstance(self.want, Want):
            raise TypeError(f"want: must be a Want, got {self.want!r}")


@dataclass(frozen=True)
class SeqResult:
    """What a step gave for one sequence: the field its `Want` names (float32), the others None."""

    logits: torch.Tensor | None = None
    token: int | None = None
    hidden: torch.Tensor | None = None


class ModelRunner:
    """Owns the model and its paged KV cache; stateless across steps beyond the cache contents."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 decode_mode: str | None = None) -> None:
        """decode_mode: how decode rows read the cache (layers/attention.py); None: "paged" where the CPU
        kernel runs, else "batched"."""
        self.model, self.cfg = model, cfg
        self.block_size, self.num_blocks = block_size, num_blocks
        self.workspace = GatherWorkspace()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.decode_mode = decode_mode or ("paged" if paged_decode_available(self.device, self.dtype) else "batched")
        # Build the native kernels (layers/linear.py, norm.py, rotary.py) now, not in the middle of a step.
        cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
        self.native_gemm = cpu_fp32 and small_gemm.available()
        self.native_row_ops = cpu_fp32 and norm_rotary_swiglu_argmax.available()
        self.packing_report = pack_linears(model)  # which linears run packed (models/packing.py)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        kv_heads = layers[0].num_kv_heads  # this rank's, under tensor parallel
        self.gather_limit = gather_max_tokens(kv_heads, cfg.head_dim, self.dtype)
        shape = (cfg.num_hidden_layers, num_blocks * block_size, kv_heads, cfg.head_dim)
        self.k_cache = host_memory.zeros(shape, self.dtype, self.device)
        self.v_cache = host_memory.zeros(shape, self.dtype, self.device)
        for i, attn in enumerate(layers):
            attn.k_cache, attn.v_cache = self.k_cache[i], self.v_cache[i]
        # Decode steps of a dense Qwen model through one native call (models/fused_decode.py), where it runs:
        # not under tensor parallel, whose collectives sit between the layers.
        parallel = getattr(model, "parallel", UNSPLIT)
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
        if (out := self._decode(seqs)) is not None:
            return out
        return self._forward(seqs)

    def _decode(self, seqs: list[ScheduledSeq]) -> list[SeqResult] | None:
        """`execute` of a step whose every sequence computes one token, through the fused kernel; None where the
        step is not one for it. At batch 1 every torch op costs ~0.1 ms here, run after the weight stream has
        flushed the caches, so this path has ~none."""
        if self.fused is None or not 0 < len(seqs) <= MAX_TOKENS or any(len(s.token_ids) != 1 for s in seqs):
            return None
        wants = [s.want for s in seqs]
        wants_logits, wants_pick = Want.LAST in wants or Want.ALL in wants, Want.GREEDY in wants
        step = self.fused([s.token_ids[0] for s in seqs], [s.start_pos for s in seqs],
                          [s.block_table for s in seqs], self.block_size, logits=wants_logits, argmax=wants_pick)
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
                out.append(SeqResult(token=picks[i]))
            else:
                out.append(SeqResult(hidden=step.hidden[i:i + 1].clone()) if want is Want.HIDDEN else SeqResult())
        return out

    @torch.inference_mode()
    def _forward(self, seqs: list[ScheduledSeq]) -> list[SeqResult]:
        """`execute` layer by layer."""
        input_ids, positions, indices, rows = [], [], [], []
        for seq in seqs:
            n, end = len(seq.token_ids), seq.start_pos + len(seq.token_ids)
            indices.extend(cache_indices(seq.block_table, seq.start_pos, end, self.block_size))
            base = len(input_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, end))
            if seq.want in (Want.LAST, Want.GREEDY, Want.HIDDEN):
                rows.append(range(base + n - 1, base + n))
            elif seq.want is Want.ALL:
                rows.append(range(base, base + n))
            else:
                rows.append(range(0))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        meta = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in seqs],
            seq_lens=[s.start_pos + len(s.token_ids) for s in seqs],
            cache_indices=as_tensor(indices),
            block_tables=[s.block_table for s in seqs],
            block_size=self.block_size,
            decode_mode=self.decode_mode,
            gather_limit=self.gather_limit,
            workspace=self.workspace,
        )
        # Only the rows asked for leave the model (row j of `hidden` is token needed[j]).
        needed = [i for r in rows for i in r]
        keep = as_tensor(needed) if len(needed) < len(input_ids) else None
        hidden = self.model(as_tensor(input_ids), as_tensor(positions), meta, keep)
        starts = list(itertools.accumulate((len(r) for r in rows), initial=0))[:-1]  # of each row range in needed
        wanted = [j for seq, start, r in zip(seqs, starts, rows, strict=True) if seq.want is not Want.HIDDEN
                  for j in range(start, start + len(r))]
        # wanted: increasing rows of hidden, so as many as it has are all of them, in order.
        chosen = hidden if len(wanted) == len(hidden) else hidden[as_tensor(wanted)]
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
            for i, token in zip(picks, greedy(torch.cat([out[i].logits for i in picks])).tolist(), strict=True):
                out[i] = SeqResult(token=token)
        return out
