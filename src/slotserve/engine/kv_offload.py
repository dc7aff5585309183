"""The engine's side of the KV disk tier: which files belong to this cache (the model key), the cache's blocks as
bytes, and saves in flight (a finished save request whose blocks are being written)."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from slotserve.engine.protocol import EngineCoreOutput
from slotserve.kv_cache import block_file
from slotserve.kv_cache.disk_tier import WriteJob
from slotserve.model_store import CONVERTER_VERSION

_SAMPLE = 1 << 20  # bytes hashed from each end of a weights file


def model_key(model_path: Path, dtype: torch.dtype, block_size: int, layout: tuple[int, ...]) -> bytes:
    """16 bytes naming what a block file's bytes depend on: the model (its config.json, and each weights file's
    name, size, safetensors header and first and last MiB), the converter version, the disk format, the dtype,
    the block size and the KV layout (layers, KV heads, head dim). Any change gives another key, so another
    model's or converter's files are never read."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"converter": CONVERTER_VERSION, "format": block_file.FORMAT_VERSION, "dtype": str(dtype),
                         "block_size": block_size, "layout": list(layout)}).encode())
    h.update((model_path / "config.json").read_bytes())
    for weights in sorted(model_path.glob("*.safetensors")):
        size = weights.stat().st_size
        h.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            h.update(f.read(_SAMPLE))
            f.seek(max(size - _SAMPLE, 0))
            h.update(f.read(_SAMPLE))
    return h.digest()


class KVBlockIO:
    """One runner's KV cache, a block at a time: [layers, block_size, kv_heads, head_dim] of keys, then of values."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> None:
        self.k, self.v, self.block_size = k_cache, v_cache, block_size
        self.shape = (k_cache.shape[0], block_size, *k_cache.shape[2:])
        self.nbytes = 2 * k_cache[:, :block_size].numel() * k_cache.element_size()

    def view(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        return self.k[:, rows], self.v[:, rows]

    def to_bytes(self, view: tuple[torch.Tensor, torch.Tensor]) -> bytes:
        k, v = view
        return _raw(k) + _raw(v)

    def copy_out(self, block_id: int) -> bytes:
        return self.to_bytes(self.view(block_id))

    def copy_in(self, block_id: int, payload: bytes) -> None:
        if len(payload) != self.nbytes:
            raise ValueError(f"payload: {len(payload)} bytes for a block of {self.nbytes}")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.k.dtype)
        k, v = self.view(block_id)
        half = raw.numel() // 2
        k.copy_(raw[:half].view(self.shape))
        v.copy_(raw[half:].view(self.shape))


def _raw(t: torch.Tensor) -> bytes:
    return t.to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


@dataclass
class PendingSave:
    """A save request whose final output waits for its blocks to be written."""

    block_ids: list[int]
    output: EngineCoreOutput
    job: WriteJob


class SaveTracker:
    """Saves handed to the writer; the step thread collects those it has finished (`done`)."""

    def __init__(self) -> None:
        self.pending: list[PendingSave] = []
        self._finished: list[WriteJob] = []
        self._lock = threading.Lock()
        self.event = threading.Event()  # set when a save finishes: an idle step waits on it

    def add(self, save: PendingSave) -> None:
        save.job.done = self._finish
        self.pending.append(save)

    def _finish(self, job: WriteJob) -> None:
        with self._lock:
            self._finished.append(job)
        self.event.set()

    def done(self) -> list[PendingSave]:
        with self._lock:
            finished, self._finished = self._finished, []
            self.event.clear()
        jobs = {id(j) for j in finished}
        ready = [s for s in self.pending if id(s.job) in jobs]
        self.pending = [s for s in self.pending if id(s.job) not in jobs]
        return ready
