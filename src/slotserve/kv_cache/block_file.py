"""One KV cache block on disk: its file format, its atomic write and its checked read.

A file is a fixed header, the block's token ids and its key and value bytes, then a crc32 of everything before
it. The header names the format version, the model key (which model, converter, dtype, block size and KV
layout wrote it), the block's prefix hash and the payload's length, so a file is only ever read back into the
cache that wrote it. Files are written to a temporary name, fsynced and renamed into place: a crash leaves
either the whole file or a temporary one, never a torn block under a real name.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"SSKVBLK1"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
# magic, format version, model key (16 bytes), block hash (16 bytes), token count, payload bytes
_HEADER = struct.Struct("<8sI16s16sIQ")
_CRC = struct.Struct("<I")


class BlockFileError(ValueError):
    """A block file that is torn, corrupt, or written by another model, format or block."""


@dataclass(frozen=True)
class BlockFile:
    token_ids: tuple[int, ...]
    payload: bytes  # the block's keys then its values, every layer, as the cache lays them out


def file_name(block_hash: int) -> str:
    return f"{block_hash:032x}{SUFFIX}"


def encode(model_key: bytes, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> bytes:
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, model_key, block_hash.to_bytes(16, "little"), len(token_ids),
                        len(payload)) + tokens + payload
    return body + _CRC.pack(zlib.crc32(body))


def decode(data: bytes, model_key: bytes, block_hash: int) -> BlockFile:
    """The file's tokens and payload; BlockFileError unless every check passes."""
    if len(data) < _HEADER.size + _CRC.size:
        raise BlockFileError(f"{len(data)} bytes: shorter than a header")
    magic, version, key, stored_hash, num_tokens, length = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BlockFileError(f"not a block file of format {FORMAT_VERSION}")
    if key != model_key:
        raise BlockFileError("written for another model or KV layout")
    if stored_hash != block_hash.to_bytes(16, "little"):
        raise BlockFileError("holds another block")
    end = _HEADER.size + 8 * num_tokens + length
    if len(data) != end + _CRC.size:
        raise BlockFileError(f"{len(data)} bytes where the header says {end + _CRC.size}")
    if zlib.crc32(memoryview(data)[:end]) != _CRC.unpack_from(data, end)[0]:
        raise BlockFileError("checksum mismatch")
    tokens = struct.unpack_from(f"<{num_tokens}q", data, _HEADER.size)
    return BlockFile(tokens, data[_HEADER.size + 8 * num_tokens:end])


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` to a temporary file beside `path`, fsyncs it, renames it over `path` and fsyncs the
    directory, so the name appears only with the whole file behind it, and stays after a power loss."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
