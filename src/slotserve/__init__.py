"""slotserve: an inference and serving engine for the Qwen model family."""

import os

# MKL picks its GEMM code by CPU, and where it is not on an Intel one (AMD EPYC, measured) a row's
# result then depends on how many rows share the call and on the thread layout: SDPA gave a decode row
# different last bits alone than in a batch of 4. AUTO keeps the fastest branch for this CPU and makes
# it reproducible (same rate here). MKL reads this at its first call, so it is set before torch computes.
os.environ.setdefault("MKL_CBWR", "AUTO")

from slotserve.entrypoints.llm import LLM
from slotserve.outputs import CompletionOutput, EmbeddingOutput, RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "EmbeddingOutput", "PoolingParams", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"
