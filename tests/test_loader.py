"""Loading a Hugging Face directory: sharded checkpoints, and clear errors for broken ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from slotserve.config import ConfigError, ModelConfig
from slotserve.models.loader import WeightsError, load_model
from slotserve.models.registry import UnsupportedArchitectureError
from tests.conftest import build_tiny_model

CPU = torch.device("cpu")


@pytest.fixture
def tiny(tmp_path):
    build_tiny_model(tmp_path, "qwen2")
    return tmp_path


def _weights(path):
    return load_file(path / "model.safetensors")


def test_sharded_checkpoint_loads_like_a_single_file(tiny, tmp_path_factory):
    whole, _ = load_model(tiny, torch.float32, CPU)
    tensors = _weights(tiny)
    (tiny / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tiny / file)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tiny / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _ = load_model(tiny, torch.float32, CPU)
    for (name, a), (_, b) in zip(whole.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_bfloat16_load_converts_weights(tiny):
    model, _ = load_model(tiny, torch.bfloat16, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_tensor_is_named(tiny):
    tensors = _weights(tiny)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(WeightsError, match=r"lacks 1 tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tiny, torch.float32, CPU)


def test_q_k_v_load_into_the_merged_projection(tiny):
    tensors = _weights(tiny)
    model, _ = load_model(tiny, torch.float32, CPU)
    attn = model.model.layers[1].self_attn
    parts = [tensors[f"model.layers.1.self_attn.{p}_proj.{kind}"] for kind in ("weight", "bias") for p in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(parts[:3]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat(parts[3:]))


def test_missing_part_of_a_merged_projection_is_named(tiny):
    tensors = _weights(tiny)
    del tensors["model.layers.0.self_attn.v_proj.bias"]
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(WeightsError, match=r"lacks 1 tensors: model\.layers\.0\.self_attn\.v_proj\.bias"):
        load_model(tiny, torch.float32, CPU)


def test_wrong_shape_is_named(tiny):
    tensors = _weights(tiny)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(WeightsError, match=r"k_proj\.weight.*shape \(3, 64\).*implies \(32, 64\)"):
        load_model(tiny, torch.float32, CPU)


def test_unexpected_tensor_is_named(tiny):
    tensors = _weights(tiny)
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(WeightsError, match="mystery"):
        load_model(tiny, torch.float32, CPU)


def test_truncated_file_names_the_file(tiny):
    data = (tiny / "model.safetensors").read_bytes()
    (tiny / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"model\.safetensors"):
        load_model(tiny, torch.float32, CPU)


def test_missing_shard_and_no_weights(tiny):
    (tiny / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "nope.safetensors"}}))
    with pytest.raises(WeightsError, match=r"missing: nope\.safetensors"):
        load_model(tiny, torch.float32, CPU)
    (tiny / "model.safetensors.index.json").unlink()
    (tiny / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"no \*\.safetensors"):
        load_model(tiny, torch.float32, CPU)


def test_unknown_architecture_lists_supported(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="Qwen2ForCausalLM, Qwen2Model, Qwen3ForCausalLM"):
        load_model(tiny, torch.float32, CPU)


def test_config_errors(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    del cfg["hidden_size"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dir(tiny)
    (tiny / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tiny)
    with pytest.raises(ConfigError, match="rope type 'dynamic'"):
        ModelConfig.from_dict({**cfg, "hidden_size": 64, "rope_parameters": {"rope_type": "dynamic", "factor": 2}})


def test_eos_ids_merge_config_and_generation_config(tiny):
    cfg = ModelConfig.from_dir(tiny)
    assert cfg.eos_token_ids == (151645, 151643)
