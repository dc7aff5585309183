"""`slotserve bench vision`: images per second through a Qwen3-VL vision tower, and the time to first token of a
chat prompt with one image, as the engine runs it and with its tower in float32, beside transformers, in one process.

No Qwen3-VL weights are reachable here, so by default it writes a random-weight model at a published model's
shapes (`--shape`, bench/random_checkpoint.py): its vision tower, and a text model of its width with fewer layers
(`--text-layers`), in bfloat16 as the published checkpoints are. `--model` takes a real Qwen3-VL directory (or a
random one at full size) instead. transformers (a test dependency) is the baseline.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from slotserve.bench.random_checkpoint import IMAGE_TOKENS, write_random_checkpoint
from slotserve.config import PrefillPrecision
from slotserve.multimodal.image_processor import process_image
from slotserve.sampling_params import SamplingParams


def run_vision(args: argparse.Namespace) -> dict[str, Any]:
    from slotserve.entrypoints.llm import LLM

    with tempfile.TemporaryDirectory(prefix="slotserve-bench-vision-") as tmp:
        path = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            write_random_checkpoint(path, args.shape, args.text_layers)
        llm = LLM(str(path), kv_cache_memory=256 << 20, enable_prefix_caching=False,
                  prefill_precision=PrefillPrecision(args.prefill_precision), quantization=args.quantization)
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


def _transformers_model(path: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
