"""A CPU decode step of a dense Qwen model, from its token embedding to its final norm, in one native call.

qwen2.py is the model; this is how its decode steps run on a CPU in float32 where the native kernels are
built. At batch 1 the GEMMs already stream the weights at the machine's read rate, and the rest of a
token's time was ~10 Python-level calls per layer between them, each run in caches the last weight stream
had flushed (2.5-5x its warm cost). kernels/decode_layers.c runs all the layers with the same kernels in
the same order, so a row gets exactly the bits the layer-by-layer path gives it (a test checks).

It takes a step only when every row is a decode row read through the paged kernel (`PagedTables`) and
there are at most 64 rows (the small GEMM's); linears packed for AMX run there for the rows their packing
runs (`AmxWeight.runs`), as in layers/linear.py. Models it cannot run (MoE layers, int8 linears, weights
outside the CPU or not float32) keep the layer-by-layer path.
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import nn

from slotserve.kernels import decode_layers
from slotserve.kernels.amx_gemm import AmxWeight, Packing
from slotserve.kernels.decode_attention import PagedTables
from slotserve.layers.attention import AttentionMetadata
from slotserve.layers.linear import NATIVE_ROWS, Linear
from slotserve.models.qwen2 import QwenDecoderLayer, QwenMLP, QwenModel

MAX_TOKENS = NATIVE_ROWS.stop - 1


def _layer_tensors(layer: QwenDecoderLayer) -> list[torch.Tensor | None]:
    """The tensors decode_layers.c reads for this layer, in `Layer`'s field order (None: absent)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
            None if attn.q_norm is None else attn.q_norm.weight, None if attn.k_norm is None else attn.k_norm.weight,
            attn.o_proj.weight, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            attn.attn.k_cache, attn.attn.v_cache]


def _layer_amx(layer: QwenDecoderLayer) -> list[AmxWeight | None]:
    """The AMX packings of the layer's qkv, o, gate/up and down weights, where they are current (None: not)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [m.current_amx() for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]


# What _layer_tensors and _layer_amx read from a layer, as attribute paths: the norms, the caches, and each
# linear's weight, bias and packing.
_READS = ("input_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
          "post_attention_layernorm.weight", "self_attn.attn.k_cache", "self_attn.attn.v_cache",
          *(f"{m}.{a}" for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
            for a in ("weight", "bias", "amx")))
_ABSENT = object()


def _lookups(root: object, path: str) -> list[tuple[dict, str, object]]:
    """The dicts a dotted attribute lookup from root reads (a module's parameters, buffers, submodules or own
    attributes), each with its key and what it held: what `current` compares, without nn.Module's __getattr__
    (which made the check ~0.9 ms a step on the default model)."""
    out, obj = [], root
    for name in path.split("."):
        if obj is None:
            break
        own = vars(obj)
        homes = [own.get("_parameters"), own.get("_buffers"), own.get("_modules"), own]
        home = next((d for d in homes if d is not None and name in d), own)
        obj = home.get(name, _ABSENT)
        out.append((home, name, obj))
        if obj is _ABSENT:
            break
    return out


def _runnable(layer: QwenDecoderLayer) -> bool:
    """Whether the kernel computes this layer as qwen2.py does: a dense MLP, float32 linears without the
    biases it has no place for, one eps for every norm, and everything dense on the CPU."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not QwenMLP:
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(m, Linear) for m in linears) or any(m.bias is not None for m in linears[1:]):
        return False
    norms = (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm)
    return len({n.eps for n in norms if n is not None}) == 1 and all(
        t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() > 0)
        for t in _layer_tensors(layer))


class FusedDecode:
    """The decode steps of one bound model. Built by `bind`; `applies` says whether a step can run here."""

    def __init__(self, model: QwenModel, tensors: list[list[torch.Tensor | None]],
                 amx: list[list[AmxWeight | None]]) -> None:
        self.model = model
        # Held as well as pointed to (the kernel reads raw pointers), and compared on every step: a layer
        # whose weights, packings or caches were replaced since (a reload, a quantization) rebinds.
        self.tensors, self.amx = tensors, amx
        lookups = [e for root, path in [(model, "embed_tokens.weight"), (model, "norm.weight"),
                                         *((model, f"layers.{i}") for i in range(len(model.layers))),
                                         *((layer, p) for layer in model.layers for p in _READS)]
                   for e in _lookups(root, path)]
        reads = {(id(d), k): (d, k, v) for d, k, v in lookups}.values()  # one per dict entry read
        self.dicts, self.keys, self.held = (list(column) for column in zip(*reads, strict=True))
        self.embedding, self.final_norm = model.embed_tokens.weight, model.norm.weight
        self.layers = (decode_layers.Layer * len(tensors))(*(
            decode_layers.Layer(*(None if t is None else t.data_ptr() for t in ts),
                                *(Packing() if a is None else a.packing for a in packed))
            for ts, packed in zip(tensors, amx, strict=True)))
        first = model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden = model.norm.weight.shape[0]
        self.intermediate = model.layers[0].mlp.down_proj.in_features
        self.eps, self.scale = model.layers[0].input_layernorm.eps, first.attn.scale
        self.num_slots = first.attn.k_cache.shape[0]
        self.scratch = torch.empty(decode_layers.scratch_floats(
            MAX_TOKENS, self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim))

    @classmethod
    def bind(cls, model: nn.Module) -> FusedDecode | None:
        """For a dense Qwen model (Qwen2ForCausalLM and kin: `model.model` a QwenModel) whose layers the
        kernel can run, with the KV caches attached; None otherwise."""
        inner = getattr(model, "model", None)
        if not isinstance(inner, QwenModel) or not inner.layers or not decode_layers.available():
            return None
        if not all(_runnable(layer) for layer in inner.layers) or not all(
                t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                for t in (inner.embed_tokens.weight, inner.norm.weight)):
            return None
        layers = inner.layers
        return cls(inner, [_layer_tensors(layer) for layer in layers], [_layer_amx(layer) for layer in layers])

    def current(self) -> bool:
        """Whether the model still holds the layers, tensors and packings bound: every attribute the binding
        read still holds the same object (identity only, iterated in C: a step's worth of checking)."""
        return all(map(operator.is_, map(dict.get, self.dicts, self.keys, itertools.repeat(_ABSENT)), self.held))

    def applies(self, meta: AttentionMetadata, tokens: int) -> bool:
        """Whether this step is one the kernel runs: decode rows only, all read by the paged kernel."""
        return (isinstance(meta.decode, PagedTables) and 0 < tokens <= MAX_TOKENS
                and all(c is None for c in meta.context) and not torch.is_grad_enabled())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [tokens, hidden] of a step `applies` accepted."""
        tables, tokens = meta.decode, len(input_ids)
        tables.check(self.num_slots // meta.block_size, tokens)
        cos, sin = self.model.rotary.tables(input_ids.device)
        ids, positions = input_ids.long().contiguous(), positions.long().contiguous()  # the kernel reads int64
        slots = meta.slot_mapping.contiguous()
        x, residual = (torch.empty(tokens, self.hidden, dtype=torch.float32) for _ in range(2))
        step = decode_layers.Step(
            tokens, self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim, self.num_slots,
            self.embedding.shape[0], cos.shape[0], self.eps, self.scale, ids.data_ptr(), positions.data_ptr(),
            slots.data_ptr(), self.embedding.data_ptr(), cos.data_ptr(), sin.data_ptr(), self.final_norm.data_ptr(),
            tables.rows.data_ptr(), tables.block_tables.data_ptr(), tables.lens.data_ptr(), tables.rows.shape[0],
            tables.block_tables.shape[1], meta.block_size, self.scratch.data_ptr(), torch.get_num_threads())
        decode_layers.decode_layers(self.layers, step, x.data_ptr(), residual.data_ptr())
        return x
