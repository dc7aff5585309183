"""`python -m slotserve.bench.random_gguf OUT.gguf --shape NAME`: a GGUF of a published model's exact shapes
(Qwen2.5-7B's by default; Qwen3-8B's, Qwen3-30B-A3B's mixture of experts) in Q4_K_M's types, its weights random
blocks, its tokenizer the bundled model's: a model too large for the bundled ones to measure load time, memory
and speed on (`slotserve bench latency -m OUT.gguf`, `python -m slotserve.bench.dev peer -m OUT.gguf`).

The blocks are written as random bytes, not quantized from float weights, so a 7B file takes seconds, not an
hour: any bytes are valid Q4_K and Q6_K blocks, and only the block scales are chosen, to give weights of about
WEIGHT_STD (the text it generates is noise).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from slotserve import model_store
from slotserve.models.gguf_reader import read_gguf

WEIGHT_STD = 0.02  # about what a trained model's linears hold
# The bytes of one block of 256 values: Q4_K holds d and dmin (float16), 12 bytes of 6-bit scales and mins, 128
# of 4-bit values; Q6_K holds 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, then d (float16).
BLOCK = 256
Q4_K_BYTES, Q6_K_BYTES = 144, 210


class Arch(str, Enum):
    """llama.cpp's architecture name: Qwen2 (q/k/v biases), Qwen3 (q/k norms, no biases), Qwen3-MoE."""

    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    QWEN3_MOE = "qwen3moe"


@dataclass(frozen=True)
class Shapes:
    """A Qwen model's sizes, as its config.json gives them; `experts` > 0 for a mixture of experts, every layer
    sparse (as in every Qwen3-MoE release)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    context: int = 32768
    rope_theta: float = 1_000_000.0
    arch: Arch = Arch.QWEN2
    head_dim: int | None = None  # hidden // heads where None
    experts: int = 0
    experts_used: int = 0
    moe_intermediate: int = 0

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "qwen2.5-7b": Shapes(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064),
    "qwen2.5-3b": Shapes(hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, vocab=151936),
    "qwen3-8b": Shapes(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, vocab=151936,
                       context=40960, arch=Arch.QWEN3, head_dim=128),
    "qwen3-30b-a3b": Shapes(hidden=2048, intermediate=6144, layers=48, heads=32, kv_heads=4, vocab=151936,
                            context=40960, arch=Arch.QWEN3_MOE, head_dim=128, experts=128, experts_used=8,
                            moe_intermediate=768),
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for attn_v and ffn_down: Q6_K in the first and last eighth and every third
    layer between, Q4_K in the others."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_types(s: Shapes) -> dict[str, tuple[tuple[int, ...], Q]]:
    """GGUF name -> (numpy shape, type) of every tensor, as llama.cpp's Q4_K_M writes the model (the router
    stays F32; an expert tensor stacks the layer's experts on its first axis)."""
    q, kv = s.heads * s.head_size, s.kv_heads * s.head_size
    tensors = {"token_embd.weight": ((s.vocab, s.hidden), Q.Q4_K), "output_norm.weight": ((s.hidden,), Q.F32),
               "output.weight": ((s.vocab, s.hidden), Q.Q6_K)}
    for i in range(s.layers):
        wide = Q.Q6_K if _more_bits(i, s.layers) else Q.Q4_K
        b = f"blk.{i}."
        tensors |= {
            b + "attn_norm.weight": ((s.hidden,), Q.F32), b + "ffn_norm.weight": ((s.hidden,), Q.F32),
            b + "attn_q.weight": ((q, s.hidden), Q.Q4_K), b + "attn_k.weight": ((kv, s.hidden), Q.Q4_K),
            b + "attn_v.weight": ((kv, s.hidden), wide), b + "attn_output.weight": ((s.hidden, q), Q.Q4_K),
        }
        if s.arch == Arch.QWEN2:
            tensors |= {b + "attn_q.bias": ((q,), Q.F32), b + "attn_k.bias": ((kv,), Q.F32),
                        b + "attn_v.bias": ((kv,), Q.F32)}
        else:
            tensors |= {b + "attn_q_norm.weight": ((s.head_size,), Q.F32),
                        b + "attn_k_norm.weight": ((s.head_size,), Q.F32)}
        if s.experts:
            e, inter = s.experts, s.moe_intermediate
            tensors |= {b + "ffn_gate_inp.weight": ((e, s.hidden), Q.F32),
                        b + "ffn_gate_exps.weight": ((e, inter, s.hidden), Q.Q4_K),
                        b + "ffn_up_exps.weight": ((e, inter, s.hidden), Q.Q4_K),
                        b + "ffn_down_exps.weight": ((e, s.hidden, inter), wide)}
        else:
            tensors |= {b + "ffn_gate.weight": ((s.intermediate, s.hidden), Q.Q4_K),
                        b + "ffn_up.weight": ((s.intermediate, s.hidden), Q.Q4_K),
                        b + "ffn_down.weight": ((s.hidden, s.intermediate), wide)}
    return tensors


def _float16_bytes(value: float, count: int) -> np.ndarray:
    return np.full(count, value, dtype=np.float16).view(np.uint8).reshape(count, 2)


def random_blocks(rows: int, columns: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random Q4_K or Q6_K blocks whose values spread about WEIGHT_STD."""
    blocks = rows * columns // BLOCK
    if qtype == Q.Q4_K:  # value = d * scale * q - dmin * min; q in 0..15, scale and min in 0..63
        out = rng.integers(0, 256, (blocks, Q4_K_BYTES), dtype=np.uint8)
        d = WEIGHT_STD / 257  # the spread of scale * q - 7.5 * min, over uniform bytes
        out[:, 0:2], out[:, 2:4] = _float16_bytes(d, blocks), _float16_bytes(7.5 * d, blocks)  # min centres q
    else:  # value = d * scale * (q - 32); q in 0..63; the int8 scales kept in 1..16
        out = rng.integers(0, 256, (blocks, Q6_K_BYTES), dtype=np.uint8)
        out[:, 192:208] = rng.integers(1, 17, (blocks, 16), dtype=np.uint8)
        out[:, 208:210] = _float16_bytes(WEIGHT_STD / (10.0 * 18.5), blocks)  # rms scale 10, q - 32 of 18.5
    return out.reshape(rows, -1)


def add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata entry, in the GGUF type its Python type implies (integers as uint32, floats as float32)."""
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


def _metadata(writer: gguf.GGUFWriter, s: Shapes, tokenizer_source: Path) -> None:
    a = s.arch.value
    writer.add_string("general.name", f"random-{a}")
    sizes = {"block_count": s.layers, "context_length": s.context, "embedding_length": s.hidden,
             "feed_forward_length": s.intermediate, "attention.head_count": s.heads,
             "attention.head_count_kv": s.kv_heads, "attention.key_length": s.head_size,
             "attention.value_length": s.head_size}
    if s.experts:
        sizes |= {"expert_count": s.experts, "expert_used_count": s.experts_used,
                  "expert_feed_forward_length": s.moe_intermediate}
    for key, value in sizes.items():
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    source = read_gguf(tokenizer_source).metadata
    tokens = list(source["tokenizer.ggml.tokens"])
    types = list(source["tokenizer.ggml.token_type"])
    pads = s.vocab - len(tokens)  # real Qwen GGUFs list the embedding's padding rows as [PAD] tokens
    writer.add_array("tokenizer.ggml.tokens", tokens + [f"[PAD{len(tokens) + i}]" for i in range(pads)])
    writer.add_array("tokenizer.ggml.token_type", types + [int(gguf.TokenType.UNUSED)] * pads)
    for key, value in source.items():
        if key.startswith("tokenizer.") and key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            add_value(writer, key, value)


def write_random_gguf(out: Path, s: Shapes, tokenizer_source: Path, seed: int = 0) -> int:
    """Writes the GGUF, one tensor at a time; its size in bytes."""
    tensors = tensor_types(s)
    writer = gguf.GGUFWriter(out, s.arch.value)
    _metadata(writer, s, tokenizer_source)
    for name, (shape, qtype) in tensors.items():
        if qtype == Q.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            row = shape[-1] // BLOCK * (Q4_K_BYTES if qtype == Q.Q4_K else Q6_K_BYTES)
            writer.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8), math.prod(shape[:-1]) * row,
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, (shape, qtype) in tensors.items():
        if qtype != Q.F32:
            writer.write_tensor_data(random_blocks(math.prod(shape[:-1]), shape[-1], qtype, rng))
        elif name.endswith("ffn_gate_inp.weight"):  # a router that spreads tokens over the experts
            writer.write_tensor_data(rng.normal(0.0, WEIGHT_STD, shape).astype(np.float32))
        else:  # norms of one, biases of zero
            writer.write_tensor_data(np.full(shape, 1.0 if name.endswith("norm.weight") else 0.0, np.float32))
    writer.close()
    return out.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slotserve.bench.random_gguf", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="a Qwen GGUF to take the tokenizer from (default: the bundled model's)")
    args = parser.parse_args(argv)
    source = args.tokenizer_from or model_store.assemble(model_store.DEFAULT_MODEL)
    size = write_random_gguf(args.out, SHAPES[args.shape], source, args.seed)
    print(json.dumps({"gguf": str(args.out), "shape": args.shape, "bytes": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
