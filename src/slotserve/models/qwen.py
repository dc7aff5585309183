"""The dense Qwen decoder (GQA, SwiGLU, RMSNorm, RoPE) over a flat batch of tokens: Qwen2 / Qwen2.5 and Qwen3.

The two are one network with three switches that `ModelConfig` carries: Qwen2 adds a bias to q, k and v
(`attention_bias`); Qwen3 has none, normalizes each q and k head (`qk_norm`) and sets its own `head_dim`.
So both architectures are `QwenForCausalLM` (models/registry.py), and Qwen3-MoE is it with sparse MLPs
(qwen3_moe.py).

Under tensor parallel (`ModelParallel`) each rank builds its part: its query heads and KV heads (q, k, v
column parallel), its share of the MLP's width (gate and up column parallel), o_proj and down row parallel
with their outputs summed over the ranks, and its rows of the vocabulary (layers/embedding.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from slotserve.config import ModelConfig
from slotserve.distributed.group import SINGLE, UNSPLIT, ModelParallel, RankGroup
from slotserve.layers.activation import silu_mul
from slotserve.layers.attention import Attention, AttentionMetadata, kv_head_shard
from slotserve.layers.embedding import VocabEmbedding, gather_logits, lm_head, tie
from slotserve.layers.linear import Linear, MergedLinear, Shard
from slotserve.layers.norm import RMSNorm
from slotserve.layers.rotary import RotaryEmbedding, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin per token
# (config, layer index, how the model is split) -> that layer's MLP
MlpFactory = Callable[[ModelConfig, int, ModelParallel], nn.Module]


def head_rows(heads: Shard, head_dim: int) -> Shard | None:
    """The weight rows of these heads (None: a shard that is all of them)."""
    if heads.size == heads.full:
        return None
    return Shard(0, heads.start * head_dim, heads.stop * head_dim, heads.full * head_dim)


class QwenAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: RankGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        if cfg.num_attention_heads % tp.size:
            raise ValueError(f"tensor_parallel_size: {tp.size} ranks cannot split {cfg.num_attention_heads} "
                             "attention heads")
        q_heads = Shard.of(0, cfg.num_attention_heads, tp.rank, tp.size)
        kv_heads = kv_head_shard(cfg.num_key_value_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads, self.head_dim = q_heads.size, kv_heads.size, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        kv_rows = head_rows(kv_heads, self.head_dim)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                     ("q_proj", "k_proj", "v_proj"), bias=cfg.attention_bias,
                                     part_shards=[head_rows(q_heads, self.head_dim), kv_rows, kv_rows])
        self.o_proj = Linear.row_parallel(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, tp.rank, tp.size)
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
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


# On the CPU a long prefill's MLP runs this many rows at a time: MKL's GEMM rate on these shapes falls by
# about a quarter past ~512 rows, and the gate/up output of a smaller piece is still cached when SwiGLU
# reads it.
MLP_ROWS = 512


class QwenMLP(nn.Module):
    """SwiGLU. Under tensor parallel, this rank's share of the width; `reduce`: sum the ranks' outputs here
    (a MoE layer's experts leave it to the layer, which sums once for all of them)."""

    def __init__(self, cfg: ModelConfig, tp: RankGroup = SINGLE, reduce: bool = True) -> None:
        super().__init__()
        self.tp, self.reduce = tp, reduce
        width = Shard.of(0, cfg.intermediate_size, tp.rank, tp.size)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [width.size] * 2, ("gate_proj", "up_proj"), bias=False,
                                         part_shards=[width, width] if tp.size > 1 else None)
        self.down_proj = Linear.row_parallel(cfg.intermediate_size, cfg.hidden_size, tp.rank, tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[0] > MLP_ROWS:
            return torch.cat([self.forward(part) for part in x.split(MLP_ROWS)])
        out = self.down_proj(silu_mul(self.gate_up_proj(x)))
        return self.tp.all_reduce(out) if self.reduce else out


def dense_mlp(cfg: ModelConfig, layer_idx: int, parallel: ModelParallel) -> nn.Module:
    return QwenMLP(cfg, parallel.group)


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module, tp: RankGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QwenAttention(cfg, tp)
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
    def __init__(self, cfg: ModelConfig, max_position: int, mlp_for_layer: MlpFactory = dense_mlp,
                 parallel: ModelParallel = UNSPLIT) -> None:
        super().__init__()
        tp = parallel.group
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg, mlp_for_layer(cfg, i, parallel), tp)
                                    for i in range(cfg.num_hidden_layers))
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

    def __init__(self, cfg: ModelConfig, max_position: int | None = None,
                 parallel: ModelParallel = UNSPLIT) -> None:
        super().__init__()
        self.config, self.parallel = cfg, parallel
        self.model = QwenModel(cfg, max(max_position or 0, cfg.max_position_embeddings), self.mlp_for_layer,
                               parallel)
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size, parallel.group)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Shares the embedding with the output head when the config says so (again after loading)."""
        if self.config.tie_word_embeddings:
            tie(self.lm_head, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, keep)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab] on the driver rank; None on the others (tensor parallel)."""
        return gather_logits(self.lm_head(hidden), self.parallel.group, self.config.vocab_size)


class QwenForEmbedding(nn.Module):
    """The bare decoder of a Qwen2Model / Qwen3Model checkpoint (e.g. Qwen3-Embedding): hidden states
    out, no output head. Its checkpoints name tensors without the `model.` prefix; the loader maps them."""

    def __init__(self, cfg: ModelConfig, max_position: int | None = None,
                 parallel: ModelParallel = UNSPLIT) -> None:
        super().__init__()
        self.config, self.parallel = cfg, parallel
        self.model = QwenModel(cfg, max(max_position or 0, cfg.max_position_embeddings), parallel=parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, keep)

    def tie_weights(self) -> None:
        pass
