"""A sum over the tensor-parallel ranks of one host, through shared memory instead of gloo.

Why: gloo's all-reduce goes over loopback TCP, ~540 us for the 896 floats of one hidden state on a
2-core machine, and a decode step makes two per layer: together they outlast the whole single-process
step. Here a round costs a copy, a flag and a sum (kernels/shm_all_reduce.c).

How: rank 0 creates a segment in /dev/shm that every rank maps, with a slot of `capacity_bytes` per rank
in each of two sets, and one flag per rank holding the last round it has written. In round k (1, 2, ...)
every rank copies its tensor into its slot of set k % 2, publishes k, waits until every flag reaches k
and sums the slots in rank order, so that every rank gets the same bits. Two sets are enough: a rank
writes round k only after every rank has arrived at round k - 1, so after every rank has finished reading
round k - 2, the last user of that set. A tensor larger than a slot goes through in rounds of a slot each.
The file is unlinked once every rank has mapped it: nothing stays in /dev/shm, whichever process dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
import struct
from pathlib import Path

import torch
import torch.distributed as dist

from slotserve.kernels import native

SOURCE = Path(__file__).parents[1] / "kernels" / "shm_all_reduce.c"


class _Group(ctypes.Structure):
    """struct shm_all_reduce of the kernel: one rank's view of the segment."""

    _fields_ = (("segment", ctypes.c_void_p), ("capacity", ctypes.c_long), ("stride", ctypes.c_long),
                ("world", ctypes.c_int), ("rank", ctypes.c_int), ("timeout_s", ctypes.c_double),
                ("round", ctypes.c_int64), ("seen", ctypes.POINTER(ctypes.c_int64)), ("gone", ctypes.c_int))


_ARGS = (ctypes.POINTER(_Group), ctypes.c_void_p, ctypes.c_long, ctypes.c_int)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's codes
# As in the kernel: a flag per rank 128 bytes apart, the slots from the next page on.
_FLAG_STRIDE, _DATA_ALIGN, _SLOT_ALIGN = 128, 4096, 64


class CollectiveTimeoutError(RuntimeError):
    """Some rank did not reach a collective within its timeout (it hangs, or took another path)."""


class RankGoneError(RuntimeError):
    """The process of a rank this one waited for in a collective is gone."""


def _kernel(name: str = "slotserve_shm_all_reduce") -> ctypes._CFuncPtr | None:
    return native.function(SOURCE, name, _ARGS)


class ShmAllReduce:
    """In-place sums over `world_size` ranks on this host. Constructing it is collective over `cpu_group`
    (a gloo group of exactly these ranks; `rank` is this one's rank in it), and so is every `all_reduce`."""

    def __init__(self, rank: int, world_size: int, cpu_group: dist.ProcessGroup | None,
                 capacity_bytes: int = 8 << 20, timeout_s: float = 60.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is not in a group of {world_size}")
        if capacity_bytes < _SLOT_ALIGN:
            raise ValueError(f"capacity_bytes: {capacity_bytes} is less than {_SLOT_ALIGN}")
        self._kernel = native.require(_kernel(), SOURCE)
        self._publish, self._collect = _kernel("slotserve_shm_publish"), _kernel("slotserve_shm_collect")
        self._completed_at = native.function(SOURCE, "slotserve_shm_completed_at",
                                             (ctypes.POINTER(_Group), ctypes.POINTER(ctypes.c_double)))
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        stride = -(-capacity_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
        data = -(-world_size * _FLAG_STRIDE // _DATA_ALIGN) * _DATA_ALIGN
        size = data + 2 * world_size * stride
        self._unusable: str | None = None  # why all_reduce may no longer run

        name = [f"/dev/shm/slotserve-allreduce-{os.getpid()}-{secrets.token_hex(8)}" if rank == 0 else None]
        fd = -1
        try:
            if rank == 0:  # O_EXCL: never another's segment; ftruncate zero-fills, so every flag starts at 0
                fd = os.open(name[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, size)
            if world_size > 1:
                src = 0 if cpu_group is None else dist.get_global_rank(cpu_group, 0)
                dist.broadcast_object_list(name, src=src, group=cpu_group)
            if rank != 0:
                fd = os.open(name[0], os.O_RDWR)
            self._map = mmap.mmap(fd, size)
            struct.pack_into("q", self._map, rank * _FLAG_STRIDE + 8, os.getpid())  # beside its flag: who waits looks
            if world_size > 1:
                dist.barrier(group=cpu_group)  # every rank has mapped it: the name may go
        finally:
            if fd >= 0:
                os.close(fd)
            if rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name[0])
        self.path: str = name[0]  # gone from /dev/shm once every rank is past the barrier below
        if world_size > 1:
            dist.barrier(group=cpu_group)
        self._view = ctypes.c_char.from_buffer(self._map)  # held: the kernel reads through its address
        self._seen = (ctypes.c_int64 * world_size)()
        self._group = _Group(ctypes.addressof(self._view), capacity_bytes, stride, world_size, rank, timeout_s, 0,
                             self._seen)
        self._group_ref = ctypes.byref(self._group)

    @staticmethod
    def available() -> bool:
        """Whether the kernel builds here."""
        return _kernel() is not None

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sums `t` (a contiguous float32 or bfloat16 CPU tensor) over the ranks, in place; bfloat16 sums in
        float32 and rounds once."""
        self._check(self._kernel(self._group_ref, t.data_ptr(), t.numel(), self._code(t)))

    def fits_one_round(self, t: torch.Tensor) -> bool:
        """Whether `t` can be summed by `start` and `finish` (it fits a slot)."""
        return t.numel() * t.element_size() <= self._group.capacity

    def start(self, t: torch.Tensor) -> None:
        """The first half of `all_reduce` of a tensor that `fits_one_round`: publishes this rank's part. Until
        `finish(t)`, `t` must stay as it is and this group must run no other sum."""
        if not self.fits_one_round(t):
            raise ValueError(f"ShmAllReduce.start: {t.numel() * t.element_size()} bytes do not fit a slot of "
                             f"{self._group.capacity}")
        self._publish(self._group_ref, t.data_ptr(), t.numel(), self._code(t))

    def finish(self, t: torch.Tensor) -> float:
        """The second half: waits for the other ranks' parts and sums them into `t`. Returns when the last rank
        published (`time.monotonic()` seconds): when the communication itself ended."""
        self._check(self._collect(self._group_ref, t.data_ptr(), t.numel(), self._code(t)))
        at = ctypes.c_double()
        self._completed_at(self._group_ref, ctypes.byref(at))
        return at.value

    def _code(self, t: torch.Tensor) -> int:
        code = _DTYPES.get(t.dtype)
        if code is None:
            raise TypeError(f"ShmAllReduce sums float32 or bfloat16 tensors, not {t.dtype}")
        if not (t.is_cpu and t.is_contiguous()):
            raise ValueError(f"ShmAllReduce sums contiguous CPU tensors, not one on {t.device} of strides {t.stride()}")
        if self._unusable is not None:
            raise RuntimeError(f"ShmAllReduce: {self._unusable}")
        return code

    def _check(self, status: int) -> None:
        if status:
            failed = self._group.round
            missing = [r for r in range(self.world_size) if self._seen[r] < failed]
            self._unusable = f"round {failed} failed, so the ranks' rounds no longer match"
            if status == 2:
                raise RankGoneError(f"rank {self.rank}: all-reduce round {failed}: the process of rank "
                                    f"{self._group.gone} is gone")
            raise CollectiveTimeoutError(f"rank {self.rank}: all-reduce round {failed} timed out after "
                                         f"{self.timeout_s:g} s; ranks {missing} did not arrive")

    def close(self) -> None:
        """Unmaps the segment; the object is unusable afterwards."""
        if self._map.closed:
            return
        self._unusable = "closed"
        del self._view  # the mmap cannot close while a ctypes object exports its buffer
        self._map.close()
