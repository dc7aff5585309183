"""Q8_0 at load (`--quantization q8_0`): a float checkpoint's linear and embedding weights become GGUF Q8_0 blocks
as they are read, packed as the kernels read a GGUF's, so no float32 copy of them is ever made.

A bfloat16 8B model takes 32 GB in float32 and 8.5 GB in Q8_0, so on a 24 GB machine this is what lets it load,
and batch-1 decode, which streams every weight once a token, reads a quarter of the bytes. The blocks are
llama.cpp's (`quantize_row_q8_0_ref`, gguf-py's `quants.Q8_0`): per 32 values of a row, d = max |x| / 127 and
q = round(x / d) (halves away from zero), d kept in float16; so the weights equal what llama.cpp's own Q8_0
conversion of the checkpoint holds, value for value (a test checks against gguf-py)."""

from __future__ import annotations

import torch

from slotserve.quantization.packed_linear import BLOCK, built
from slotserve.quantization.packed_tensor import BYTE_ZERO, PackedTensor

Q8_0_BYTES_PER_VALUE = 1 + 4 / BLOCK  # the most its packing keeps: a byte a value, a float32 scale a block
# Rows quantized at a time: the float32 working copies stay about 64 MB for a 4096-wide weight.
_ROWS_AT_ONCE = 4096


def quantize_q8_0(weight: torch.Tensor) -> PackedTensor | None:
    """A 2-D float weight [n, k] as Q8_0 blocks, packed in its smallest exact form; None where its rows are not
    whole blocks or the kernels are not built here."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK or not built():
        return None
    values, scales = [], []
    for start in range(0, weight.shape[0], _ROWS_AT_ONCE):
        v, d = _blocks(weight[start:start + _ROWS_AT_ONCE])
        values.append(v)
        scales.append(d)
    return PackedTensor.of_integers(torch.cat(values), torch.cat(scales), None).compact()


def _blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q + BYTE_ZERO as uint8 [n, k], the float16 scales as float32 [n, k / BLOCK]) of some rows."""
    n, k = rows.shape
    x = rows.float().view(n, k // BLOCK, BLOCK)
    d = x.abs().amax(dim=2, keepdim=True) / 127
    inverse = torch.where(d == 0, 0.0, 1 / d)
    scaled = x * inverse
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # C's roundf, not torch's half-to-even
    return (q + BYTE_ZERO).to(torch.uint8).view(n, k), d.view(n, -1).half().float()
