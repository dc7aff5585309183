"""Qwen3-VL (dense and MoE) against transformers on tiny random configs in float32: M-RoPE positions, the
prefill logits of prompts with images, greedy decoding through the engine (chunked prefill that cuts an
image, preemption, batched with text-only requests), and prefix caching that tells images apart."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from slotserve.config import EngineConfig, ModelConfig
from slotserve.engine.llm_engine import LLMEngine
from slotserve.multimodal.image_processor import ProcessedImage
from slotserve.multimodal.inputs import ImageInput, rope_positions
from slotserve.sampling_params import SamplingParams
from tests.conftest import QWEN_TOKENIZER_DIR
from tests.helpers import run_to_completion

IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653
TEXT = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
           norm_topk_prob=True)
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


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_prefill_logits_with_images_equal_transformers(request, model):
    path, hf = request.getfixturevalue(model)
    engine = make_engine(path)
    images = [random_image((1, 4, 6), 1), random_image((1, 6, 2), 2)]
    prompt = prompt_with(images, [TEXT_A, TEXT_B, TEXT_C])
    inputs = hf_inputs(engine, prompt, images)
    expected = hf_logits(hf, inputs)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), images)
    ours = engine.core.requests["r#0"]
    from slotserve.engine.model_runner import ScheduledSeq, Want

    engine.core._encode_images([(ours, len(ours.prompt_token_ids))])
    n = len(ours.prompt_token_ids)
    engine.kv.allocate(ours, n)
    seq = ScheduledSeq(ours.prompt_token_ids, 0, ours.block_table, Want.ALL, ours.images.vision(0, n))
    (result,) = engine.core.execute([seq])
    torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=1e-4)
    # Not vacuous: the images move the logits.
    blank = hf_logits(hf, {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])})
    assert (blank - expected).abs().max() > 1e-2


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


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("setting", ["batched", "chunked", "preempted"])
def test_greedy_decoding_equals_transformers_generate(request, model, setting):
    """32 greedy tokens of requests with images and without, all at once: as one batch; with the prefill in
    chunks of 5 tokens (which cut every image); and with a cache so small that requests are preempted and
    recomputed (their images' encoder outputs reused)."""
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
    ours = run(engine, requests)
    if setting == "preempted":
        assert engine.scheduler.num_preemptions > 0
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
