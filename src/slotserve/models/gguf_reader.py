"""GGUF files: the header parser and the file model (metadata, tensor table, memory-mapped tensor data).

The parser is our own (gguf-py's `GGUFReader` takes ~7 s on the default model's header because it
builds a numpy view per tokenizer string); gguf-py supplies the constants and the dequantizers.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, Keys

from slotserve import host_memory

GGUF_MAGIC = b"GGUF"

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4
_DEQUANT_CHUNK_ELEMENTS = 1 << 20


E = TypeVar("E", GGUFValueType, GGMLQuantizationType)


class GGUFError(ValueError):
    """A GGUF file is malformed, truncated, or holds something slotserve cannot convert."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order, i.e. ggml's ne[] reversed: (rows, ..., row_length)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1]))

    def row_chunks(self) -> list[tuple[int, int]]:
        """Row ranges of about _DEQUANT_CHUNK_ELEMENTS each: dequantizing a 136M-element tensor in
        one call is 3-4x slower, because gguf-py's temporaries then miss the caches."""
        step = max(1, _DEQUANT_CHUNK_ELEMENTS // self.shape[-1])
        return [(start, min(start + step, self.rows)) for start in range(0, self.rows, step)]


@dataclass
class GGUFFile:
    """A parsed GGUF header plus a read-only memory map of the file for tensor data."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data: np.ndarray = field(repr=False)  # np.memmap of the whole file, uint8

    @property
    def architecture(self) -> str:
        return self.require(Keys.General.ARCHITECTURE)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    def dequantize(self, name: str) -> np.ndarray:
        """The whole tensor as float32 in numpy (row-major) shape."""
        t = self.tensors[name]
        out = np.empty((t.rows, t.shape[-1]), dtype=np.float32)
        for start, stop in t.row_chunks():
            out[start:stop] = self.dequantize_rows(name, start, stop)
        return out.reshape(t.shape)

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the tensor flattened to 2-D (rows, row_length), as stored: uint8 [rows, bytes]."""
        t = self.tensors[name]
        return self.data[t.offset:t.offset + t.nbytes].reshape(t.rows, -1)[start:stop]

    def release_rows(self, name: str, start: int, stop: int) -> None:
        """Drops the file's pages under rows [start, stop) of the tensor from this process once they are read (the
        page cache keeps them): reading a 17 GB file would otherwise leave all of it counted as resident."""
        raw = self.raw_rows(name, start, stop)
        host_memory.release_range(raw.ctypes.data, raw.nbytes)

    def dequantize_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the tensor flattened to 2-D (rows, row_length), as float32."""
        t = self.tensors[name]
        raw = self.raw_rows(name, start, stop)
        try:
            return gguf.quants.dequantize(raw, t.qtype).astype(np.float32, copy=False)
        except Exception as e:  # gguf-py raises bare numpy errors on malformed blocks
            raise GGUFError(f"{self.path}: tensor {name!r} ({t.qtype.name}) cannot be dequantized: "
                            f"{type(e).__name__}: {e}") from e


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header (metadata and tensor table) of a GGUF v2/v3 little-endian file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"{path}: cannot be read ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(path, memoryview(data), 4)
    version = cur.scalar(GGUFValueType.UINT32)
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (only little-endian v2 and v3)")
    n_tensors = cur.scalar(GGUFValueType.UINT64)
    n_kv = cur.scalar(GGUFValueType.UINT64)
    if n_tensors > size or n_kv > size:
        raise GGUFError(f"{path}: corrupt header ({n_tensors} tensors, {n_kv} metadata entries)")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.enum(GGUFValueType, "metadata value type"))
    raw_infos = [_read_tensor_info(cur) for _ in range(n_tensors)]

    alignment = metadata.get(Keys.General.ALIGNMENT, _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, rel_offset in raw_infos:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if shape[-1] % block_size:
            raise GGUFError(f"{path}: tensor {name!r}: row length {shape[-1]} is not a multiple of "
                            f"the {qtype.name} block size {block_size}")
        nbytes = int(np.prod(shape)) // block_size * type_size
        start = data_start + rel_offset
        if start + nbytes > size:
            raise GGUFError(f"{path}: truncated: tensor {name!r} needs bytes {start}..{start + nbytes} "
                            f"but the file has {size} bytes")
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)
    return GGUFFile(path, metadata, tensors, data)


class _Cursor:
    """Sequential little-endian reads from the header, with truncation reported as GGUFError."""

    def __init__(self, path: Path, buf: memoryview, pos: int) -> None:
        self.path, self.buf, self.pos = path, buf, pos

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated header (needs byte {self.pos + n}, "
                            f"the file has {len(self.buf)} bytes)")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt = "<" + _SCALAR_FORMATS[vtype]
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        if vtype == GGUFValueType.FLOAT32:
            value = float(str(np.float32(value)))  # shortest decimal: 1e-06, not 9.99999997e-07
        return value

    def enum(self, kind: type[E], what: str) -> E:
        raw = self.scalar(GGUFValueType.UINT32)
        try:
            return kind(raw)
        except ValueError:
            raise GGUFError(f"{self.path}: unknown {what} {raw} at byte {self.pos - 4}") from None

    def string(self) -> str:
        n = self.scalar(GGUFValueType.UINT64)
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: string at byte {self.pos - n} is not valid UTF-8") from None

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(vtype)
        item_type = self.enum(GGUFValueType, "array item type")
        count = self.scalar(GGUFValueType.UINT64)
        if item_type == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        if item_type == GGUFValueType.ARRAY:
            return [self.value(item_type) for _ in range(count)]
        dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
        return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string()
    n_dims = cur.scalar(GGUFValueType.UINT32)
    if not 1 <= n_dims <= _MAX_DIMS:
        raise GGUFError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions")
    ne = [cur.scalar(GGUFValueType.UINT64) for _ in range(n_dims)]
    qtype = cur.enum(GGMLQuantizationType, f"tensor type for {name!r}:")
    offset = cur.scalar(GGUFValueType.UINT64)
    if 0 in ne:
        raise GGUFError(f"{cur.path}: tensor {name!r} has an empty dimension {ne}")
    return name, tuple(reversed(ne)), qtype, offset
