"""Which of a model's linears run packed (quantization/packed_linear.py), and what the load line says of it.

A GGUF's linears arrive packed from the checkpoint (the loader's `hold_packed`). Every float32 CPU `Linear`
whose weight has a form a kernel here runs is packed too, once, as the runner is built: integers under a
scale per block of 32, plus an offset or not (a byte a value, `narrow`), or under a scale per half block,
wherever the kernels build; bfloat16 values under a scale (a bfloat16 checkpoint) where the CPU has AMX, for
the rows AMX takes (layers/linear.py). Nothing is packed where the packed copies, kept beside the float32
weights, could take over half the memory still available, nor where the kernels are not built or
`SLOTSERVE_PACK_WEIGHTS=0`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from slotserve import host_memory
from slotserve.config import PrefillPrecision
from slotserve.layers.embedding import VocabEmbedding
from slotserve.layers.linear import Linear
from slotserve.models.loader import available_memory
from slotserve.quantization import packed_linear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackingReport:
    """What `pack_linears` found and did: the model's linears, how many run packed, how many of those on AMX,
    and how many of them hold their checkpoint's packing alone (a GGUF's: no float32 copy)."""

    linears: int
    packed: int = 0
    on_amx: int = 0
    held: int = 0

    def summary(self) -> str:
        """The load line's words on it ("" where nothing is packed)."""
        if not self.packed:
            return ""
        where = "AMX and vector units" if self.on_amx else "vector units"
        held = f", {self.held} without a float32 copy" if self.held else ""
        return f"packed on the {where}: {self.packed} of {self.linears} linears{held}"


def pack_linears(model: nn.Module, prefill: PrefillPrecision = PrefillPrecision.AUTO) -> PackingReport:
    """Packs the model's float32 linears as the module docstring says (each layer's `packed`), every packing's
    calls of many rows in `prefill`'s precision; what it did."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    held = [m.packed for m in linears if m.weight is None]
    candidates = [m for m in linears if m.weight is not None and m.weight.device.type == "cpu"
                  and m.weight.dtype == torch.float32]
    packed = []
    need = packed_linear.BYTES_PER_WEIGHT * sum(m.weight.numel() for m in candidates)
    available = available_memory(torch.device("cpu")).available
    if candidates and packed_linear.packs() and need > available / 2:
        log.warning("weights not packed: packing the linears could take %.1f GiB of the %.1f GiB available",
                    need / 2**30, available / 2**30)
    elif candidates and packed_linear.packs():
        with torch.inference_mode():
            packed = [m.packed for m in candidates if m.pack()]
    every = held + packed
    for p in every:
        p.panel_dtype = packed_linear.panel_dtype(prefill)
    return PackingReport(len(linears), len(every), sum(p.min_rows < packed_linear.ALL_ROWS for p in every),
                         len(held))


def move_packings(model: nn.Module, available: int) -> int:
    """Copies the packings the model's linears hold alone (a checkpoint's, views of its file) into one huge-page
    region, as host_memory.move_weights does for parameters, and returns the bytes moved (0 where they stay:
    huge pages off, or more than `available`). An untied embedding's packing stays in the file: a step reads
    only its rows, so most of it is never resident."""
    holders = [m for m in model.modules() if isinstance(m, Linear) and m.weight is None]
    unique = {id(m.packed): m.packed for m in holders}
    users = [m for m in model.modules() if isinstance(m, Linear | VocabEmbedding) and id(m.packed) in unique]
    copies = host_memory.into_huge_pages([t for p in unique.values() for t in p.tensor().buffers.values()], available,
                                         originals_freed=True)
    if copies is None:
        return 0
    moved = 0
    for key in list(unique):
        p = unique.pop(key)
        buffers = {name: next(copies) for name in p.tensor().buffers}
        new = packed_linear.PackedWeight.of(packed_linear.PackedTensor.of_buffers(buffers, p.n, p.k, p.zero), p.bias)
        new.panel_dtype = p.panel_dtype
        for m in users:
            if m.packed is p:
                m.packed = new  # the old buffers (a merged projection's copy) go as the next ones are copied
        moved += new.nbytes
        if moved // TRIM_BYTES != (moved - new.nbytes) // TRIM_BYTES:
            host_memory.trim_heap()  # the copies freed, where they came from the C heap rather than their own maps
    return moved


TRIM_BYTES = 64 << 20  # moved between trims of the C heap
