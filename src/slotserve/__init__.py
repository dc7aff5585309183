"""slotserve: an inference and serving engine for the Qwen model family."""

import os

# MKL picks its GEMM code by CPU, and where it is not on an Intel one (AMD EPYC, measured) a row's
# result then depends on how many rows share the call and on the thread layout: SDPA gave a decode row
# different last bits alone than in a batch of 4. AUTO keeps the fastest branch for this CPU and makes
# it reproducible (same rate here). MKL reads this at its first call, so it is set before torch computes.
os.environ.setdefault("MKL_CBWR", "AUTO")

import importlib

# Imported on first use, so that a process that needs one part (the front end, a worker, the protocol alone)
# does not import the whole engine.
_EXPORTS = {
    "LLM": "slotserve.entrypoints.llm",
    "CompletionOutput": "slotserve.outputs",
    "EmbeddingOutput": "slotserve.outputs",
    "RequestOutput": "slotserve.outputs",
    "PoolingParams": "slotserve.pooling_params",
    "SamplingParams": "slotserve.sampling_params",
    "StructuredOutputsParams": "slotserve.sampling_params",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'slotserve' has no attribute {name!r}")
