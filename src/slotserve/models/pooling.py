"""How an embedding model turns hidden states into one vector, and which task a model runs.

Sentence-transformers checkpoints (Qwen3-Embedding among them) say so in modules.json: a Pooling
module with its mode, and a Normalize module when vectors are L2-normalised. A generative model run
with `--task embed` pools its final hidden state's last token and normalises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slotserve.config import ConfigError

# Checkpoints of the bare decoder (no output head): embedding models.
EMBEDDING_ARCHITECTURES = ("Qwen2Model", "Qwen3Model")
TASKS = ("auto", "generate", "embed")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "last"  # only last-token pooling: what Qwen embedding models use
    normalize: bool = True


def load_pooling_config(path: Path) -> PoolingConfig | None:
    """The sentence-transformers pooling of the checkpoint at `path`, or None if it declares none."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        settings = json.loads((path / pooling["path"] / "config.json").read_text()) if pooling else {}
    except (json.JSONDecodeError, OSError, KeyError, TypeError) as e:
        raise ConfigError(f"{modules_file}: cannot read the sentence-transformers pooling ({e})") from None
    if pooling is None:
        return None
    modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens") for k, v in settings.items()
             if k.startswith("pooling_mode_") and v]
    if modes != ["lasttoken"]:
        raise ConfigError(f"{modules_file}: pooling {modes or 'unspecified'} is not supported (only last-token)")
    return PoolingConfig(mode="last", normalize=normalize)


def resolve_task(task: str, architecture: str, pooling: PoolingConfig | None) -> str:
    if task not in TASKS:
        raise ValueError(f"task: must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "auto":
        return "embed" if architecture in EMBEDDING_ARCHITECTURES or pooling is not None else "generate"
    if task == "generate" and architecture in EMBEDDING_ARCHITECTURES:
        raise ValueError(f"task: {architecture} has no output head, so it cannot generate; use --task embed")
    return task
