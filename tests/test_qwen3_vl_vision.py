"""Qwen3-VL's vision tower: parity with transformers' `Qwen3VLVisionModel` on tiny random configs (merged
tokens and every DeepStack feature), the checkpoint's parameter names, and `VisionConfig`'s refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as HFVisionModel

from slotserve.config import PrefillPrecision
from slotserve.models.qwen3_vl_vision import Qwen3VLVisionModel, VisionConfig
from slotserve.quantization.packed_linear import panel_dtype

# The real patch size with a 4 x 4 position grid; and a smaller patch (tiny rows) with an 8 x 8 grid, a
# head dim that is not a power of two, one DeepStack block and exact GELU in the MLP.
TINY = {
    "patch16": dict(depth=3, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=48,
                    num_position_embeddings=16, deepstack_visual_indexes=[0, 2], patch_size=16),
    "patch4": dict(depth=3, hidden_size=48, num_heads=4, intermediate_size=96, out_hidden_size=40,
                   num_position_embeddings=64, deepstack_visual_indexes=[1], patch_size=4, hidden_act="gelu"),
}
GRIDS = {
    "one_image": [(1, 4, 6)],
    "three_images": [(1, 4, 4), (1, 6, 2), (1, 8, 10)],
    "upsampled": [(1, 12, 10)],  # larger than either position grid
    "downsampled": [(1, 2, 2)],  # smaller than either
    "video": [(2, 4, 6)],  # two frames, each its own attention sequence
    "videos_and_image": [(3, 2, 4), (1, 6, 6), (2, 2, 2)],
}
ATOL = 1e-4


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every part of the tower moves the output (norm scales near 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1 + noise if "norm" in name and name.endswith("weight") else noise)


@pytest.fixture(scope="module", params=sorted(TINY))
def towers(request) -> tuple[HFVisionModel, Qwen3VLVisionModel]:
    hf_cfg = Qwen3VLVisionConfig(**TINY[request.param])
    hf = HFVisionModel(hf_cfg).eval()
    randomize(hf, seed=0)
    ours = Qwen3VLVisionModel(VisionConfig.from_dict(hf_cfg.to_dict())).eval()
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def inputs(cfg: VisionConfig, grids: list[tuple[int, int, int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grids)
    row = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thw.prod(-1).sum()), row, generator=gen), grid_thw


@pytest.mark.parametrize("grids", list(GRIDS.values()), ids=list(GRIDS))
def test_matches_transformers(towers, grids):
    hf, ours = towers
    cfg = ours.cfg
    pixel_values, grid_thw = inputs(cfg, grids)
    with torch.no_grad():
        ref = hf(pixel_values, grid_thw)  # BaseModelOutputWithDeepstackFeatures
        out = ours(pixel_values, grid_thw)
    tokens = sum(t * h * w for t, h, w in grids) // cfg.spatial_merge_size**2
    assert out.embeds.shape == (tokens, cfg.out_hidden_size)
    assert ref.pooler_output.abs().max() > 0.5  # not a near-zero output that anything would match
    torch.testing.assert_close(out.embeds, ref.pooler_output, atol=ATOL, rtol=0)
    assert len(out.deepstack) == len(ref.deepstack_features) == len(cfg.deepstack_visual_indexes)
    for mine, theirs in zip(out.deepstack, ref.deepstack_features, strict=True):
        assert mine.shape == (tokens, cfg.out_hidden_size)
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)


def test_bfloat16_close_to_float32(towers):
    hf, ours = towers
    pixel_values, grid_thw = inputs(ours.cfg, GRIDS["three_images"])
    with torch.no_grad():
        ref = hf(pixel_values, grid_thw)
        out = copy.deepcopy(ours).to(torch.bfloat16)(pixel_values, grid_thw)
    for mine, theirs in zip([out.embeds, *out.deepstack], [ref.pooler_output, *ref.deepstack_features], strict=True):
        assert mine.dtype == torch.bfloat16
        assert (mine.float() - theirs).abs().max() < 0.03 * theirs.abs().max()


@pytest.mark.parametrize(("precision", "bfloat16_weights", "expected"), [
    (PrefillPrecision.FLOAT32, True, torch.float32),
    (PrefillPrecision.BFLOAT16, False, torch.bfloat16),  # asked for: the float32 weights round
    (PrefillPrecision.AUTO, False, torch.float32),  # rounding weights is never chosen for the user
    (PrefillPrecision.AUTO, True, None),  # a bfloat16 checkpoint: bfloat16 where the CPU has its dot products
])
def test_the_tower_runs_in_bfloat16_where_that_rounds_only_activations(towers, precision, bfloat16_weights, expected):
    hf, ours = towers
    tower = copy.deepcopy(ours)
    if bfloat16_weights:
        with torch.no_grad():
            for p in tower.parameters():
                p.copy_(p.bfloat16())
    expected = expected or panel_dtype(PrefillPrecision.AUTO)
    assert tower.choose_dtype(precision) == expected
    assert {p.dtype for p in tower.parameters()} == {expected}
    pixel_values, grid_thw = inputs(ours.cfg, GRIDS["three_images"])
    with torch.no_grad():
        ref = hf(pixel_values, grid_thw)
        out = tower(pixel_values.to(expected), grid_thw)
    for mine, theirs in zip([out.embeds, *out.deepstack], [ref.pooler_output, *ref.deepstack_features], strict=True):
        assert mine.dtype == expected
        assert (mine.float() - theirs).abs().max() < 0.03 * theirs.abs().max()


def test_state_dict_names_are_the_checkpoints():
    """transformers' full model keeps the tower under `model.visual.`; stripped, its keys are exactly ours."""
    hf_cfg = Qwen3VLConfig(
        vision_config=TINY["patch16"],
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3]}))
    full = Qwen3VLForConditionalGeneration(hf_cfg).state_dict()
    prefix = "model.visual."
    visual = {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}
    ours = Qwen3VLVisionModel(VisionConfig.from_dict(hf_cfg.vision_config.to_dict()))
    result = ours.load_state_dict(visual, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert set(ours.state_dict()) == set(visual)


def test_from_dict_reads_a_checkpoints_vision_config():
    # As transformers 4.57 wrote it: old model_type, no rope_parameters, keys that are not ours.
    d = {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
         "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
         "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048,
         "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}
    cfg = VisionConfig.from_dict(d)
    assert cfg.deepstack_visual_indexes == (5, 11, 17) and cfg.head_dim == 64 and cfg.rope_theta == 10000.0
    rope = {"rope_type": "axial", "rope_theta": 500.0}  # as transformers 5 writes it
    assert VisionConfig.from_dict({**d, "rope_parameters": rope}).rope_theta == 500.0


@pytest.mark.parametrize(("change", "field"), [
    (dict(hidden_size=36, num_heads=6), "num_heads"),  # head dim 6: not divisible by 4
    (dict(hidden_size=30), "num_heads"),  # 4 heads do not divide 30
    (dict(num_position_embeddings=15), "num_position_embeddings"),
    (dict(deepstack_visual_indexes=[0, 3]), "deepstack_visual_indexes"),  # depth is 3
    (dict(deepstack_visual_indexes=[1, 1]), "deepstack_visual_indexes"),
    (dict(hidden_act="relu"), "hidden_act"),
    (dict(patch_size=0), "patch_size"),
    (dict(depth=None), "depth"),  # missing
    (dict(rope_parameters={"rope_type": "default"}), "rope_parameters"),
])
def test_from_dict_rejects_an_impossible_config(change, field):
    d = {**TINY["patch16"], **change}
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        VisionConfig.from_dict(d)


def test_forward_rejects_inconsistent_inputs():
    model = Qwen3VLVisionModel(VisionConfig.from_dict(TINY["patch16"]))
    pixel_values, grid_thw = inputs(model.cfg, [(1, 4, 6)])
    with pytest.raises(ValueError, match="pixel_values"):
        model(pixel_values[:-1], grid_thw)
    with pytest.raises(ValueError, match="grid_thw"):
        model(pixel_values, torch.tensor([[1, 3, 8]]))


def test_real_widths_smoke():
    """Not against transformers: Qwen3-VL's widths (two blocks), a 224 x 224 image and a two-frame video
    together. Each image is independent of the others in the batch, and bfloat16 stays near float32."""
    cfg = VisionConfig(depth=2, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                       num_position_embeddings=2304, deepstack_visual_indexes=(0,))
    torch.manual_seed(0)
    model = Qwen3VLVisionModel(cfg).eval()
    grids = [(1, 14, 14), (2, 8, 12)]
    pixel_values, grid_thw = inputs(cfg, grids)
    with torch.no_grad():
        out = model(pixel_values, grid_thw)
        first = model(pixel_values[: 14 * 14], grid_thw[:1])
        low = copy.deepcopy(model).to(torch.bfloat16)(pixel_values, grid_thw)
    tokens = [t * h * w // 4 for t, h, w in grids]
    assert out.embeds.shape == (sum(tokens), 2048) and [f.shape for f in out.deepstack] == [out.embeds.shape]
    assert all(torch.isfinite(f).all() for f in [out.embeds, *out.deepstack])
    for together, alone in zip([out.embeds, *out.deepstack], [first.embeds, *first.deepstack], strict=True):
        torch.testing.assert_close(together[: tokens[0]], alone, atol=ATOL, rtol=0)
    for full, half in zip([out.embeds, *out.deepstack], [low.embeds, *low.deepstack], strict=True):
        assert (half.float() - full).abs().max() < 0.03 * full.abs().max()
