"""Turns one step's scheduled sequences into a flat batch, runs the model, returns the logits wanted."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from slotserve import host_memory
from slotserve.config import ModelConfig
from slotserve.kernels import amx_gemm, rows, small_gemm
from slotserve.layers.attention import (
    Attention,
    AttentionMetadata,
    GatherWorkspace,
    gather_max_tokens,
    paged_decode_available,
)
from slotserve.layers.linear import Linear
from slotserve.layers.sampler import greedy
from slotserve.models.fused_decode import MAX_TOKENS, FusedDecode
from slotserve.models.loader import available_memory

log = logging.getLogger(__name__)

LOGITS_MODES = ("last", "all", "greedy", "hidden", "none")


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `token_ids` are computed at positions start_pos, start_pos+1, ..."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    # "last": next-token logits only; "all": every new position's; "greedy": the next token's argmax alone
    # (an int, the first index among ties: what the sampler's greedy rows take when nothing processes the
    # logits); "hidden": the last position's final hidden state (for pooling), no logits; "none"
    logits: str = "last"

    def __post_init__(self) -> None:
        if self.logits not in LOGITS_MODES:
            raise ValueError(f"logits: must be one of {LOGITS_MODES}, got {self.logits!r}")


def _pack_linears(linears: list[Linear]) -> list[amx_gemm.AmxWeight]:
    """Packs (amx_gemm.py) the linears whose weights allow it (layers/linear.py), unless their packed copies, kept
    beside the float32 weights, could take over half the memory still available; the packings."""
    need = amx_gemm.BYTES_PER_WEIGHT * sum(m.weight.numel() for m in linears)
    available = available_memory(torch.device("cpu")).available
    if need > available / 2:
        log.warning("weights not packed: packing the linears could take %.1f GiB of the %.1f GiB available",
                    need / 2**30, available / 2**30)
        return []
    with torch.inference_mode():
        return [m.amx for m in linears if m.bind_amx()]


class KVCacheFullError(RuntimeError):
    """A sequence's block table does not cover the positions it is asked to compute."""


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
        self.native_rows = cpu_fp32 and rows.available()
        # The linears whose weights are scale x bfloat16 per block run packed: on AMX where it is, and their
        # steps of a few rows on the vector units from bytes where GGUF's integers allow (layers/linear.py).
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        packed = _pack_linears(linears) if cpu_fp32 and amx_gemm.packs() else []
        self.linears, self.packed_linears = len(linears), len(packed)
        self.amx_linears = sum(p.max_rows > amx_gemm.FEW_ROWS for p in packed)  # the rest: few rows only
        self.gather_limit = gather_max_tokens(cfg.num_key_value_heads, cfg.head_dim, self.dtype)
        shape = (cfg.num_hidden_layers, num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = host_memory.zeros(shape, self.dtype, self.device)
        self.v_cache = host_memory.zeros(shape, self.dtype, self.device)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for i, attn in enumerate(layers):
            attn.k_cache, attn.v_cache = self.k_cache[i], self.v_cache[i]
        # Decode steps of a dense Qwen model through one native call (models/fused_decode.py), where it runs.
        self.fused = FusedDecode.bind(model) if self.decode_mode == "paged" and cpu_fp32 else None

    @staticmethod
    def cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem

    def execute(self, seqs: list[ScheduledSeq]) -> list[torch.Tensor | int | None]:
        """Runs one forward over all sequences' new tokens; per sequence, float32 logits [rows, vocab] (for
        "greedy", the next token's id; for "hidden", its last final hidden state [1, hidden_size])."""
        if (out := self._decode(seqs)) is not None:
            return out
        return self._forward(seqs)

    def _decode(self, seqs: list[ScheduledSeq]) -> list[torch.Tensor | int | None] | None:
        """`execute` of a step whose every sequence computes one token, through the fused kernel (rebound first
        where the model's layers were replaced); None where the step is not one for it. At batch 1 every torch
        op costs ~0.1 ms here, run after the weight stream has flushed the caches, so this path has ~none."""
        if self.fused is None or not 0 < len(seqs) <= MAX_TOKENS or any(len(s.token_ids) != 1 for s in seqs):
            return None
        block_size = self.block_size
        for seq in seqs:
            if seq.start_pos >= len(seq.block_table) * block_size:
                raise KVCacheFullError(f"block table of {len(seq.block_table)} blocks cannot hold "
                                       f"{seq.start_pos + 1} tokens")
        if not self.fused.current():
            self.fused = FusedDecode.bind(self.model)
        modes = [s.logits for s in seqs]
        wants_logits, wants_pick = "last" in modes or "all" in modes, "greedy" in modes
        step = self.fused([s.token_ids[0] for s in seqs], [s.start_pos for s in seqs],
                          [s.block_table for s in seqs], block_size, logits=wants_logits, argmax=wants_pick)
        logits, picks = step.logits, step.argmax
        if (wants_logits and logits is None) or (wants_pick and picks is None):  # no head bound
            with torch.inference_mode():
                logits = self.model.compute_logits(step.hidden[:len(seqs)])
                picks = greedy(logits).tolist() if wants_pick else None
        rows = None if logits is None else [logits] if len(seqs) == 1 else logits.split(1)
        return [rows[i] if mode in ("last", "all") else picks[i] if mode == "greedy"
                else step.hidden[i:i + 1].clone() if mode == "hidden" else None for i, mode in enumerate(modes)]

    @torch.inference_mode()
    def _forward(self, seqs: list[ScheduledSeq]) -> list[torch.Tensor | int | None]:
        """`execute` layer by layer."""
        input_ids, positions, slots, rows = [], [], [], []
        for seq in seqs:
            n, end = len(seq.token_ids), seq.start_pos + len(seq.token_ids)
            if end > len(seq.block_table) * self.block_size:
                raise KVCacheFullError(
                    f"block table of {len(seq.block_table)} blocks cannot hold {end} tokens")
            base = len(input_ids)
            input_ids.extend(seq.token_ids)
            for pos in range(seq.start_pos, end):
                positions.append(pos)
                slots.append(seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
            if seq.logits in ("last", "greedy", "hidden"):
                rows.append(range(base + n - 1, base + n))
            elif seq.logits == "all":
                rows.append(range(base, base + n))
            else:
                rows.append(range(0))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        meta = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in seqs],
            seq_lens=[s.start_pos + len(s.token_ids) for s in seqs],
            slot_mapping=as_tensor(slots),
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
        wanted = [j for seq, start, r in zip(seqs, starts, rows, strict=True) if seq.logits != "hidden"
                  for j in range(start, start + len(r))]
        # wanted: increasing rows of hidden, so as many as it has are all of them, in order.
        chosen = hidden if len(wanted) == len(hidden) else hidden[as_tensor(wanted)]
        logits = self.model.compute_logits(chosen) if wanted else None
        out: list[torch.Tensor | int | None] = []
        offset = 0
        for seq, start, r in zip(seqs, starts, rows, strict=True):
            if seq.logits == "hidden":
                out.append(hidden[start:start + len(r)].float())
            else:
                out.append(logits[offset:offset + len(r)] if len(r) else None)
                offset += len(r)
        picks = [i for i, seq in enumerate(seqs) if seq.logits == "greedy"]
        if picks:
            for i, token in zip(picks, greedy(torch.cat([out[i] for i in picks])).tolist(), strict=True):
                out[i] = token
        return out
