"""Qwen3 dense: the Qwen2 decoder with q/k RMSNorm, no q/k/v bias and an explicit head_dim.

The config switches (`qk_norm`, `attention_bias`, `head_dim`) select those differences, so the
network itself is the one in qwen2.py.
"""

from slotserve.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    pass
