"""Developer benchmarks: the engine's kernels against this machine's limits, ways of reading the paged KV
cache, the thread pool. Run as `python -m slotserve.bench.dev {kernels,attention,threads} [args]`; each prints
one line of JSON."""
