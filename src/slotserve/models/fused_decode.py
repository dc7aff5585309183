"""A CPU decode step of a dense Qwen model, from its token embedding to its final norm, in one native call.

The model runner sends here every step whose sequences each compute one token, at most MAX_TOKENS of them
(the small GEMM's rows), of a model this binds to: a dense Qwen model (qwen.py) with float32 weights on the
CPU, and the native kernels built. Every other step, and every model it cannot run (MoE layers, int8 linears,
other devices or dtypes), takes the layer-by-layer path. Why: at batch 1 the GEMMs stream the weights at the
machine's read rate, and what is left is the Python between them, ~10 calls a layer, each run in caches the
last weight stream flushed; kernels/decode_layers.c runs all the layers in one call, with the same kernels in
the same order, so a row gets exactly the bits the layer-by-layer path gives it (a test checks). The step
comes straight as lists, without the layer path's tensors and attention metadata.

Within the call each linear dispatches as layers/linear.py does (a packing for the rows it runs:
`PackedWeight.runs`, else the small GEMM); the output head runs there too where the kernel can run it
(`_head`), and so does each row's argmax where the runner asks for it (Want.GREEDY).
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from slotserve.kernels import decode_layers
from slotserve.kernels.packing import Packing
from slotserve.kv_cache.block_table import cache_index, padded_tables
from slotserve.layers.linear import NATIVE_ROWS, Linear
from slotserve.models.qwen import QwenDecoderLayer, QwenMLP, QwenModel
from slotserve.quantization.packed_linear import PackedWeight

MAX_TOKENS = NATIVE_ROWS.stop - 1


def _layer_tensors(layer: QwenDecoderLayer) -> list[torch.Tensor | None]:
    """The tensors decode_layers.c reads for this layer, in `Layer`'s field order (None: absent)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
            None if attn.q_norm is None else attn.q_norm.weight, None if attn.k_norm is None else attn.k_norm.weight,
            attn.o_proj.weight, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            attn.attn.k_cache, attn.attn.v_cache]


def _layer_packed(layer: QwenDecoderLayer) -> list[PackedWeight | None]:
    """The packings of the layer's qkv, o, gate/up and down weights, where they are current (None: not)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [m.current_packed() for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]


def _runnable(layer: QwenDecoderLayer) -> bool:
    """Whether the kernel computes this layer as qwen.py does: a dense MLP, float32 linears without the
    biases it has no place for, one eps for every norm, and everything dense on the CPU."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not QwenMLP:
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(m, Linear) for m in linears) or any(m.bias is not None for m in linears[1:]):
        return False
    if any(m.weight is None and m.packed.max_rows < MAX_TOKENS for m in linears):  # a packing alone runs them all
        return False
    norms = (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm)
    return len({n.eps for n in norms if n is not None}) == 1 and all(
        t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() > 0)
        for t in _layer_tensors(layer))


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


def _vocab_rows(embedding: nn.Module) -> int:
    return embedding.packed.n if embedding.weight is None else embedding.weight.shape[0]


class FusedDecode:
    """The decode steps of one bound model. Built by `bind`."""

    def __init__(self, outer: nn.Module, tensors: list[list[torch.Tensor | None]],
                 packed: list[list[PackedWeight | None]], head: Linear | None) -> None:
        model: QwenModel = outer.model
        # Held as well as pointed to: the kernel reads raw pointers. A model changed since is bound anew
        # (ModelRunner.rebind); until then the step keeps computing with what it holds.
        self.tensors, self.packed = tensors, packed
        self.head, self.head_packed = head, None if head is None else head.current_packed()
        self.embedding, self.final_norm = model.embed_tokens, model.norm.weight
        self.layers = (decode_layers.Layer * len(tensors))(*(
            decode_layers.Layer(*(None if t is None else t.data_ptr() for t in ts),
                                *(Packing() if p is None else p.packing for p in layer_packed))
            for ts, layer_packed in zip(tensors, packed, strict=True)))
        first = model.layers[0].self_attn
        hidden, self.cache_entries = model.norm.weight.shape[0], first.attn.k_cache.shape[0]
        intermediate = model.layers[0].mlp.down_proj.in_features
        heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.cos, self.sin = model.rotary.tables(self.final_norm.device)
        self.scratch = torch.empty(decode_layers.scratch_floats(MAX_TOKENS, hidden, intermediate, heads, kv_heads,
                                                                head_dim))
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
        """For a dense Qwen model (QwenForCausalLM and kin: `model.model` a QwenModel) whose layers the
        kernel can run, with the KV caches attached; None otherwise. Its output head runs in the same call
        where the kernel can run it (`_head`)."""
        inner = getattr(model, "model", None)
        if not isinstance(inner, QwenModel) or not inner.layers or not decode_layers.available():
            return None
        if not all(_runnable(layer) for layer in inner.layers) or not all(
                t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
                for t in (inner.embed_tokens.weight, inner.norm.weight)):
            return None
        layers = inner.layers
        return cls(model, [_layer_tensors(layer) for layer in layers], [_layer_packed(layer) for layer in layers],
                   _head(model))

    def __call__(self, ids: list[int], positions: list[int], tables: list[list[int]], block_size: int,
                 logits: bool = True, argmax: bool = False) -> FusedStep:
        """A decode step (at most MAX_TOKENS rows): row i is token ids[i] at positions[i] of the sequence whose
        cache blocks are tables[i], its key and value written to that position's cache index (BlockTableError
        where a table does not hold its position or names a block outside the cache). Where the head is bound,
        the step's logits where `logits` asks and their argmax where `argmax` does (without logits, computed in
        a buffer of the fused step's own)."""
        tokens = len(ids)
        if not 0 < tokens <= MAX_TOKENS or len(positions) != tokens or len(tables) != tokens:
            raise ValueError(f"fused decode: {tokens} ids, {len(positions)} positions and {len(tables)} tables "
                             f"for a step of 1..{MAX_TOKENS} rows")
        # The step's integers go to the kernel in two C arrays built straight from the lists.
        indices = [cache_index(t, p, block_size) for t, p in zip(tables, positions, strict=True)]
        width = max(positions) // block_size + 1
        flat = padded_tables(tables, width, self.cache_entries // block_size)
        longs = array.array("q", itertools.chain(ids, positions, indices, range(tokens)))
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
