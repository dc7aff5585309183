"""slotserve: an inference and serving engine for the Qwen model family."""

from slotserve.entrypoints.llm import LLM
from slotserve.outputs import CompletionOutput, EmbeddingOutput, RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EmbeddingOutput", "PoolingParams", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
