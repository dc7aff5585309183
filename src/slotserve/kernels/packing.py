"""The C struct of one packed weight as every kernel takes it (packed_linear.h's slotserve_packed_weight); the
formats themselves are quantization/packed_linear.py's."""

from __future__ import annotations

import ctypes


class Packing(ctypes.Structure):
    """packed_linear.h's slotserve_packed_weight: a packed weight's buffers (NULL values: not packed)."""

    _fields_ = [("values", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("narrow", ctypes.c_int), ("halves", ctypes.c_int), ("min_rows", ctypes.c_long),
                ("max_rows", ctypes.c_long), ("bits", ctypes.c_int), ("zero", ctypes.c_int),
                ("scale_factors", ctypes.c_void_p), ("offset_factors", ctypes.c_void_p),
                ("scale_code_bytes", ctypes.c_int), ("offset_code_bytes", ctypes.c_int), ("tile_rows", ctypes.c_long)]
