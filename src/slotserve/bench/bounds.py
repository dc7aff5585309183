"""What this machine allows: the rate of a large GEMM, the float32 multiply-add peak (kernels/fma_peak.c), the
memory read rate (kernels/memory_read.c), and the FLOPs and weight bytes of a model's steps to divide by them.
Shared by `slotserve bench latency` and `throughput` and the developer benchmarks (slotserve/bench/dev)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slotserve import host_memory
from slotserve.bench.timing import seconds
from slotserve.kernels import native
from slotserve.layers.linear import Linear
from slotserve.quantization.int8 import Int8Linear
from slotserve.quantization.packed_linear import PANEL_ROWS

GEMM_SIZE = 2048
GEMM_FLOPS = 2 * GEMM_SIZE**3  # of one gemm_pass
FMA_SOURCE = Path(native.__file__).with_name("fma_peak.c")
FMA_SECONDS = 0.1  # of one fma_peak pass, about


def gemm_pass(dtype: torch.dtype = torch.float32) -> Callable[[], object]:
    """One GEMM of GEMM_SIZE squared in `dtype`: the sustained rate of a large shape."""
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=dtype), torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=dtype)
    return lambda: a @ b


def gemm_rate(dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a large square GEMM in `dtype`, best of three after a warm-up."""
    gemm = gemm_pass(dtype)
    gemm()
    return GEMM_FLOPS / min(seconds(gemm) for _ in range(3))


READ_BYTES = 1 << 30
READ_SOURCE = Path(native.__file__).with_name("memory_read.c")
READ_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p)  # slotserve_read_sum's


def read_buffer(huge_pages: bool = True) -> torch.Tensor:
    """READ_BYTES of float32 ones, far more than the caches hold: in huge pages (where the engine keeps its
    weights) or in torch's own allocation (4 KB pages, unless the system gives every allocation huge ones)."""
    if huge_pages and host_memory.enabled():
        return host_memory.huge_page_bytes(READ_BYTES).view(torch.float32).fill_(1.0)
    return torch.ones(READ_BYTES // 4)


def read_pass(buffer: torch.Tensor) -> Callable[[], object]:
    """One read of the buffer from DRAM, by plain vector loads on all of torch's threads
    (kernels/memory_read.c); where the native kernels are not built, by torch's `sum`, which reads ~20 %
    slower here (`memory_read_torch_sum_GBps`)."""
    read = native.function(READ_SOURCE, "slotserve_read_sum", READ_ARGS)
    if read is None:
        return buffer.sum
    sink = ctypes.c_float()
    return lambda: read(buffer.data_ptr(), buffer.numel(), torch.get_num_threads(), ctypes.byref(sink))


def read_rate() -> float:
    """Bytes/s of one read of READ_BYTES in huge pages (where the engine keeps its weights), the best of three
    after a warm-up: what bounds a batch-1 decode step, which streams its weights once."""
    buffer = read_buffer()
    read = read_pass(buffer)
    read()
    return READ_BYTES / min(seconds(read) for _ in range(3))


def fma_peak() -> float | None:
    """FLOP/s of float32 multiply-adds on registers alone on all of torch's threads (kernels/fma_peak.c),
    the best of three passes of ~FMA_SECONDS; None where the native kernels are not built."""
    loop = native.function(FMA_SOURCE, "slotserve_fma_loop", (ctypes.c_long, ctypes.c_int, ctypes.c_void_p))
    if loop is None:
        return None
    per_iteration = native.function(FMA_SOURCE, "slotserve_fma_flops_per_iteration", ())()
    threads, sink = torch.get_num_threads(), ctypes.c_float()

    def timed(iterations: int) -> float:
        return seconds(lambda: loop(iterations, threads, ctypes.byref(sink)))

    iterations = 1_000_000
    while (elapsed := timed(iterations)) < FMA_SECONDS / 4:
        iterations *= 4
    iterations = int(iterations * FMA_SECONDS / elapsed)
    return per_iteration * iterations * threads / min(timed(iterations) for _ in range(3))


def linear_params(model: nn.Module) -> tuple[int, int, int]:
    """(parameters in decoder linears, parameters in the output head, bytes of all of them that a batch-1
    decode step reads: a packing's where it serves one row, layers/linear.py), a token's: of a mixture of experts,
    the share its top_k of num_experts are."""
    share = {id(m): mixture.top_k / mixture.num_experts for mixture in model.modules()
             if hasattr(mixture, "experts") and hasattr(mixture, "top_k") for m in mixture.experts.modules()}
    body = head = nbytes = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear | Int8Linear):
            params = m.in_features * m.out_features
            if isinstance(m, Linear):
                read = m.streamed_bytes(1)
            else:
                read = params * (1 if isinstance(m, Int8Linear) else m.weight.element_size())
            nbytes += round(read * share.get(id(m), 1.0))
            if name.endswith("lm_head"):
                head += params
            else:
                body += round(params * share.get(id(m), 1.0))
    return body, head, nbytes


def prefill_dtype(model: nn.Module) -> torch.dtype:
    """What a long prompt's linears multiply in: their packings' panels where they have packings
    (quantization/packed_linear.py), else the model's dtype."""
    for m in model.modules():
        if isinstance(m, Linear) and (packed := m.current_packed()) is not None and packed.runs(PANEL_ROWS):
            return packed.panel_dtype if packed.narrow else torch.bfloat16  # a bfloat16 packing: on AMX
    return next(model.parameters()).dtype


def attention_pair_flops(cfg: Any) -> int:
    """FLOPs of attention per (query, key) pair: QK^T and PV, 2 * heads * head_dim each, in every layer."""
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
