"""`python -m slotserve.bench.random_checkpoint OUT_DIR --shape NAME`: a Qwen3-VL checkpoint directory at a
published model's exact shapes (Qwen3-VL-8B-Instruct's by default, or -2B's), text model and vision tower, its
weights random bfloat16 values in sharded safetensors as the published checkpoints are, its tokenizer the bundled
model's: a model to measure the vision tower, image-to-first-token and decode at their real size on
(`slotserve bench vision -m OUT_DIR --quantization q8_0`), where no real weights can be downloaded.

`--text-layers` cuts the text model (bench vision's own random models do, to fit beside transformers'). The tensor
names and shapes are those transformers' Qwen3-VL model gives (a test dependency: it is built on the meta device,
so it takes no memory); each shard is written and freed before the next is drawn."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from slotserve.model_store import DEFAULT_MODEL, resolve_model

WEIGHT_STD = 0.02  # about what a trained model's linears hold
SHARD_BYTES = 2 << 30

# The published configs (Qwen3-VL-2B-Instruct's and -8B-Instruct's config.json).
VISION_2B = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                 num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17], patch_size=16,
                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="gelu_pytorch_tanh")
TEXT_2B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
               rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                   "mrope_section": [24, 20, 20], "mrope_interleaved": True})
VISION_8B = {**VISION_2B, "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 4096,
             "deepstack_visual_indexes": [8, 16, 24]}
TEXT_8B = {**TEXT_2B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32}
IMAGE_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653)
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any], bool]] = {  # vision, text, tied embeddings
    "qwen3-vl-2b": (VISION_2B, TEXT_2B, True),
    "qwen3-vl-8b": (VISION_8B, TEXT_8B, False),
}


def hf_config(shape: str, text_layers: int | None = None) -> Any:
    """transformers' Qwen3VLConfig of `shape`, its text model cut to `text_layers` where given."""
    from transformers import Qwen3VLConfig

    vision, text, tied = SHAPES[shape]
    layers = {"num_hidden_layers": text_layers} if text_layers else {}
    return Qwen3VLConfig(text_config={**text, **layers}, vision_config=vision, tie_word_embeddings=tied,
                         **IMAGE_TOKENS)


def write_random_checkpoint(out: Path, shape: str, text_layers: int | None = None, seed: int = 0) -> int:
    """Writes the directory; the bytes of its weights."""
    from transformers import Qwen3VLForConditionalGeneration

    cfg = hf_config(shape, text_layers)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Qwen3VLForConditionalGeneration(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, size in shapes.items():
        if name.endswith("norm.weight") or (len(size) == 1 and "norm" in name):
            tensor = torch.ones(size, dtype=torch.bfloat16)
        elif name.endswith(".bias"):
            tensor = torch.zeros(size, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(size, generator=gen) * WEIGHT_STD).bfloat16()
        shard[name] = tensor
        total += tensor.nbytes
        if sum(t.nbytes for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(out)
    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slotserve.bench.random_checkpoint",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the directory to write")
    parser.add_argument("--shape", default="qwen3-vl-8b", choices=sorted(SHAPES))
    parser.add_argument("--text-layers", type=int, default=None, help="cut the text model to this many layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    size = write_random_checkpoint(args.out, args.shape, args.text_layers, args.seed)
    print(json.dumps({"checkpoint": str(args.out), "shape": args.shape, "bytes": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
