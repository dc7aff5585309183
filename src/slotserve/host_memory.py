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

import bisect
import ctypes
import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from slotserve import envs

logger = logging.getLogger("slotserve")

HUGE_PAGE = 1 << 21
# Smaller tensors (norms, biases, k/v projections of small models) gain nothing worth a copy.
MIN_BYTES = HUGE_PAGE
_ALIGN = 4096  # every tensor starts on a page of its own


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and envs.huge_pages()


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
    not fit in `available` bytes: memory-mapped weights cost no new memory where they are. The small ones are
    copied out of a checkpoint's file either way: a read of one would map the file's pages around it (a large
    folio: up to 2 MB of the packings beside a norm's 4 KB, already copied), 67 MB of the default model's."""
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    large = [p for p in params if p.nbytes >= MIN_BYTES]
    mappings = FileMappings.read()
    mapped = [p for p in params if p.nbytes < MIN_BYTES and mappings.holds(p.data_ptr())]
    _replace(model, {id(p): nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in mapped})
    for p in mapped:
        release_around(p, mappings)
    copies = into_huge_pages(list(large), available)
    if copies is None:
        return 0
    views = list(copies)
    _replace(model, {id(p): nn.Parameter(view, requires_grad=p.requires_grad)
                     for p, view in zip(large, views, strict=True)})
    return sum(v.nbytes for v in views)


def _replace(model: nn.Module, new: dict[int, nn.Parameter]) -> None:
    """Every reference to each parameter (by id) replaced by its new one: a tied output head keeps sharing the
    embedding's new home."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in new:
                setattr(module, name, new[id(p)])


def into_huge_pages(tensors: list[torch.Tensor], available: int,
                    originals_freed: bool = False) -> Iterator[torch.Tensor] | None:
    """Copies of `tensors` in one huge-page region, made one at a time as the caller takes them (each taken off
    the list as it is copied, so the caller can let it go before the next), each original's file pages released
    (`release_pages`) a COPY_CHUNK at a time as they are copied, so no more than that is resident twice; None
    where huge pages are off, or the copies would not fit in `available` bytes. With `originals_freed` (the
    caller drops each original once its copy is taken), the originals in anonymous memory count as room: the
    region grows as they go (a merged projection's copies, 12 GB of a 30B-A3B model's 18)."""
    if not enabled() or not tensors:
        return None
    total = sum(_round_up(t.nbytes, _ALIGN) for t in tensors)
    mappings = FileMappings.read()
    freed = sum(t.nbytes for t in tensors if not mappings.holds(t.data_ptr())) if originals_freed else 0
    if total - freed > available:
        logger.info("weights stay in 4 KB pages: moving %.1f GiB would exceed the %.1f GiB available",
                    total / (1 << 30), (available + freed) / (1 << 30))
        return None
    region = huge_page_bytes(total)  # its pages are faulted in as the copies touch them

    def copies() -> Iterator[torch.Tensor]:
        offset = 0
        while tensors:
            t = tensors.pop(0)  # held no longer here: the caller's last reference may go
            view = region[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
            if t.is_contiguous():
                source, target, step = t.detach().view(-1), view.view(-1), max(1, COPY_CHUNK // t.element_size())
                for start in range(0, source.numel(), step):
                    target[start:start + step].copy_(source[start:start + step])
                    release_pages(source[start:start + step], mappings)
            else:
                view.copy_(t.detach())
            offset += _round_up(t.nbytes, _ALIGN)
            yield view

    return copies()


def release_pages(tensor: torch.Tensor, mappings: FileMappings) -> None:
    """Drops the whole pages under a contiguous tensor from this process (MADV_DONTNEED), once it is no longer
    read: a view of a memory-mapped checkpoint then stops counting in the process's resident memory (the page
    cache keeps the file; a later read would fault the pages back in). Anonymous memory is left alone."""
    if tensor.is_contiguous() and tensor.device.type == "cpu" and mappings.holds(tensor.data_ptr()):
        release_range(tensor.data_ptr(), tensor.nbytes)


def release_range(address: int, nbytes: int) -> None:
    """Drops the whole pages within [address, address + nbytes) of a file mapping from this process
    (MADV_DONTNEED): its pages of a file mapped read-only, which a later read faults back in from the page
    cache."""
    start = _round_up(address, mmap.PAGESIZE)
    stop = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if _libc is not None and stop > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), MADV_DONTNEED)


MADV_DONTNEED = 4
COPY_CHUNK = 32 << 20  # bytes copied before their file pages are released: a large embedding is not resident twice
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def trim_heap() -> None:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim), where this libc has it: parsing
    a tokenizer's JSON and a checkpoint's headers leaves tens of MB freed but resident (55 MB of the default
    model's tokenizer)."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class FileMappings:
    """The address ranges of this process that map a file, as /proc/self/maps listed them when read."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]

    @classmethod
    def read(cls) -> FileMappings:
        spans = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    span, _, rest = line.partition(" ")
                    fields = rest.split(maxsplit=4)
                    if len(fields) == 5 and fields[4].startswith("/"):
                        lo, _, hi = span.partition("-")
                        spans.append((int(lo, 16), int(hi, 16)))
        except OSError:
            pass
        spans.sort()
        return cls(tuple(lo for lo, _ in spans), tuple(hi for _, hi in spans))

    def holds(self, address: int) -> bool:
        return self.span(address) is not None

    def span(self, address: int) -> tuple[int, int] | None:
        """The mapping's range that holds address, if any."""
        i = bisect.bisect_right(self.starts, address) - 1
        return (self.starts[i], self.stops[i]) if i >= 0 and address < self.stops[i] else None


def release_around(tensor: torch.Tensor, mappings: FileMappings) -> None:
    """Drops the pages of the HUGE_PAGE-aligned span around a tensor in a file mapping from this process, once
    it is copied: reading it mapped the file's large folio around it (the page cache's, up to 2 MB), most of it
    other tensors' pages. Those still read fault back in."""
    span = mappings.span(tensor.data_ptr()) if _libc is not None and tensor.device.type == "cpu" else None
    if span is None:
        return
    start = max(span[0], tensor.data_ptr() // HUGE_PAGE * HUGE_PAGE)
    stop = min(span[1], _round_up(tensor.data_ptr() + tensor.nbytes, HUGE_PAGE))
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), MADV_DONTNEED)
