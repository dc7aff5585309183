"""Builds a model from a Hugging Face-layout directory: config.json plus one or many safetensors shards."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from slotserve.config import ModelConfig
from slotserve.models.registry import model_class

logger = logging.getLogger("slotserve")

# Tensors some checkpoints carry that the engine recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightsError(ValueError):
    """A weights file is missing, unreadable, or does not match the model's config."""


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index}: malformed shard index ({e})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise WeightsError(f"{index}: shard files listed but missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors weight files found")
    return files


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, max_position: int | None = None
) -> tuple[nn.Module, ModelConfig]:
    """Config, architecture, weights: the model ready for inference on `device` in `dtype`."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    cls = model_class(cfg.architecture)
    # Built on the meta device: no memory and no time go into weights the checkpoint replaces.
    with torch.device("meta"):
        model = cls(cfg, max_position)
    load_weights(model, weight_files(path), dtype, device)
    return model.eval(), cfg


def load_weights(model: nn.Module, files: list[Path], dtype: torch.dtype, device: torch.device) -> None:
    """Replaces every meta parameter with its checkpoint tensor, checking names and shapes.

    Tensors already in the wanted dtype on CPU stay views of the memory-mapped file (no copy, pages
    shared with the OS cache), which is what makes a second load of a model take seconds."""
    expected = {name: p.shape for name, p in model.named_parameters()}  # a tied lm_head appears once
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in tqdm(f.keys(), desc=f"Loading {file.name}", unit="tensor", leave=False):
                    if key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and key not in expected):
                        continue
                    if key not in expected:
                        raise WeightsError(f"{file}: tensor {key!r} has no place in {type(model).__name__}")
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(expected[key]):
                        raise WeightsError(f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                                           f"the config implies {tuple(expected[key])}")
                    module_name, _, param_name = key.rpartition(".")
                    param = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
                    setattr(model.get_submodule(module_name), param_name, param)
        except SafetensorError as e:
            raise WeightsError(f"{file}: cannot read safetensors ({e})") from None
    model.tie_weights()
    missing = sorted(name for name, p in model.named_parameters() if p.is_meta)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise WeightsError(f"{files[0].parent}: checkpoint lacks {len(missing)} tensors: {shown}")
