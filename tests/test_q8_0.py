"""Q8_0 at load (quantization="q8_0"): the blocks are llama.cpp's (gguf-py's) value for value, every linear and
embedding weight of a float checkpoint is held as a packing with no float32 copy, the output equals that of a
float32 checkpoint of the same Q8_0 values, the vision tower and the MoE router stay float, and the memory check
counts the packings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from PIL import Image
from safetensors.torch import load_file, save_file

from slotserve import LLM, SamplingParams
from slotserve.config import EngineConfig, ModelConfig
from slotserve.layers.embedding import VocabEmbedding
from slotserve.layers.linear import Linear
from slotserve.models.loader import build_meta_model, q8_0_params, weight_footprint
from slotserve.quantization.packed_linear import PackedWeight, built
from slotserve.quantization.q8_0 import quantize_q8_0
from tests.conftest import build_tiny_model
from tests.test_qwen3_vl import build_tiny_vl

pytestmark = pytest.mark.skipif(not built(), reason="the packed kernels do not build here")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Hello there", "def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]


def reference_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """gguf-py's Q8_0 round trip of a weight, in float32."""
    data = weight.float().numpy()
    return torch.from_numpy(quants.dequantize(quants.quantize(data, GGMLQuantizationType.Q8_0),
                                              GGMLQuantizationType.Q8_0))


def test_blocks_equal_gguf_py():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 256, generator=gen) * 0.05
    weight[3, :32] = 0  # a block of zeros: scale 0
    weight[5, 40] = 1e-30  # a block whose largest value is tiny
    weight[7, :32] = torch.arange(32) * 0.5 - 8  # values that land on halves after scaling
    for w in (weight, weight.bfloat16()):
        tensor = quantize_q8_0(w)
        assert torch.equal(PackedWeight.of(tensor).dequantize(), reference_q8_0(w))
    assert quantize_q8_0(torch.zeros(4, 48)) is None  # rows that are not whole blocks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny bfloat16 checkpoint, and a float32 one holding its weights' Q8_0 values (what llama.cpp's Q8_0
    conversion of it would hold), the norms and other 1-D tensors as they are."""
    bf16 = tmp_path_factory.mktemp("q8-bf16")
    build_tiny_model(bf16, "qwen2", dtype=torch.bfloat16)
    exact = tmp_path_factory.mktemp("q8-exact")
    build_tiny_model(exact, "qwen2")
    tensors = load_file(exact / "model.safetensors")
    source = load_file(bf16 / "model.safetensors")
    save_file({k: reference_q8_0(source[k]) if v.dim() == 2 else source[k].float() for k, v in tensors.items()},
              exact / "model.safetensors", metadata={"format": "pt"})
    return bf16, exact


def test_every_linear_and_embedding_is_held_as_q8_0(checkpoints):
    bf16, exact = checkpoints
    llm = LLM(str(bf16), quantization="q8_0", kv_cache_memory=8 << 20)
    reference = load_file(exact / "model.safetensors")
    modules = [(n, m) for n, m in llm.engine.core.model.named_modules() if isinstance(m, Linear | VocabEmbedding)]
    assert modules
    for name, module in modules:
        assert module.weight is None, name  # no float32 copy
        dense = PackedWeight.of(module.packed.tensor()).dequantize()[:module.packed.n]
        if name.endswith("qkv_proj"):
            parts = [reference[name.replace("qkv_proj", p) + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(dense, torch.cat(parts)), name
        elif name.endswith("gate_up_proj"):
            parts = [reference[name.replace("gate_up_proj", p) + ".weight"] for p in ("gate_proj", "up_proj")]
            assert torch.equal(dense, torch.cat(parts)), name
        else:
            assert torch.equal(dense, reference[f"{name}.weight"]), name
    llm.shutdown()


def test_greedy_output_equals_a_float32_checkpoint_of_the_same_values(checkpoints):
    bf16, exact = checkpoints
    ours = LLM(str(bf16), quantization="q8_0", kv_cache_memory=8 << 20)
    got = [o.outputs[0].token_ids for o in ours.generate(PROMPTS, GREEDY)]
    alone = [ours.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    ours.shutdown()
    plain = LLM(str(exact), kv_cache_memory=8 << 20)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    plain.shutdown()
    assert got == expected == alone


def test_the_vision_tower_stays_float(tmp_path):
    build_tiny_vl(tmp_path)
    llm = LLM(str(tmp_path), quantization="q8_0", kv_cache_memory=16 << 20)
    model = llm.engine.core.model
    assert all(p.dtype in (torch.float32, torch.bfloat16) for p in model.model.visual.parameters())
    assert model.model.language_model.layers[0].mlp.gate_up_proj.weight is None
    assert model.model.language_model.embed_tokens.weight is None
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.shutdown()


def test_the_moe_router_stays_float():
    cfg = ModelConfig.from_dict(dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    params = q8_0_params(build_meta_model(cfg))
    assert "model.layers.0.mlp.gate.weight" not in params
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in params and "model.embed_tokens.weight" in params


def test_the_memory_check_counts_the_packings(checkpoints):
    bf16, _ = checkpoints
    model = build_meta_model(ModelConfig.from_dir(bf16))
    cpu = torch.device("cpu")
    plain = weight_footprint(model, torch.float32, cpu)
    q8 = weight_footprint(model, torch.float32, cpu, quantized=q8_0_params(model))
    assert q8.mapped + q8.copied < 0.35 * (plain.mapped + plain.copied)


@pytest.mark.parametrize("settings, message", [
    (dict(quantization="q4"), "unknown value 'q4'"),
    (dict(quantization="q8_0", device="cuda"), "q8_0 runs on CPU only"),
    (dict(quantization="q8_0", dtype="bfloat16"), "q8_0 computes in float32"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=f"quantization: {message}"):
        EngineConfig(**settings)
