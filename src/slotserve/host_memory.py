"""CPU tensors in transparent huge pages: where the weights and the KV cache live on a Linux host.

A decode step streams every weight from DRAM and reads each sequence's keys and values out of blocks
scattered over the cache. With 4 KB pages both walk the page tables constantly; with 2 MB pages they do
not. Under THP's "madvise" mode (a common default) nothing gets huge pages unless it asks for them.

torch's allocator asks for huge pages only under `THP_MEM_ALLOC_ENABLE=1`, read once at its first
allocation, so a library cannot switch it on. Here the memory is our own anonymous mapping, advised
(MADV_HUGEPAGE) before its first touch, with tensors as views of it. `SLOTSERVE_HUGE_PAGES=0` turns
this off; off Linux it is a no-op.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch
from torch import nn

logger = logging.getLogger("slotserve")

HUGE_PAGE = 1 << 21
# Smaller tensors (norms, biases, k/v projections of small models) gain nothing worth a copy.
MIN_BYTES = HUGE_PAGE
_ALIGN = 4096  # every tensor starts on a page of its own


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("SLOTSERVE_HUGE_PAGES", "1") != "0"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of `nbytes` in advised anonymous memory, starting on a huge-page boundary.
    Its pages are faulted in on first touch, so untouched parts (an idle KV cache) cost no RAM."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping for as long as it lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), in huge pages where this is a CPU tensor and they are enabled."""
    if device.type != "cpu" or not enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return huge_page_bytes(nbytes).view(dtype).view(shape)


def move_weights(model: nn.Module, available: int) -> int:
    """Copies the model's large CPU parameters into one huge-page region, each tensor replaced by a view
    of it, and returns the bytes moved. Leaves them where they are (and returns 0) when the copy would
    not fit in `available` bytes: memory-mapped weights cost no new memory where they are."""
    if not enabled():
        return 0
    large = [p for p in model.parameters() if p.device.type == "cpu" and p.nbytes >= MIN_BYTES]
    total = sum(_round_up(p.nbytes, _ALIGN) for p in large)
    if not large or total > available:
        if large:
            logger.info("weights stay in 4 KB pages: moving %.1f GiB would exceed the %.1f GiB available",
                        total / (1 << 30), available / (1 << 30))
        return 0
    region = huge_page_bytes(total)
    moved: dict[int, nn.Parameter] = {}
    offset = 0
    for p in large:
        view = region[offset:offset + p.nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.detach())
        moved[id(p)] = nn.Parameter(view, requires_grad=p.requires_grad)
        offset += _round_up(p.nbytes, _ALIGN)
    # Replace every reference, so a tied output head keeps sharing the embedding's new home.
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in moved:
                setattr(module, name, moved[id(p)])
    return total
