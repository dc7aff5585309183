"""Which of a model's linears run packed (kernels/packed_linear.py), and what the load line says of it.

Every float32 CPU `Linear` whose weight has a form a kernel here runs is packed, once, as the runner is built:
integers under a scale per block of 32, plus an offset or not (GGUF's Q8_0/Q5_0/Q4_K: a byte a value,
`narrow`), or under a scale per half block (GGUF's Q6_K), wherever the kernels build; bfloat16 values under a
scale (a bfloat16 checkpoint) where the CPU has AMX. A narrow packing runs a step's 1..FEW_ROWS rows on the
vector units, AMX the rest (a bfloat16 packing's from AMX_MIN_ROWS on); without AMX, and for Q6_K, more rows
stay on the float32 weight (layers/linear.py). Nothing is packed where the packed copies, kept beside the
float32 weights, could take over half the memory still available, nor where the kernels are not built or
`SLOTSERVE_PACK_WEIGHTS=0`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from slotserve.kernels import packed_linear
from slotserve.layers.linear import Linear
from slotserve.models.loader import available_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackingReport:
    """What `pack_linears` did: the model's linears, how many of them run packed, and how many of those on AMX
    (the rest: a narrow packing's few rows only)."""

    linears: int
    packed: int = 0
    on_amx: int = 0

    def summary(self) -> str:
        """The load line's words on it ("" where nothing is packed)."""
        few = f"bytes for 1-{packed_linear.FEW_ROWS} rows"
        if not self.packed:
            return ""
        if not self.on_amx:
            return f"{few}: {self.packed} of {self.linears} linears"
        rest = self.packed - self.on_amx
        return f"AMX: {self.on_amx} of {self.linears} linears" + (f" ({few}: {rest} more)" if rest else "")


def pack_linears(model: nn.Module) -> PackingReport:
    """Packs the model's linears as the module docstring says (each layer's `packed`); what it did."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    candidates = [m for m in linears if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if not candidates or not packed_linear.packs():
        return PackingReport(len(linears))
    need = packed_linear.BYTES_PER_WEIGHT * sum(m.weight.numel() for m in candidates)
    available = available_memory(torch.device("cpu")).available
    if need > available / 2:
        log.warning("weights not packed: packing the linears could take %.1f GiB of the %.1f GiB available",
                    need / 2**30, available / 2**30)
        return PackingReport(len(linears))
    with torch.inference_mode():
        packed = [m.packed for m in candidates if m.pack()]
    return PackingReport(len(linears), len(packed), sum(p.max_rows > packed_linear.FEW_ROWS for p in packed))
