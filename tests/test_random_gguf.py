"""The random large-model GGUF (bench/random_gguf.py): Q4_K_M's types, weights of about WEIGHT_STD, a model the
engine loads on its packings and runs."""

from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

from slotserve.bench.random_gguf import SHAPES, WEIGHT_STD, Arch, Shapes, tensor_types, write_random_gguf
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq
from slotserve.models.gguf import convert_gguf
from slotserve.models.gguf_reader import read_gguf
from slotserve.models.loader import load_model, packed_tensors
from slotserve.quantization import packed_linear
from slotserve.quantization.packed_linear import PackedWeight
from tests.gguf_fixtures import VOCAB_ROWS, tiny_gguf

SMALL = Shapes(hidden=256, intermediate=512, layers=8, heads=4, kv_heads=2, vocab=VOCAB_ROWS + 32, context=512)


def test_the_7b_shapes_and_types_are_q4_k_m():
    tensors = tensor_types(SHAPES["qwen2.5-7b"])
    params = sum(math.prod(shape) for shape, _ in tensors.values())
    assert 7.0e9 < params < 7.7e9  # Qwen2.5-7B: 7.6 B
    assert tensors["output.weight"][1] == Q.Q6_K and tensors["token_embd.weight"][1] == Q.Q4_K
    wide = [i for i in range(28) if tensors[f"blk.{i}.ffn_down.weight"][1] == Q.Q6_K]
    assert wide == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]  # llama.cpp's use_more_bits


def test_the_qwen3_shapes_are_the_published_ones():
    dense, moe = tensor_types(SHAPES["qwen3-8b"]), tensor_types(SHAPES["qwen3-30b-a3b"])
    assert 8.1e9 < sum(math.prod(shape) for shape, _ in dense.values()) < 8.3e9  # Qwen3-8B: 8.2 B
    assert 30.4e9 < sum(math.prod(shape) for shape, _ in moe.values()) < 30.6e9  # Qwen3-30B-A3B: 30.5 B
    assert dense["blk.0.attn_q.weight"][0] == (4096, 4096) and "blk.0.attn_q.bias" not in dense
    assert dense["blk.0.attn_k_norm.weight"] == ((128,), Q.F32)
    assert moe["blk.0.attn_q.weight"][0] == (4096, 2048) and moe["blk.0.attn_output.weight"][0] == (2048, 4096)
    assert moe["blk.7.ffn_gate_exps.weight"] == ((128, 768, 2048), Q.Q4_K)
    assert moe["blk.0.ffn_down_exps.weight"] == ((128, 2048, 768), Q.Q6_K)  # use_more_bits, as a dense ffn_down
    assert moe["blk.0.ffn_gate_inp.weight"] == ((128, 2048), Q.F32) and "blk.0.ffn_up.weight" not in moe


def test_a_random_moe_gguf_converts_and_runs(tmp_path):
    tokenizer = tiny_gguf()[0].write(tmp_path / "tokenizer.gguf")
    path = tmp_path / "random.gguf"
    write_random_gguf(path, Shapes(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=SMALL.vocab,
                                   context=64, arch=Arch.QWEN3_MOE, head_dim=64, experts=8, experts_used=2,
                                   moe_intermediate=256), tokenizer)
    g = read_gguf(path)
    assert g.architecture == "qwen3moe" and g.tensors["blk.1.ffn_up_exps.weight"].shape == (8, 256, 256)
    convert_gguf(path, tmp_path / "out")
    model, cfg = load_model(tmp_path / "out", torch.float32, torch.device("cpu"))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.head_dim) == (8, 2, 256, 64)
    runner = ModelRunner(model, cfg, num_blocks=16, block_size=4)
    logits = runner.execute([ScheduledSeq([3, 70, 200, 5], 0, [0])])[0].logits
    assert logits.shape == (1, SMALL.vocab) and bool(torch.isfinite(logits).all())


def test_a_random_gguf_converts_and_runs(tmp_path):
    tokenizer = tiny_gguf()[0].write(tmp_path / "tokenizer.gguf")
    path = tmp_path / "random.gguf"
    write_random_gguf(path, SMALL, tokenizer)
    g = read_gguf(path)
    assert g.tensors["blk.0.ffn_down.weight"].qtype == Q.Q6_K and g.tensors["blk.3.ffn_up.weight"].qtype == Q.Q4_K
    assert len(g.metadata["tokenizer.ggml.tokens"]) == SMALL.vocab
    for name in ("blk.3.ffn_up.weight", "blk.0.ffn_down.weight"):
        w = g.dequantize(name)
        assert abs(w.mean()) < 0.1 * WEIGHT_STD and 0.7 * WEIGHT_STD < w.std() < 1.3 * WEIGHT_STD, name
    out = tmp_path / "out"
    convert_gguf(path, out)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        packed = {name: read() for name, read in packed_tensors(f).items()}
    for hf_name, gguf_name, bits in (("model.layers.3.mlp.up_proj.weight", "blk.3.ffn_up.weight", 4),
                                     ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", 6)):
        tensor = packed[hf_name]  # read from the blocks' bytes: int8 scale codes, the GGUF's weights exactly
        assert tensor.bits == bits and tensor.scales.codes.dtype == torch.int8
        assert torch.equal(PackedWeight.of(tensor).dequantize(), torch.from_numpy(g.dequantize(gguf_name)))
    model, cfg = load_model(out, torch.float32, torch.device("cpu"))
    assert cfg.num_hidden_layers == SMALL.layers and cfg.vocab_size == SMALL.vocab
    runner = ModelRunner(model, cfg, num_blocks=16, block_size=4)
    logits = runner.execute([ScheduledSeq([3, 70, 200, 5], 0, [0])])[0].logits
    assert logits.shape == (1, SMALL.vocab) and bool(torch.isfinite(logits).all())


def test_without_the_kernels_k_quants_convert_to_float32(tmp_path, monkeypatch):
    """A machine where the kernels do not build keeps no packings it could not run."""
    monkeypatch.setattr(packed_linear, "built", lambda: False)
    tokenizer = tiny_gguf()[0].write(tmp_path / "tokenizer.gguf")
    path = tmp_path / "random.gguf"
    write_random_gguf(path, Shapes(hidden=256, intermediate=256, layers=1, heads=4, kv_heads=2, vocab=SMALL.vocab,
                                   context=64), tokenizer)
    convert_gguf(path, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert not packed_tensors(f)
        up = f.get_tensor("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(up, torch.from_numpy(read_gguf(path).dequantize("blk.0.ffn_up.weight")))
