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
    # Built on the meta device so no time goes into random initialisation of weights we overwrite.
    with torch.device("meta"):
        model = cls(cfg, max_position).to(dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty unties shared parameters
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, weight_files(path))
    return model.eval(), cfg


def load_weights(model: nn.Module, files: list[Path]) -> None:
    """Copies every checkpoint tensor into its parameter (or its rows of a fused one), checking shapes
    and that nothing is left unfilled."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    unfilled = {name: set(range(len(_shard_sizes(model, name)))) for name in params}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in tqdm(f.keys(), desc=f"Loading {file.name}", unit="tensor", leave=False):
                    if key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and key not in params):
                        continue
                    target, shard = _target(model, key)
                    if target not in params:
                        raise WeightsError(f"{file}: tensor {key!r} has no place in {type(model).__name__}")
                    sizes = _shard_sizes(model, target)
                    dest = params[target].data.narrow(0, sum(sizes[:shard]), sizes[shard])
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(dest.shape):
                        raise WeightsError(f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                                           f"the config implies {tuple(dest.shape)}")
                    dest.copy_(tensor)
                    unfilled[target].discard(shard)
        except SafetensorError as e:
            raise WeightsError(f"{file}: cannot read safetensors ({e})") from None
    missing = sorted(name for name, shards in unfilled.items() if shards)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise WeightsError(f"{files[0].parent}: checkpoint lacks {len(missing)} tensors: {shown}")


def _target(model: nn.Module, key: str) -> tuple[str, int]:
    """Checkpoint name -> (parameter name, shard index) through the model's fused projections."""
    for part, (fused, shard) in getattr(model, "packed_modules", {}).items():
        if f".{part}." in key:
            return key.replace(f".{part}.", f".{fused}."), shard
    return key, 0


def _shard_sizes(model: nn.Module, param_name: str) -> list[int]:
    """Leading-dimension sizes of the checkpoint tensors stacked into this parameter."""
    for fused in {f for f, _ in getattr(model, "packed_modules", {}).values()}:
        if f".{fused}." in param_name:
            return model.shard_sizes(fused)
    return [model.get_parameter(param_name).shape[0]]
