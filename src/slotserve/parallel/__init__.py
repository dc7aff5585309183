"""CPU parallelism: the parfor thread pool."""

from slotserve.parallel.threadpool import (
    ThreadPool,
    available_cores,
    chunk_bounds,
    configure_pool,
    configure_torch_threads,
    default_threads,
    get_pool,
    parfor,
    parse_cpu_list,
    torch_threads_for,
    worker_id,
)

__all__ = [
    "ThreadPool",
    "available_cores",
    "chunk_bounds",
    "configure_pool",
    "configure_torch_threads",
    "default_threads",
    "get_pool",
    "parfor",
    "parse_cpu_list",
    "torch_threads_for",
    "worker_id",
]
