"""What a benchmark says of memory: the bytes the weights take, the process's resident memory now and at its
peak (on CPU: what the machine must hold)."""

from __future__ import annotations

import mmap
import resource

from torch import nn


def weight_bytes(model: nn.Module) -> int:
    """The bytes the model's weights take: its parameters and buffers, and the packings its linears and
    embeddings hold (quantization/packed_linear.py), each storage counted once."""
    storages: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for m in model.modules():
        packed = getattr(m, "packed", None)
        for t in () if packed is None else packed.buffers:
            storages.setdefault(t.data_ptr(), t.nbytes)
    return sum(storages.values())


def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def peak_resident_bytes() -> int:
    """This process's highest resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
