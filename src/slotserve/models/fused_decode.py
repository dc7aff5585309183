"""A CPU decode step of a Qwen model, from its token embedding to its final norm, in one native call.

The model runner sends here every step whose sequences each compute one token, at most MAX_TOKENS of them (the small
GEMM's rows), of a model this binds to: a Qwen model (qwen.py), dense or with Qwen3-MoE's mixture-of-experts layers
(qwen3_moe.py), with float32 weights on the CPU, and the native kernels built. Every other step, and every model it
cannot run (int8 linears, other devices or dtypes), takes the layer-by-layer path. Why: at batch 1 the GEMMs stream
the weights at the machine's read rate, and what is left is the Python between them, ~10 calls a layer, each run in
caches the last weight stream flushed; kernels/decode_layers.c runs all the layers in one call, with the same
kernels in the same order, so a row gets exactly the bits the layer-by-layer path gives it (a test checks). The step
comes straight as lists, without the layer path's tensors and attention metadata.

Within the call each linear dispatches as layers/linear.py does (a packing for the rows it runs:
`PackedWeight.runs`, else the small GEMM); the output head runs there too where the kernel can run it (`_head`), and
so does each row's argmax where the runner asks for it (Want.GREEDY)."""

from __future__ import annotations

import array
import ctypes
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from slotserve.kernels import decode_layers
from slotserve.kernels.packing import Packing
from slotserve.kv_cache.block_table import cache_index, padded_tables
from slotserve.layers.linear import NATIVE_ROWS, Linear
from slotserve.models.qwen import QwenDecoderLayer, QwenMLP, QwenModel
from slotserve.models.qwen3_moe import SparseMoeBlock
from slotserve.quantization.packed_linear import PackedWeight

MAX_TOKENS = NATIVE_ROWS.stop - 1


def _mlp(layer: QwenDecoderLayer) -> QwenMLP | None:
    """The layer's dense MLP (None: a mixture of experts)."""
    return layer.mlp if type(layer.mlp) is QwenMLP else None


def _layer_tensors(layer: QwenDecoderLayer) -> list[torch.Tensor | None]:
    """The tensors decode_layers.c reads for this layer, in `Layer`'s field order (None: absent)."""
    attn, mlp = layer.self_attn, _mlp(layer)
    gate_up, down = (None, None) if mlp is None else (mlp.gate_up_proj.weight, mlp.down_proj.weight)
    return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
            None if attn.q_norm is None else attn.q_norm.weight, None if attn.k_norm is None else attn.k_norm.weight,
            attn.o_proj.weight, layer.post_attention_layernorm.weight, gate_up, down, attn.attn.k_cache,
            attn.attn.v_cache]


def _layer_packed(layer: QwenDecoderLayer) -> list[PackedWeight | None]:
    """The packings of the layer's qkv, o, gate/up and down weights, where they are current (None: not)."""
    attn, mlp = layer.self_attn, _mlp(layer)
    linears = [attn.qkv_proj, attn.o_proj] + ([None, None] if mlp is None else [mlp.gate_up_proj, mlp.down_proj])
    return [None if m is None else m.current_packed() for m in linears]


def _float_cpu(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() > 0)


def _linears_runnable(linears: list[nn.Module]) -> bool:
    """Float32 CPU linears without a bias, each run by its packing or the small GEMM as layers/linear.py would."""
    return all(isinstance(m, Linear) and m.bias is None and _float_cpu(m.weight)
               and (m.weight is not None or m.packed.max_rows >= MAX_TOKENS) for m in linears)


def _mixture_runnable(mlp: SparseMoeBlock) -> bool:
    """Whether the kernel computes this mixture of experts as qwen3_moe.py does: every expert here (no expert
    parallel), each a dense SwiGLU, the router a float32 weight."""
    experts = list(mlp.experts.values())
    return (mlp.exchange is None and mlp.group.size == 1 and len(experts) == mlp.num_experts
            and all(type(e) is QwenMLP for e in experts) and isinstance(mlp.gate, Linear) and mlp.gate.bias is None
            and mlp.gate.weight is not None and _float_cpu(mlp.gate.weight)
            and _linears_runnable([m for e in experts for m in (e.gate_up_proj, e.down_proj)]))


def _runnable(layer: QwenDecoderLayer) -> bool:
    """Whether the kernel computes this layer as qwen.py does: a dense MLP or Qwen3-MoE's experts, float32
    linears without the biases it has no place for, one eps for every norm, and everything dense on the CPU."""
    attn, mlp = layer.self_attn, _mlp(layer)
    if mlp is None and not (type(layer.mlp) is SparseMoeBlock and _mixture_runnable(layer.mlp)):
        return False
    linears = [attn.o_proj] + ([mlp.gate_up_proj, mlp.down_proj] if mlp else [])
    qkv = attn.qkv_proj
    if not _linears_runnable(linears) or not isinstance(qkv, Linear) or not (
            qkv.weight is not None or qkv.packed.max_rows >= MAX_TOKENS):
        return False
    norms = (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm)
    return len({n.eps for n in norms if n is not None}) == 1 and all(_float_cpu(t) for t in _layer_tensors(layer))


class _Experts:
    """A mixture-of-experts layer's parts as decode_layers.c's Layer points to them: its experts' weights and
    packings in [experts] arrays, held here (with the packings) so the pointers stay valid."""

    def __init__(self, mlp: SparseMoeBlock) -> None:
        experts = list(mlp.experts.values())
        self.mlp = mlp
        self.packed = [[e.gate_up_proj.current_packed(), e.down_proj.current_packed()] for e in experts]
        self.weights = [(e.gate_up_proj.weight, e.down_proj.weight) for e in experts]
        pointers = ctypes.c_void_p * len(experts)
        self.gate_up = pointers(*(None if w is None else w.data_ptr() for w, _ in self.weights))
        self.down = pointers(*(None if w is None else w.data_ptr() for _, w in self.weights))
        packings = Packing * len(experts)
        self.gate_up_packed = packings(*(Packing() if p is None else p.packing for p, _ in self.packed))
        self.down_packed = packings(*(Packing() if p is None else p.packing for _, p in self.packed))
        self.intermediate = experts[0].down_proj.in_features

    def fill(self, layer: decode_layers.Layer) -> None:
        mlp = self.mlp
        layer.experts, layer.top_k, layer.expert_intermediate = mlp.num_experts, mlp.top_k, self.intermediate
        layer.renormalize, layer.router = int(mlp.norm_topk_prob), mlp.gate.weight.data_ptr()
        layer.expert_gate_up, layer.expert_down = ctypes.addressof(self.gate_up), ctypes.addressof(self.down)
        layer.expert_gate_up_packed = ctypes.addressof(self.gate_up_packed)
        layer.expert_down_packed = ctypes.addressof(self.down_packed)


@dataclass
class FusedStep:
    """What a fused decode step gives: its rows' final hidden states (rows :tokens of a buffer the next step
    overwrites), their logits [tokens, vocab] and their argmax, where asked (else None)."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    argmax: list[int] | None


def _head(model: nn.Module) -> Linear | None:
    """The model's output head (`lm_head`, whose output its compute_logits gives) where the kernel can run it."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, Linear) or (head.weight is None and head.packed.max_rows < MAX_TOKENS):
        return None
    return head if all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
                       for t in (head.weight, head.bias)) else None


def _decoder(model: nn.Module) -> QwenModel | None:
    """The model's Qwen decoder: `model.model`, or a vision-language model's `model.model.language_model` (whose
    text tokens' M-RoPE is plain RoPE at their position: the caller passes those)."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    return inner if isinstance(inner, QwenModel) else None


def _intermediate(layers: nn.ModuleList) -> int | None:
    """The step's MLP width: the dense layers' (None where they differ, or are narrower than an expert, which
    the kernel's scratch for them serves too), else the experts'."""
    dense = {mlp.down_proj.in_features for layer in layers if (mlp := _mlp(layer)) is not None}
    experts = {e.down_proj.in_features for layer in layers if _mlp(layer) is None for e in layer.mlp.experts.values()}
    if len(dense) > 1 or (dense and experts and min(dense) < max(experts)):
        return None
    return next(iter(dense)) if dense else max(experts)


def _vocab_rows(embedding: nn.Module) -> int:
    return embedding.packed.n if embedding.weight is None else embedding.weight.shape[0]


class FusedDecode:
    """The decode steps of one bound model. Built by `bind`."""

    def __init__(self, outer: nn.Module, tensors: list[list[torch.Tensor | None]],
                 packed: list[list[PackedWeight | None]], head: Linear | None) -> None:
        model = _decoder(outer)
        # Held as well as pointed to: the kernel reads raw pointers. A model changed since is bound anew
        # (ModelRunner.rebind); until then the step keeps computing with what it holds.
        self.tensors, self.packed = tensors, packed
        self.head, self.head_packed = head, None if head is None else head.current_packed()
        self.embedding, self.final_norm = model.embed_tokens, model.norm.weight
        self.layers = (decode_layers.Layer * len(tensors))(*(
            decode_layers.Layer(*(None if t is None else t.data_ptr() for t in ts),
                                *(Packing() if p is None else p.packing for p in layer_packed))
            for ts, layer_packed in zip(tensors, packed, strict=True)))
        self.experts = {i: _Experts(layer.mlp) for i, layer in enumerate(model.layers) if _mlp(layer) is None}
        for i, experts in self.experts.items():
            experts.fill(self.layers[i])
        first = model.layers[0].self_attn
        hidden, self.cache_entries = model.norm.weight.shape[0], first.attn.k_cache.shape[0]
        intermediate = _intermediate(model.layers)
        heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        experts = max((e.mlp.num_experts for e in self.experts.values()), default=0)
        top_k = max((e.mlp.top_k for e in self.experts.values()), default=0)
        self.cos, self.sin = model.rotary.tables(self.final_norm.device)
        self.scratch = torch.empty(decode_layers.scratch_floats(MAX_TOKENS, hidden, intermediate, heads, kv_heads,
                                                                head_dim, experts, top_k))
        # Each step's final hidden states land in x: valid until the next step.
        self.x, self.residual = torch.empty(MAX_TOKENS, hidden), torch.empty(MAX_TOKENS, hidden)
        self.x_at, self.residual_at = self.x.data_ptr(), self.residual.data_ptr()
        self.head_scratch = torch.empty(0)
        self.argmax_ids = array.array("q", bytes(8 * MAX_TOKENS))
        self.argmax_at = self.argmax_ids.buffer_info()[0]
        # The step's shapes and tensors; each call fills in its rows' integers and where the logits go.
        self.step = decode_layers.Step(
            hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            cache_entries=self.cache_entries, vocab=_vocab_rows(self.embedding), max_position=self.cos.shape[0],
            eps=model.layers[0].input_layernorm.eps, scale=first.attn.scale,
            embedding=None if self.embedding.weight is None else self.embedding.weight.data_ptr(),
            cos_table=self.cos.data_ptr(), sin_table=self.sin.data_ptr(), final_norm=self.final_norm.data_ptr(),
            scratch=self.scratch.data_ptr())
        if head is not None:
            self.step.head = None if head.weight is None else head.weight.data_ptr()
            self.step.head_rows = head.out_features
            self.step.head_bias = None if head.bias is None else head.bias.data_ptr()
            self.step.head_packed = Packing() if self.head_packed is None else self.head_packed.packing

    @classmethod
    def bind(cls, model: nn.Module) -> FusedDecode | None:
        """For a Qwen model (QwenForCausalLM and kin, Qwen3-MoE's and Qwen3-VL's: `_decoder`) whose layers the
        kernel can run, with the KV caches attached; None otherwise. Its output head runs in the same call
        where the kernel can run it (`_head`)."""
        inner = _decoder(model)
        if inner is None or not inner.layers or not decode_layers.available():
            return None
        if not all(_runnable(layer) for layer in inner.layers) or _intermediate(inner.layers) is None or not all(
                t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
                for t in (inner.embed_tokens.weight, inner.norm.weight)):
            return None
        layers = inner.layers
        return cls(model, [_layer_tensors(layer) for layer in layers], [_layer_packed(layer) for layer in layers],
                   _head(model))

    def __call__(self, ids: list[int], positions: list[int], tables: list[list[int]], block_size: int,
                 logits: bool = True, argmax: bool = False, rope_offsets: list[int] | None = None) -> FusedStep:
        """A decode step (at most MAX_TOKENS rows): row i is token ids[i] at positions[i] of the sequence whose
        cache blocks are tables[i], its key and value written to that position's cache index (BlockTableError
        where a table does not hold its position or names a block outside the cache), rotated as at position
        positions[i] + rope_offsets[i] (a vision-language model's text after images; default 0). Where the head is
        bound, the step's logits where `logits` asks and their argmax where `argmax` does (without logits, computed
        in a buffer of the fused step's own)."""
        tokens = len(ids)
        if not 0 < tokens <= MAX_TOKENS or len(positions) != tokens or len(tables) != tokens:
            raise ValueError(f"fused decode: {tokens} ids, {len(positions)} positions and {len(tables)} tables "
                             f"for a step of 1..{MAX_TOKENS} rows")
        # The step's integers go to the kernel in two C arrays built straight from the lists.
        indices = [cache_index(t, p, block_size) for t, p in zip(tables, positions, strict=True)]
        width = max(positions) // block_size + 1
        flat = padded_tables(tables, width, self.cache_entries // block_size)
        rotated = positions if rope_offsets is None else [p + o for p, o in zip(positions, rope_offsets, strict=True)]
        longs = array.array("q", itertools.chain(ids, rotated, indices, range(tokens)))
        ints = array.array("i", itertools.chain((p + 1 for p in positions), flat))
        at, int_at = longs.buffer_info()[0], ints.buffer_info()[0]
        step = self.step
        step.tokens = step.seqs = tokens
        step.ids, step.positions, step.cache_indices, step.rows = (at + 8 * tokens * i for i in range(4))
        step.lens, step.block_tables = int_at, int_at + 4 * tokens
        step.table_width, step.block_size, step.threads = width, block_size, torch.get_num_threads()
        out = picks = None
        if self.head is not None and (logits or argmax):
            if logits:
                out = torch.empty(tokens, self.head.out_features)
            elif self.head_scratch.shape[0] < tokens:
                self.head_scratch = torch.empty(tokens, self.head.out_features)
            step.logits = (self.head_scratch if out is None else out).data_ptr()
            step.argmax = self.argmax_at if argmax else None
        else:
            step.logits = step.argmax = None
        if self.embedding.weight is None:  # a packed embedding: its rows unpacked here, the kernel starts from x
            self.x[:tokens] = self.embedding(torch.tensor(ids))
        decode_layers.decode_layers(self.layers, step, self.x_at, self.residual_at)
        if step.argmax:
            picks = self.argmax_ids[:tokens].tolist()
        return FusedStep(self.x, out, picks)
