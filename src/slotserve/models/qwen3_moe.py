"""Qwen3-MoE (e.g. Qwen3-30B-A3B): the Qwen3 decoder with sparse mixture-of-experts MLPs.

Each sparse layer's router picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token and
sums their outputs weighted by the router's probabilities. Layers in `mlp_only_layers`, or off the
`decoder_sparse_step` cadence, keep the dense MLP. Attention, norms and RoPE are Qwen3's (qwen2.py).

Experts are separate modules named as in Hugging Face checkpoints (`mlp.experts.E.gate_proj.weight`),
so every expert tensor loads zero-copy from the memory-mapped file like any dense weight. (That is
also the layout transformers 5 writes with save_pretrained, though it stacks experts in memory.)
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.config import ConfigError, ModelConfig
from slotserve.layers.attention import AttentionMetadata
from slotserve.layers.norm import RMSNorm
from slotserve.layers.rotary import RotaryEmbedding
from slotserve.models.qwen2 import Embedding, QwenAttention, QwenMLP, Rope


def is_sparse_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    return (cfg.num_experts > 0 and layer_idx not in cfg.mlp_only_layers
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (
            cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        # An expert is the dense SwiGLU MLP at the experts' (smaller) width.
        expert_cfg = replace(cfg, intermediate_size=cfg.moe_intermediate_size)
        self.experts = nn.ModuleList(QwenMLP(expert_cfg) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Routing in float32: in bf16, near-ties between experts would otherwise flip the choice.
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [tokens, top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)

        # Sort the tokens * top_k (token, expert) pairs by expert, so that each chosen expert runs one
        # SwiGLU over a contiguous slice holding all of its tokens.
        pairs = experts.flatten()
        order = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=self.num_experts).tolist()  # the one host sync
        grouped = x[order // self.top_k]
        out = torch.cat([self.experts[e](rows) for e, rows in enumerate(grouped.split(counts)) if len(rows)])
        # Back to (token, rank) order, then each token's weighted sum of its experts' outputs. A scatter
        # (index_add_) would do both in one call, but on CPU it costs milliseconds even for tiny inputs.
        out = out[order.argsort()].view(*experts.shape, -1)
        return (out * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QwenAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg) if is_sparse_layer(cfg, layer_idx) else QwenMLP(cfg)

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        for layer in self.layers:
            x = layer(rope, x, meta)
        return self.norm(x)


class Qwen3MoeForCausalLM(nn.Module):
    """The same interface as Qwen2ForCausalLM: hidden states for a flat batch, then logits for the
    rows that sample."""

    def __init__(self, cfg: ModelConfig, max_position: int | None = None) -> None:
        super().__init__()
        if cfg.num_experts > 0 and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ConfigError(f"config.json: num_experts_per_tok {cfg.num_experts_per_tok} must be "
                              f"between 1 and num_experts ({cfg.num_experts})")
        if cfg.num_experts > 0 and cfg.moe_intermediate_size < 1:
            raise ConfigError("config.json: a mixture-of-experts model needs 'moe_intermediate_size'")
        self.config = cfg
        self.model = Qwen3MoeModel(cfg, max(max_position or 0, cfg.max_position_embeddings))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
