"""Qwen3-MoE (e.g. Qwen3-30B-A3B): the Qwen3 decoder (qwen.py) with sparse mixture-of-experts MLPs.

Each sparse layer's router picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token and
sums their outputs weighted by the router's probabilities. Layers in `mlp_only_layers`, or off the
`decoder_sparse_step` cadence, keep the dense MLP. Attention, norms and RoPE are Qwen3's (qwen.py).

Experts are separate modules, each the dense MLP, loaded from Hugging Face checkpoint names
(`mlp.experts.E.gate_proj.weight`): down_proj zero-copy from the memory-mapped file, gate and up copied
into the expert's merged gate/up projection. (That is also the layout transformers 5 writes with
save_pretrained, though it stacks experts in memory.)

Under tensor parallel each expert is split like the dense MLP and the layer sums the ranks' outputs once.
Under expert parallel each rank holds `num_experts / ranks` whole experts and a part of the step's tokens:
the tokens travel to their experts' ranks and back (distributed/expert_comm.py), and the ranks' parts are
gathered again for the next layer's attention. The router is on every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.config import ConfigError, ModelConfig
from slotserve.distributed.expert_comm import expert_exchange
from slotserve.distributed.group import SINGLE, UNSPLIT, ModelParallel
from slotserve.kernels import moe
from slotserve.kernels import native as native_kernels
from slotserve.layers.linear import FloatLinear
from slotserve.models.qwen import QwenForCausalLM, QwenMLP
from slotserve.parallel.cpu import torch_parfor

# The chosen experts run across the pool, one torch thread each, when they average at least this many
# rows ((token, expert) pairs) each; with fewer, one expert at a time on all of torch's threads is as fast
# or faster. Forward time pool / loop on the 2-core dev machine (2 threads; hidden 1024, moe_intermediate
# 768, top-8, 64 or 128 experts): 2-12 rows per expert 0.98-1.14, 16 rows 0.93-1.00, 24-64 rows 0.79-0.91.
POOL_MIN_ROWS = 16


def is_sparse_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    return (cfg.num_experts > 0 and layer_idx not in cfg.mlp_only_layers
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ModelParallel = UNSPLIT) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (
            cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.group = parallel.group
        self.gate = FloatLinear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router, on every rank
        # An expert is the dense SwiGLU MLP at the experts' (smaller) width: split by tensor parallel, or whole
        # on the rank that holds it (expert parallel). Keyed by the expert's number in the checkpoint.
        expert_cfg = replace(cfg, intermediate_size=cfg.moe_intermediate_size)
        self.exchange = (expert_exchange(parallel.expert_comm, self.group, cfg.num_experts)
                         if parallel.expert_parallel and self.group.size > 1 else None)
        if self.exchange is not None:
            mine = self.exchange.local_experts
            self.experts = nn.ModuleDict({str(e): QwenMLP(expert_cfg, SINGLE) for e in mine})
        else:
            mine = range(cfg.num_experts)
            self.experts = nn.ModuleDict({str(e): QwenMLP(expert_cfg, self.group, reduce=False) for e in mine})
        self.other_ranks_experts = [e for e in range(cfg.num_experts) if e not in mine]

    def foreign_tensors(self) -> list[str]:
        """The checkpoint's tensors of this layer that other ranks hold (names relative to it)."""
        return [f"experts.{e}.{proj}.weight" for e in self.other_ranks_experts
                for proj in ("gate_proj", "up_proj", "down_proj")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not len(x):  # no tokens (a step's last layer that outputs no row): nothing to route
            return torch.empty_like(x)
        logits = self.gate(x)
        native = moe.applies(logits) and native_kernels.takes(x)  # the fused decode step's own routing and sum
        if native:
            weights, experts = moe.route(logits, self.top_k, self.norm_topk_prob)
        else:  # routing in float32: in bf16, near-ties between experts would otherwise flip the choice
            weights, experts = F.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.exchange is not None:
            return self._expert_parallel(x, experts, weights)
        pairs = experts.flatten()
        order = pairs.argsort(stable=True)
        out = self._run_experts(x[order // self.top_k], pairs[order], self.num_experts)
        # Each token's weighted sum of its experts' outputs, found where they went (a scatter, index_add_, would
        # do it in one call, but on CPU it costs milliseconds even for tiny inputs).
        slot = order.argsort()
        if native:
            return self.group.all_reduce(moe.combine(out, weights, slot))
        out = out[slot].view(*experts.shape, -1)
        return self.group.all_reduce((out * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1))

    def _expert_parallel(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each rank routes its part of the tokens to the experts' ranks, computes what reaches its own
        experts, and gets its tokens' sums back; the parts are then gathered for every rank."""
        part = -(-len(x) // self.group.size)
        mine = slice(min(self.group.rank * part, len(x)), min((self.group.rank + 1) * part, len(x)))
        dispatched = self.exchange.start_dispatch(x[mine], experts[mine], weights[mine]).wait()
        order = dispatched.expert.argsort(stable=True)
        out = torch.empty_like(dispatched.x)
        out[order] = self._run_experts(dispatched.x[order], dispatched.expert[order], self.exchange.per_rank)
        y = self.exchange.start_combine(out, dispatched).wait()
        y = torch.nn.functional.pad(y, (0, 0, 0, part - len(y)))
        return self.group.all_gather(y)[:len(x)]

    def _run_experts(self, grouped: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int) -> torch.Tensor:
        """Each row of `grouped` (sorted by expert; `expert_of_row`: 0.. num_experts - 1 among this rank's
        experts) through its expert: one SwiGLU per chosen expert over its contiguous slice."""
        counts = torch.bincount(expert_of_row, minlength=num_experts).tolist()  # the one host sync
        out = torch.empty_like(grouped)
        # One job per chosen expert: its SwiGLU over its slice of `grouped`, into the same rows of `out`.
        # The slices are disjoint, so the jobs may run at once on any executors.
        jobs = [(expert, rows, dst) for expert, rows, dst
                in zip(self.experts.values(), grouped.split(counts), out.split(counts), strict=True) if len(rows)]

        def run_expert(_ctx: Any, j: int) -> None:
            expert, rows, dst = jobs[j]
            dst.copy_(expert(rows))

        if grouped.device.type == "cpu" and len(grouped) >= POOL_MIN_ROWS * len(jobs):
            torch_parfor(0, len(jobs), run_expert)
        else:
            for j in range(len(jobs)):
                run_expert(None, j)
        return out


def check_moe_config(cfg: ModelConfig) -> None:
    if cfg.num_experts > 0 and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ConfigError(f"config.json: num_experts_per_tok {cfg.num_experts_per_tok} must be "
                          f"between 1 and num_experts ({cfg.num_experts})")
    if cfg.num_experts > 0 and cfg.moe_intermediate_size < 1:
        raise ConfigError("config.json: a mixture-of-experts model needs 'moe_intermediate_size'")


def moe_mlp(cfg: ModelConfig, layer_idx: int, parallel: ModelParallel) -> nn.Module:
    return SparseMoeBlock(cfg, parallel) if is_sparse_layer(cfg, layer_idx) else QwenMLP(cfg, parallel.group)


class Qwen3MoeForCausalLM(QwenForCausalLM):
    """Qwen3 with sparse MoE MLPs; attention, norms, RoPE, the head and the interface are Qwen3's."""

    mlp_for_layer = staticmethod(moe_mlp)

    def __init__(self, cfg: ModelConfig, max_position: int | None = None,
                 parallel: ModelParallel = UNSPLIT) -> None:
        check_moe_config(cfg)
        super().__init__(cfg, max_position, parallel)
