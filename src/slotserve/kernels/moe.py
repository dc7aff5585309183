"""A mixture-of-experts layer's routing and weighted sum in one native call each (moe.c), for CPU float32 tensors:
the functions decode_layers.c's fused step calls too, so both paths give a row the same bits."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from slotserve.kernels import native

SOURCE = Path(__file__).with_name("moe.c")
MAX_EXPERTS = 1024  # moe.c's: the widest router it takes
_ROUTE_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
               ctypes.c_void_p)
_COMBINE_ARGS = (ctypes.c_void_p,) * 3 + (ctypes.c_long,) * 3 + (ctypes.c_void_p,)


def applies(logits: torch.Tensor) -> bool:
    """Whether router logits [rows, experts] can take the native path."""
    return (native.takes(logits) and logits.dim() == 2 and logits.shape[1] <= MAX_EXPERTS
            and native.function(SOURCE, "slotserve_moe_route", _ROUTE_ARGS) is not None)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top_k experts by the softmax of its logits [rows, experts] (the lower number first among
    equals) and their probabilities, renormalized to sum to one where asked: (weights float32, experts int64),
    each [rows, top_k]."""
    run = native.require(native.function(SOURCE, "slotserve_moe_route", _ROUTE_ARGS), SOURCE)
    rows, experts = logits.shape
    if not 0 < top_k <= experts <= MAX_EXPERTS:
        raise ValueError(f"moe route: top_k {top_k} of {experts} experts (at most {MAX_EXPERTS})")
    logits = logits.contiguous()
    weights, chosen = torch.empty(rows, top_k), torch.empty(rows, top_k, dtype=torch.long)
    run(logits.data_ptr(), rows, experts, top_k, int(renormalize), weights.data_ptr(), chosen.data_ptr())
    return weights, chosen


def combine(ys: torch.Tensor, weights: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over j of weights[t, j] * ys[slot[t * top_k + j]], j in order: each row's experts' outputs
    ys [pairs, dim] weighted and summed, [rows, dim]."""
    run = native.require(native.function(SOURCE, "slotserve_moe_combine", _COMBINE_ARGS), SOURCE)
    rows, top_k = weights.shape
    if slot.shape != (rows * top_k,) or ys.dim() != 2 or len(ys) != rows * top_k:
        raise ValueError(f"moe combine: slot {tuple(slot.shape)} for {rows} x {top_k} pairs of ys {tuple(ys.shape)}")
    ys, weights, slot = ys.contiguous(), weights.contiguous(), slot.contiguous()
    out = torch.empty(rows, ys.shape[1])
    run(ys.data_ptr(), weights.data_ptr(), slot.data_ptr(), rows, top_k, ys.shape[1], out.data_ptr())
    return out
