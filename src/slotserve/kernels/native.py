"""C kernels shipped as source: compiled once per machine with the system C compiler, loaded with ctypes.

No build step at install time and no torch headers: a kernel is one plain C file (plus the headers the
kernels share, vector.h and packed_linear.h; decode_layers.c includes the kernels it runs in one call), built
on first use with `-march=native` into `$SLOTSERVE_CACHE/kernels/<hash>/` (the hash covers the sources, the
flags, the compiler and the CPU, so a shared home directory never hands one machine another's build) and
loaded from there afterwards. OpenMP regions in a kernel run on the OpenMP runtime torch has already loaded
(`libgomp.so.1` is matched by its soname), so a kernel and torch's own ops share one set of threads.

Where no compiler or OpenMP is at hand (or `SLOTSERVE_NATIVE_KERNELS=0`), `load` answers None and the
caller keeps its torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

from slotserve import envs

log = logging.getLogger(__name__)

STALE_DAYS = 30
SOURCE_DIR = Path(__file__).parent  # the C sources, beside this file
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")


class KernelUnavailableError(RuntimeError):
    """A native kernel was called where it could not be built; check its `available()` first."""


def enabled() -> bool:
    return envs.native_kernels()


def takes(*tensors: torch.Tensor) -> bool:
    """Whether these tensors are what the kernels compute on: float32 on the CPU, outside autograd."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _compiler() -> str:
    return os.environ.get("CC", "cc")


@functools.cache
def _machine() -> str:
    """The compiler's version and the CPU's model and flags: what a build depends on beyond its sources."""
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    try:
        with open("/proc/cpuinfo") as f:
            cpu = "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
    except OSError:
        cpu = platform.processor() + platform.machine()
    return version + cpu


def _build(source: Path, target: Path, flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    cmd = [_compiler(), *flags, "-o", str(tmp), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise OSError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")
    os.replace(tmp, target)  # atomic: a concurrent process sees the old state or the whole library


@functools.cache
def load(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library for `source` (built on first use), or None where it cannot be built here.
    `extra_flags` build another form of it (e.g. `-mno-avx512f`: what a CPU without AVX-512 runs)."""
    if not enabled():
        return None
    try:
        flags = FLAGS + extra_flags
        siblings = [f.read_text() for f in sorted(source.parent.glob("*.[ch]"))]  # what the source may include
        key = hashlib.sha256("\0".join([source.read_text(), *siblings, *flags, _machine()]).encode())
        target = envs.cache_dir() / "kernels" / key.hexdigest()[:16] / f"{source.stem}.so"
        if not target.exists():
            log.info("compiling %s for this machine", source.name)
            _build(source, target, flags)
            _prune(target.parent)
        with contextlib.suppress(OSError):  # a read-only cache still loads
            os.utime(target.parent)  # in use: what _prune goes by
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native kernel %s unavailable, using torch's: %s", source.name, e)
        return None


def _prune(current: Path) -> None:
    """Removes the builds of other versions of the sources (or other machines sharing a home directory)
    that no process has loaded for STALE_DAYS: each edit of a kernel leaves a directory behind."""
    cutoff = time.time() - STALE_DAYS * 86400
    for build in current.parent.iterdir():
        with contextlib.suppress(OSError):
            if build != current and build.is_dir() and build.stat().st_mtime < cutoff:
                shutil.rmtree(build)


@functools.cache
def function(source: Path, name: str, argtypes: tuple[type, ...],
             extra_flags: tuple[str, ...] = ()) -> ctypes._CFuncPtr | None:
    """`name` from `source`'s library (built with `extra_flags` too), typed (returning a C int), or None where
    it cannot be built."""
    lib = load(source, extra_flags)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


def require(fn: ctypes._CFuncPtr | None, source: Path) -> ctypes._CFuncPtr:
    if fn is None:
        raise KernelUnavailableError(f"{source.name} is not built on this machine (no C compiler with OpenMP,"
                                     " or SLOTSERVE_NATIVE_KERNELS=0)")
    return fn
