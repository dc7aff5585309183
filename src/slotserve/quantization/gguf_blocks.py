"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) read from their bytes as the integers, scales and offsets they store, rather
than fitted to their dequantized weights: Q4_K and Q5_K are w = d * sc * q - dmin * m per block of 32, so scale =
d * sc and offset = -dmin * m; Q6_K is w = d * sc * (q - 32) per half block of 16. Each scale and offset is a
float16 times a small integer (exact in float32, and int8 codes under one factor per super-block:
`Scales.grouped`), and scale * q + offset rounded once is the weight gguf-py's dequantization gives, bit for bit.
A fit could not find these: where a block has no q = 0 its least weight, the fit's offset, is d * sc * q_min -
dmin * m, which shares no factor with its neighbours'; and a half block whose values are all even moves a factor
of 2 into its scale, out of int8's reach."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from slotserve.quantization.packed_tensor import BYTE_ZERO, PackedTensor

# Where a super-block's high bits (Q5_K) and its nibbles start: each begins with d and dmin (float16) and 12 bytes
# of 6-bit scales and minimums. A Q6_K one holds 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d.
_LAYOUT = {GGMLQuantizationType.Q4_K: (None, 16), GGMLQuantizationType.Q5_K: (16, 48)}
ROWS_AT_ONCE = 4096  # rows decoded at a time: the intermediates stay ~100 MB at 7B widths
QTYPES = frozenset(_LAYOUT) | {GGMLQuantizationType.Q6_K}


def _decode_q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Rows of Q6_K super-blocks as (q - 32 + BYTE_ZERO as uint8 [rows, k], scales float32 [rows, k / 16], None)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, GGML_QUANT_SIZES[GGMLQuantizationType.Q6_K][1])
    lead = blocks.shape[:2]
    low = blocks[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]  # [half][nibble][64]
    high = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (low & 15).reshape(*lead, 8, 32) | (high & 3).reshape(*lead, 8, 32) << 4
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)
    scales = d * blocks[..., 192:208].view(np.int8).astype(np.float32)
    return (q + np.uint8(BYTE_ZERO - 32)).reshape(rows, -1), scales.reshape(rows, -1), None


def _decode(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows of super-blocks (uint8 [rows, bytes]) as (q + BYTE_ZERO as uint8 [rows, k], scales and offsets float32
    [rows, k / BLOCK], or per half block and without offsets: Q6_K)."""
    if qtype == GGMLQuantizationType.Q6_K:
        return _decode_q6_k(raw)
    qh_at, qs_at = _LAYOUT[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])  # [rows, supers, bytes]
    d, dmin = (blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32) for at in (0, 2))  # [rows, supers, 1]
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    sc, m = sc.reshape(*blocks.shape[:2], 8), m.reshape(*blocks.shape[:2], 8)
    qs = blocks[..., qs_at:qs_at + 128].reshape(*blocks.shape[:2], 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    q = (qs & 15).reshape(*blocks.shape[:2], 8, 32)  # [rows, supers, block, value]
    if qh_at is not None:
        qh = blocks[..., qh_at:qh_at + 32].reshape(*blocks.shape[:2], 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        q = q | (qh & 1) << 4
    scales = (d * sc.astype(np.float32)).reshape(rows, -1)
    offsets = -(dmin * m.astype(np.float32)).reshape(rows, -1)
    return (q + np.uint8(BYTE_ZERO)).reshape(rows, -1), scales, offsets


def packed_k_quant(raw: np.ndarray, qtype: GGMLQuantizationType) -> PackedTensor:
    """A K-quant tensor's rows (uint8 [n, bytes a row]) packed as the kernels read them, in its smallest exact
    form."""
    parts = [_decode(raw[start:start + ROWS_AT_ONCE], qtype) for start in range(0, raw.shape[0], ROWS_AT_ONCE)]
    values, scales = (torch.from_numpy(np.concatenate([p[i] for p in parts])) for i in (0, 1))
    offsets = None if parts[0][2] is None else torch.from_numpy(np.concatenate([p[2] for p in parts]))
    return PackedTensor.of_integers(values, scales, offsets).compact()
