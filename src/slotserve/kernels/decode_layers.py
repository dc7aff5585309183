"""A decode step's Qwen decoder layers in one native call (decode_layers.c), called from Python.

The structures mirror the C ones field for field; `models/fused_decode.py` fills them from a model."""

from __future__ import annotations

import ctypes
from pathlib import Path

from slotserve.kernels import native
from slotserve.kernels.packing import Packing

SOURCE = Path(__file__).with_name("decode_layers.c")
_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_SCRATCH_ARGS = (ctypes.c_long,) * 8


class Layer(ctypes.Structure):
    """One layer's weights and KV cache, as data pointers (NULL: no bias, no q/k norm), and its linears'
    packings; a mixture-of-experts layer's router and its experts' weights and packings, as [experts] arrays."""

    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down", "k_cache",
        "v_cache")] + [(name, Packing) for name in ("qkv_packed", "o_packed", "gate_up_packed", "down_packed")]
        + [(name, ctypes.c_long) for name in ("experts", "top_k", "expert_intermediate")]
        + [("renormalize", ctypes.c_int)]
        + [(name, ctypes.c_void_p) for name in ("router", "expert_gate_up", "expert_down", "expert_gate_up_packed",
                                                "expert_down_packed")])


class Step(ctypes.Structure):
    """One decode step: shapes, the rows' token ids, positions and cache indices, the embedding, rotary tables
    and final norm, the attention's paged tables; the output head, where its logits go and their argmax
    (NULL: none)."""

    _fields_ = ([(name, ctypes.c_long) for name in ("tokens", "hidden", "intermediate", "heads", "kv_heads",
                                                   "head_dim", "cache_entries", "vocab", "max_position")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("ids", "positions", "cache_indices", "embedding", "cos_table",
                                                        "sin_table", "final_norm", "rows", "block_tables", "lens")]
                + [(name, ctypes.c_long) for name in ("seqs", "table_width", "block_size")]
                + [("scratch", ctypes.c_void_p), ("threads", ctypes.c_int)]
                + [("head", ctypes.c_void_p), ("head_bias", ctypes.c_void_p), ("head_packed", Packing),
                   ("head_rows", ctypes.c_long), ("logits", ctypes.c_void_p), ("argmax", ctypes.c_void_p)])


def available() -> bool:
    return native.function(SOURCE, "slotserve_decode_layers", _ARGS) is not None


def scratch_floats(tokens: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                   experts: int = 0, top_k: int = 0) -> int:
    """Floats of scratch a step of `tokens` rows needs (`experts`, `top_k`: its widest mixture-of-experts layer's)."""
    scratch = native.require(native.function(SOURCE, "slotserve_decode_scratch", _SCRATCH_ARGS), SOURCE)
    return scratch(tokens, hidden, intermediate, heads, kv_heads, head_dim, experts, top_k)


def decode_layers(layers: ctypes.Array, step: Step, x: int, residual: int) -> None:
    """Embeds the step's tokens into x (data pointer, [tokens, hidden]), runs every layer with residual
    ([tokens, hidden]) as the residual stream, leaves the final norm's output in x and, where the step has
    a head and a logits pointer, x's logits there (and, with an argmax pointer, each row's argmax)."""
    run = native.require(native.function(SOURCE, "slotserve_decode_layers", _ARGS), SOURCE)
    status = run(ctypes.addressof(layers), len(layers), ctypes.addressof(step), x, residual)
    if status == -2:
        raise ValueError("decode_layers: a cache index is out of range for the KV cache")
    if status == -3:
        raise ValueError("decode_layers: a token id or a position is out of range for the model")
    if status:
        raise MemoryError("decode_layers: no memory for a kernel's scratch buffer")
