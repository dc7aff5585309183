"""The dense Qwen decoder (GQA, SwiGLU, RMSNorm, RoPE) over a flat batch of tokens: Qwen2 / Qwen2.5 and Qwen3.

The two are one network with three switches that `ModelConfig` carries: Qwen2 adds a bias to q, k and v
(`attention_bias`); Qwen3 has none, normalizes each q and k head (`qk_norm`) and sets its own `head_dim`.
So both architectures are `QwenForCausalLM` (models/registry.py), and Qwen3-MoE is it with sparse MLPs
(qwen3_moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.config import ModelConfig
from slotserve.layers.activation import silu_mul
from slotserve.layers.attention import Attention, AttentionMetadata
from slotserve.layers.linear import Linear, MergedLinear
from slotserve.layers.norm import RMSNorm
from slotserve.layers.rotary import RotaryEmbedding, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin per token
MlpFactory = Callable[[ModelConfig, int], nn.Module]  # (config, layer index) -> that layer's MLP


class Embedding(nn.Module):
    """A token embedding without random initialisation (nn.Embedding's costs seconds at vocab 152k)."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class QwenAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                     ("q_proj", "k_proj", "v_proj"), bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, heads + kv_heads, head_dim)  # q's heads, then k's, side by side in each row
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads].contiguous()), self.k_norm(qk[:, heads:].contiguous())), dim=1)
        q, k = apply_rotary(qk, *rope).split([heads, kv_heads], dim=1)  # both rotated in one call
        out = self.attn(q, k, v.view(-1, kv_heads, head_dim), meta)
        return self.o_proj(out.reshape(-1, self.q_size))


# On the CPU a long prefill's MLP runs this many rows at a time: MKL's GEMM rate falls past ~512 rows of
# these shapes (the default model's gate/up at 1024 rows: 227 vs 297 GFLOP/s at 512), and the gate/up
# output of a smaller piece is still cached when SwiGLU reads it. 1024 rows: 114 vs 125 ms per layer.
MLP_ROWS = 512


class QwenMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, ("gate_proj", "up_proj"),
                                         bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[0] > MLP_ROWS:
            return torch.cat([self.forward(part) for part in x.split(MLP_ROWS)])
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


def dense_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    return QwenMLP(cfg)


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QwenAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the add is fused into
        this layer's first norm); returns this layer's output and the stream, for the rows `keep` only where
        given (every row's keys and values are cached all the same)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(rope, x, meta), residual)
        if keep is not None:
            x, residual = x[keep], residual[keep]
        return self.mlp(x), residual


class QwenModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, mlp_for_layer: MlpFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg, mlp_for_layer(cfg, i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every token, or of the rows `keep` only: no later layer reads the last
        one's MLP, so it runs for those rows alone (1/24 of a prefill's linear FLOPs on the default model)."""
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions)
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual, meta, keep if i == len(self.layers) - 1 else None)
        return self.norm.add_and_norm(x, residual)[0]


class QwenForCausalLM(nn.Module):
    """Qwen2ForCausalLM and Qwen3ForCausalLM. Input: a flat batch of token ids with their positions; output:
    hidden states, then logits for only the rows that sample."""

    # Each layer's MLP: dense here; Qwen3-MoE swaps in its sparse blocks (qwen3_moe.py).
    mlp_for_layer: ClassVar[MlpFactory] = staticmethod(dense_mlp)

    def __init__(self, cfg: ModelConfig, max_position: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = QwenModel(cfg, max(max_position or 0, cfg.max_position_embeddings), self.mlp_for_layer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Shares the embedding with the output head when the config says so (again after loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, keep)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class QwenForEmbedding(nn.Module):
    """The bare decoder of a Qwen2Model / Qwen3Model checkpoint (e.g. Qwen3-Embedding): hidden states
    out, no output head. Its checkpoints name tensors without the `model.` prefix; the loader maps them."""

    def __init__(self, cfg: ModelConfig, max_position: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = QwenModel(cfg, max(max_position or 0, cfg.max_position_embeddings))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, keep)

    def tie_weights(self) -> None:
        pass
