"""`slotserve bench vision`: images per second through a Qwen3-VL vision tower, and the time to first token of a
chat prompt with one image, as the engine runs it and with its tower in float32, beside transformers, in one process.

No Qwen3-VL weights are reachable here, so by default it builds a random-weight model at a published model's
shapes (`--shape`): its vision tower, and a text model of its width with fewer layers (`--text-layers`), saved in
bfloat16 as the published checkpoints are. `--model` takes a real Qwen3-VL directory instead. transformers (a test
dependency) builds the model and is the baseline.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from slotserve.config import PrefillPrecision
from slotserve.model_store import DEFAULT_MODEL, resolve_model
from slotserve.multimodal.image_processor import process_image
from slotserve.sampling_params import SamplingParams

# The published configs' shapes (Qwen3-VL-2B-Instruct's and -8B-Instruct's config.json), the text model cut to
# `--text-layers`.
VISION_2B = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                 num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17], patch_size=16,
                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="gelu_pytorch_tanh")
TEXT_2B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
               num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                "mrope_interleaved": True})
VISION_8B = {**VISION_2B, "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 4096,
             "deepstack_visual_indexes": [8, 16, 24]}
TEXT_8B = {**TEXT_2B, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32}
SHAPES = {"qwen3-vl-2b": (VISION_2B, TEXT_2B), "qwen3-vl-8b": (VISION_8B, TEXT_8B)}
IMAGE_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653)


def run_vision(args: argparse.Namespace) -> dict[str, Any]:
    from slotserve.entrypoints.llm import LLM

    if args.no_transformers and not args.model:
        raise ValueError("--no-transformers: needs --model (transformers builds the random model)")
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-vision-") as tmp:
        path = Path(args.model) if args.model else _random_model(Path(tmp), args.shape, args.text_layers)
        llm = LLM(str(path), kv_cache_memory=256 << 20, enable_prefix_caching=False,
                  prefill_precision=PrefillPrecision(args.prefill_precision))
        images = [_image(i, args.image_size) for i in range(args.images)]
        processed = [process_image(Image.open(io.BytesIO(data)), llm.engine.input_processor.image_prompting.processor)
                     for data in images]
        messages = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                                 {"type": "text", "text": "Describe this image."}]}]
        tower = llm.engine.core.model.model.visual
        result: dict[str, Any] = {
            "bench": "vision", "model": args.model or f"random, {args.shape} shapes, {args.text_layers} text layers",
            "image_size": args.image_size, "tokens_per_image": processed[0].num_tokens, "images_per_call": len(images),
            "slotserve": {"vision_dtype": str(next(tower.parameters()).dtype).removeprefix("torch."),
                          **_figures(llm, processed, messages, args.repeats)},
        }
        if next(tower.parameters()).dtype != torch.float32:
            tower.float()  # the tower as it ran before it took the bfloat16 units
            result["slotserve_float32_tower"] = _figures(llm, processed, messages, args.repeats)
            result["tower_speedup_over_float32"] = round(result["slotserve"]["images_per_s"]
                                                         / result["slotserve_float32_tower"]["images_per_s"], 3)
        prompt = llm.render_chat(messages)["prompt"]
        ids, _ = llm.engine.input_processor.image_prompting.place(llm.get_tokenizer().encode(prompt), [processed[0]])
        llm.shutdown()
        del llm, tower  # transformers' model loads after slotserve's is gone: both would not fit beside each other
        if not args.no_transformers:
            result["transformers"] = _transformers_figures(_transformers_model(path), ids, processed, args.repeats)
            result["images_per_s_ratio"] = round(result["slotserve"]["images_per_s"]
                                                 / result["transformers"]["images_per_s"], 3)
            result["ttft_ratio"] = round(result["transformers"]["ttft_one_image_s"]
                                         / result["slotserve"]["ttft_one_image_s"], 3)
    return result


def _figures(llm: Any, processed: list, messages: list, repeats: int) -> dict[str, float]:
    """Images per second through the tower (all of `processed` in one call) and one image's time to first token."""
    pixels, grids = [p.pixel_values for p in processed], [p.grid_thw for p in processed]
    model = llm.engine.core.model
    encode_s = _median(lambda: model.encode_images(pixels, grids), repeats)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttft_s = _median(lambda: llm.chat(messages, one, use_tqdm=False), repeats)
    return {"images_per_s": round(len(processed) / encode_s, 3), "ttft_one_image_s": round(ttft_s, 3)}


def _transformers_figures(hf: Any, prompt_ids: list[int], processed: list, repeats: int) -> dict[str, float]:
    """As `_figures`, for transformers' model: the prompt's ids (the first image's placeholders widened) given."""
    pixels = torch.cat([p.pixel_values for p in processed])
    grid = torch.tensor([p.grid_thw for p in processed])

    def encode() -> None:
        with torch.no_grad():
            hf.model.get_image_features(pixels, grid)

    ids = torch.tensor([prompt_ids])

    def first_token() -> None:
        with torch.no_grad():
            hf.generate(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKENS["image_token_id"]).int(),
                        pixel_values=processed[0].pixel_values, image_grid_thw=grid[:1], max_new_tokens=1,
                        do_sample=False)

    # Its figure leaves out the image's preprocessing, which slotserve's includes.
    return {"images_per_s": round(len(processed) / _median(encode, repeats), 3),
            "ttft_one_image_s": round(_median(first_token, repeats), 3)}


def _median(run: Any, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _image(seed: int, size: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _random_model(path: Path, shape: str, text_layers: int) -> Path:
    """A random-weight Qwen3-VL of `shape`'s widths in bfloat16, with the bundled model's tokenizer (the same
    vocabulary)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision, text = SHAPES[shape]
    torch.manual_seed(0)
    cfg = Qwen3VLConfig(text_config={**text, "num_hidden_layers": text_layers}, vision_config=vision,
                        tie_word_embeddings=True, **IMAGE_TOKENS)
    Qwen3VLForConditionalGeneration(cfg).eval().to(torch.bfloat16).save_pretrained(path)
    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def _transformers_model(path: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
