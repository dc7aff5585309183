"""slotserve: an inference and serving engine for the Qwen model family."""

from slotserve.entrypoints.llm import LLM
from slotserve.outputs import CompletionOutput, RequestOutput
from slotserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
