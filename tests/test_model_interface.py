"""Every architecture the registry maps is a model as models/interface.py says: a causal LM (a vision-language
one for Qwen3-VL), or, for the embedding checkpoints, a model without a head. Built on the meta device from tiny
configs, so no weights are read."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slotserve.config import ModelConfig
from slotserve.models.interface import CausalLM, Model, VisionLanguageModel
from slotserve.models.loader import build_meta_model
from slotserve.models.registry import ARCHITECTURES
from tests.conftest import build_tiny_model
from tests.test_qwen3_moe import build_tiny_moe
from tests.test_qwen3_vl import build_tiny_vl


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, ModelConfig]:
    dirs = {"qwen2": tmp_path_factory.mktemp("i-qwen2"), "qwen3": tmp_path_factory.mktemp("i-qwen3"),
            "moe": tmp_path_factory.mktemp("i-moe"), "vl": tmp_path_factory.mktemp("i-vl"),
            "vl-moe": tmp_path_factory.mktemp("i-vl-moe")}
    build_tiny_model(dirs["qwen2"], "qwen2")
    build_tiny_model(dirs["qwen3"], "qwen3")
    build_tiny_moe(dirs["moe"])
    build_tiny_vl(dirs["vl"])
    build_tiny_vl(dirs["vl-moe"], moe=True)
    return {name: ModelConfig.from_dir(path) for name, path in dirs.items()}


KINDS = {"Qwen2ForCausalLM": ("qwen2", CausalLM), "Qwen3ForCausalLM": ("qwen3", CausalLM),
         "Qwen3MoeForCausalLM": ("moe", CausalLM), "Qwen2Model": ("qwen2", Model), "Qwen3Model": ("qwen3", Model),
         "Qwen3VLForConditionalGeneration": ("vl", VisionLanguageModel),
         "Qwen3VLMoeForConditionalGeneration": ("vl-moe", VisionLanguageModel)}


def test_every_registered_architecture_has_a_kind_here():
    assert KINDS.keys() == ARCHITECTURES.keys()


@pytest.mark.parametrize("architecture", sorted(KINDS))
def test_each_architecture_is_the_model_the_engine_expects(configs, architecture):
    name, kind = KINDS[architecture]
    cfg = configs[name]
    model = ARCHITECTURES[architecture]
    built = build_meta_model(replace(cfg, architecture=architecture))
    assert type(built) is model and isinstance(built, kind)
    if kind is Model:
        assert not isinstance(built, CausalLM)  # an embedding model has no head
