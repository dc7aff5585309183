"""Qwen3-VL (dense and MoE) against transformers on tiny random configs in float32: M-RoPE positions, the
prefill logits of prompts with images, greedy decoding through the engine (chunked prefill that cuts an
image, preemption, batched with text-only requests), and prefix caching that tells images apart."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from slotserve.config import EngineConfig, ModelConfig, PrefillPrecision
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.model_runner import ScheduledSeq, Want
from slotserve.multimodal.image_input import ImageInput
from slotserve.multimodal.image_processor import ProcessedImage
from slotserve.multimodal.inputs import rope_positions
from slotserve.sampling_params import SamplingParams
from tests.conftest import QWEN_TOKENIZER_DIR
from tests.helpers import run_to_completion

IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653
TEXT = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
              num_position_embeddings=16, deepstack_visual_indexes=[0, 2], patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, in_channels=3)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def build_tiny_vl(path: Path, moe: bool = False, seed: int = 0):
    """Saves a tiny random Qwen3-VL (or Qwen3-VL-MoE) checkpoint with the real Qwen tokenizer; returns the HF
    model. Weights drawn wider than transformers' default, so images move the logits."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    torch.manual_seed(seed)
    config_class, model_class = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                                 else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    cfg = config_class(text_config={**TEXT, **(MOE if moe else {})}, vision_config=VISION, image_token_id=IMAGE,
                       video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                       tie_word_embeddings=False)
    model = model_class(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif "norm" not in name:
                p.normal_(0, 0.02)
    model.generation_config.eos_token_id = [151645, 151643]
    model.save_pretrained(path)
    for f in QWEN_TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    return model


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-vl")
    return path, build_tiny_vl(path)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-vl-moe")
    return path, build_tiny_vl(path, moe=True)


def random_image(grid: tuple[int, int, int], seed: int) -> ProcessedImage:
    """An image already cut into patches: random pixel values for a (t, h, w) grid of patches."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    pixels = torch.rand(t * h * w, 3 * 2 * 16 * 16, generator=g) * 2 - 1
    return ProcessedImage(pixels, grid, 2, hashlib.sha256(pixels.numpy().tobytes()).hexdigest())


def prompt_with(images: list[ProcessedImage], text: list[list[int]]) -> list[int]:
    """text[0] <image 0> text[1] <image 1> ... text[-1], each image its start, placeholder and end tokens."""
    out = list(text[0])
    for _image, after in zip(images, text[1:], strict=True):
        out += [START, IMAGE, END, *after]
    return out


def hf_inputs(engine: LLMEngine, prompt: list[int], images: list[ProcessedImage]) -> dict:
    """The same request as transformers takes it: the widened prompt, its token types, the pixels."""
    ids, _ = engine.input_processor.image_prompting.place(prompt, images)
    ids = torch.tensor([ids])
    out = {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE).int()}
    if images:
        out["pixel_values"] = torch.cat([im.pixel_values for im in images])
        out["image_grid_thw"] = torch.tensor([im.grid_thw for im in images])
    return out


def make_engine(path: Path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **{"kv_cache_memory": 64 << 20, "block_size": 16, **kwargs}))


TEXT_A, TEXT_B, TEXT_C = [1000 + i for i in range(7)], [2000 + i for i in range(5)], [3000 + i for i in range(9)]
LAYOUTS = {  # name: (grids, the text around them)
    "text only": ([], [TEXT_A]),
    "one image": ([(1, 4, 6)], [TEXT_A, TEXT_B]),
    "two images": ([(1, 6, 4), (1, 2, 8)], [TEXT_A, TEXT_B, TEXT_C]),
    "image first": ([(1, 4, 4)], [[], TEXT_B]),
    "image last": ([(1, 8, 2)], [TEXT_A, []]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rope_positions_equal_get_rope_index(dense, layout):
    path, hf = dense
    grids, text = LAYOUTS[layout]
    images = [random_image(g, i) for i, g in enumerate(grids)]
    engine = make_engine(path)
    inputs = hf_inputs(engine, prompt_with(images, text), images)
    expected, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                              inputs.get("image_grid_thw"))
    _, placed = engine.input_processor.image_prompting.place(prompt_with(images, text), images)
    positions, offset = rope_positions(inputs["input_ids"].shape[1], placed, 2)
    assert torch.equal(positions, expected[:, 0])
    assert offset == int(delta)


def hf_logits(hf, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return hf(**inputs).logits[0]


def prefill_logits(engine: LLMEngine, prompt: list[int], images: list[ProcessedImage]) -> torch.Tensor:
    """Every prompt position's logits, the prompt prefilled in one step straight through the core."""
    engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), images)
    ours = engine.core.requests["probe#0"]
    n = len(ours.prompt_token_ids)
    engine.core._encode_images([(ours, n)])
    engine.kv.allocate(ours, n)
    seq = ScheduledSeq(ours.prompt_token_ids, 0, ours.block_table, Want.ALL, ours.images.vision(0, n))
    (result,) = engine.core.execute([seq])
    engine.abort_request("probe")
    return result.logits


IMAGES = [random_image((1, 4, 6), 1), random_image((1, 6, 2), 2)]
PROMPT = prompt_with(IMAGES, [TEXT_A, TEXT_B, TEXT_C])


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_prefill_logits_with_images_equal_transformers(request, model):
    path, hf = request.getfixturevalue(model)
    engine = make_engine(path)
    inputs = hf_inputs(engine, PROMPT, IMAGES)
    expected = hf_logits(hf, inputs)
    torch.testing.assert_close(prefill_logits(engine, PROMPT, IMAGES), expected, atol=1e-4, rtol=1e-4)
    # Not vacuous: the images move the logits.
    blank = hf_logits(hf, {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])})
    assert (blank - expected).abs().max() > 1e-2


def test_a_bfloat16_tower_is_close_to_transformers_in_float32(dense):
    """--prefill-precision bfloat16 runs the tower in bfloat16 (the load line says so); the text model stays float32,
    and the prefill's logits stay near transformers' float32 ones."""
    path, hf = dense
    engine = make_engine(path, prefill_precision=PrefillPrecision.BFLOAT16)
    assert engine.core.worker.vision_dtype == torch.bfloat16
    assert "vision tower: bfloat16" in engine.core._setup(engine.core.runner.num_blocks)
    assert {p.dtype for p in engine.core.model.model.visual.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in engine.core.model.model.language_model.parameters()} == {torch.float32}
    expected = hf_logits(hf, hf_inputs(engine, PROMPT, IMAGES))
    ours = prefill_logits(engine, PROMPT, IMAGES)
    assert (ours - expected).abs().max() < 0.05 * expected.abs().max()


def test_moe_experts_load_in_the_published_layout_too(moe, tmp_path):
    """Published checkpoints store each layer's experts as gate_up_proj (E, H, 2I) and down_proj (E, I, H);
    transformers 5 saves them as (E, 2I, H) and (E, H, I). Both load into the same model."""
    from safetensors.torch import load_file, save_file

    path, _ = moe
    published = tmp_path / "published"
    shutil.copytree(path, published)
    tensors = load_file(path / "model.safetensors")
    stacked = [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert stacked
    for key in stacked:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, published / "model.safetensors", metadata={"format": "pt"})
    expected = prefill_logits(make_engine(path), PROMPT, IMAGES)
    assert torch.equal(prefill_logits(make_engine(published), PROMPT, IMAGES), expected)


# Qwen3-VL-2B-Instruct's config.json, as transformers 4.57 wrote it (rope_scaling and rope_theta, not
# rope_parameters).
QWEN3_VL_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "tie_word_embeddings": True,
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "text_config": {
        "model_type": "qwen3_vl_text", "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
        "max_position_embeddings": 262144, "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 5000000, "tie_word_embeddings": True,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "vocab_size": 151936},
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
        "in_channels": 3, "intermediate_size": 4096, "model_type": "qwen3_vl", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2},
}


def test_the_published_2b_config_builds_its_model():
    from slotserve.models.loader import build_meta_model

    cfg = ModelConfig.from_dict(QWEN3_VL_2B)
    assert cfg.mrope_section == (24, 20, 20) and cfg.rope.theta == 5e6 and cfg.tie_word_embeddings
    assert cfg.qk_norm and cfg.num_hidden_layers == 28 and cfg.eos_token_ids == (151645,)
    model = build_meta_model(cfg)
    assert len(model.model.visual.blocks) == 24 and len(model.model.visual.deepstack_merger_list) == 3
    assert 2.0e9 < sum(p.numel() for p in model.parameters()) < 2.3e9  # "2B": 2.1 billion parameters


def test_a_config_that_does_not_hold_together_is_refused():
    from slotserve.config import ConfigError

    bad = {**QWEN3_VL_2B, "text_config": {**QWEN3_VL_2B["text_config"], "rope_scaling": {"mrope_section": [24, 20]}}}
    with pytest.raises(ConfigError, match="mrope_section"):
        ModelConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="image_token_id"):
        ModelConfig.from_dict({k: v for k, v in QWEN3_VL_2B.items() if k != "image_token_id"})


def hf_greedy(hf, inputs: dict, steps: int = 32) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def run(engine: LLMEngine, requests: list[tuple[list[int], list[ProcessedImage]]]) -> list[list[int]]:
    done = run_to_completion(engine, [prompt for prompt, _ in requests], GREEDY, [images for _, images in requests])
    return [done[f"r{i}"] for i in range(len(requests))]


REQUESTS = [
    ([(1, 4, 6), (1, 6, 2)], [TEXT_A, TEXT_B, TEXT_C]),
    ([], [TEXT_C + TEXT_A]),
    ([(1, 8, 4)], [[], TEXT_B]),
]


# The fast tier runs one model per setting; the slow tier the other three.
@pytest.mark.parametrize("model,setting", [
    ("dense", "batched"), ("moe", "chunked"), ("dense", "preempted"),
    *(pytest.param(m, s, marks=pytest.mark.slow) for m, s in (("moe", "batched"), ("dense", "chunked"),
                                                             ("moe", "preempted"))),
])
def test_greedy_decoding_equals_transformers_generate(request, model, setting):
    """32 greedy tokens of requests with images and without, all at once: as one batch; with the prefill in
    chunks of 5 tokens (which cut every image); and with a cache so small that requests are preempted and
    recomputed. Each image goes through the vision tower once, however its prompt is cut or recomputed."""
    path, hf = request.getfixturevalue(model)
    kwargs = {"chunked": {"max_num_batched_tokens": 5}, "preempted": {"kv_cache_memory": None}}.get(setting, {})
    if setting == "preempted":
        cfg = ModelConfig.from_dir(path)
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
        kwargs = {"kv_cache_memory": 9 * 16 * per_token}  # 9 blocks: fewer than the three requests need
    engine = make_engine(path, enable_prefix_caching=False, **kwargs)
    requests = [([random_image(g, 10 * r + i) for i, g in enumerate(grids)], text)
                for r, (grids, text) in enumerate(REQUESTS)]
    requests = [(prompt_with(images, text), images) for images, text in requests]
    encoded: list[tuple[int, int, int]] = []
    encode = engine.core.model.encode_images
    engine.core.model.encode_images = lambda pixels, grids: encoded.extend(grids) or encode(pixels, grids)
    ours = run(engine, requests)
    if setting == "preempted":
        assert engine.scheduler.num_preemptions > 0
    assert sorted(encoded) == sorted(g for grids, _ in REQUESTS for g in grids)  # each image encoded once
    for (prompt, images), tokens in zip(requests, ours, strict=True):
        assert tokens == hf_greedy(hf, hf_inputs(engine, prompt, images))


def test_prefix_cache_shares_blocks_of_the_same_image_only(dense):
    """The same prompt with another image behind the same placeholder tokens takes no image block from the
    cache; with the same image again, every full block up to the last token."""
    path, _ = dense
    engine = make_engine(path)
    image_a, image_b = random_image((1, 8, 8), 1), random_image((1, 8, 8), 2)
    prompt = prompt_with([image_a], [TEXT_A, TEXT_B])
    params = SamplingParams(temperature=0, max_tokens=1)

    def cached_tokens(image) -> int:
        engine.add_request("r", prompt, params, [image])
        cached = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                cached = out.num_cached_tokens
        return cached

    assert cached_tokens(image_a) == 0
    assert cached_tokens(image_b) == 0  # only the 7 text tokens before the image match: less than a block
    assert cached_tokens(image_a) == (len(TEXT_A) + 2 + 16 + len(TEXT_B)) // 16 * 16


def test_images_are_refused_where_they_do_not_fit(dense, tiny_qwen3):
    path, _ = dense
    engine = make_engine(path, limit_mm_per_prompt=1)
    image = random_image((1, 4, 4), 0)
    with pytest.raises(ValueError, match="images: at most 1 per prompt"):
        engine.add_request("r", TEXT_A, GREEDY, [image, image])
    with pytest.raises(ValueError, match="prompt: holds 2 image placeholders for 1 images"):
        engine.add_request("r", prompt_with([image, image], [TEXT_A, [], []]), GREEDY, [image])
    assert not engine.has_unfinished_requests()
    text = LLMEngine(EngineConfig(model=str(tiny_qwen3), kv_cache_memory=16 << 20))
    with pytest.raises(ValueError, match="images: this is a text model"):
        text.add_request("r", TEXT_A, GREEDY, [image])


def test_image_input_round_trips_its_pixels():
    image = random_image((1, 2, 4), 3)
    wire = ImageInput.of(5, image.num_tokens, image.grid_thw, image.pixel_values, image.content_hash)
    assert torch.equal(wire.pixel_values(), image.pixel_values) and wire.end == 5 + 2
