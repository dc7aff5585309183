"""Builds a model from a Hugging Face-layout directory: config.json plus one or many safetensors shards."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from slotserve import host_memory
from slotserve.config import ModelConfig
from slotserve.distributed.group import UNSPLIT, ModelParallel
from slotserve.layers.embedding import VocabEmbedding
from slotserve.layers.linear import Linear, MergedLinear, Shard
from slotserve.models.gguf import PACKED_METADATA, PACKED_PARTS
from slotserve.models.qwen3_vl import TensorParts
from slotserve.models.registry import model_class
from slotserve.quantization.packed_linear import BLOCK, CHUNK_BITS, TILE, PackedTensor, PackedWeight
from slotserve.quantization.q8_0 import Q8_0_BYTES_PER_VALUE, quantize_q8_0

logger = logging.getLogger("slotserve")

# Tensors some checkpoints carry that the engine recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightsError(ValueError):
    """A weights file is missing, unreadable, or does not match the model's config."""


class InsufficientMemoryError(ValueError):
    """The model's weights cannot fit in the memory available to them on the target device."""


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
    path: str | Path, dtype: torch.dtype, device: torch.device, max_position: int | None = None,
    parallel: ModelParallel = UNSPLIT, q8_0: bool = False,
) -> tuple[nn.Module, ModelConfig]:
    """Config, architecture, weights: the model ready for inference on `device` in `dtype`; under tensor
    parallel, this rank's part of it, read from the checkpoint alone. `q8_0`: the float linear and embedding
    weights become Q8_0 packings as they are read (quantization/q8_0.py)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    model = build_meta_model(cfg, max_position, parallel)
    files = weight_files(path)
    quantized = q8_0_params(model) if q8_0 and device.type == "cpu" and dtype == torch.float32 else set()
    check_memory(weight_footprint(model, dtype, device, checkpoint_dtypes(files), packed_sizes(files), quantized),
                 device)
    load_weights(model, files, dtype, device, quantized)
    return model.eval(), cfg


def q8_0_params(model: nn.Module) -> set[str]:
    """The parameters `--quantization q8_0` turns into packings: the weights of the Linear and VocabEmbedding
    layers (not a FloatLinear's, which keeps float32), whose rows are whole blocks."""
    return {f"{name}.weight" for name, m in model.named_modules()
            if isinstance(m, Linear | VocabEmbedding) and not getattr(m, "keeps_float", False)
            and m.weight is not None and m.weight.dim() == 2 and m.weight.shape[1] % BLOCK == 0}


def build_meta_model(cfg: ModelConfig, max_position: int | None = None,
                     parallel: ModelParallel = UNSPLIT) -> nn.Module:
    """The model on the meta device: shapes without storage, so no memory and no time go into
    weights the checkpoint replaces (and a model too big for this machine can still be sized)."""
    with torch.device("meta"):
        return model_class(cfg.architecture)(cfg, max_position, parallel)


@dataclass(frozen=True)
class TensorPlace:
    """Where one checkpoint tensor of `shape` goes: a parameter of the model, or some rows of one (a part
    of a `MergedLinear`, a rank's vocabulary rows short of their padding); under tensor parallel only its
    `shard` is read."""

    param: str
    shape: tuple[int, ...]
    rows: slice | None = None
    shard: Shard | None = None


def _full_shape(shape: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    """The checkpoint tensor's shape, of which a parameter of `shape` holds `shard`."""
    if shard is None or shard.dim >= len(shape):
        return shape
    return tuple(shard.full if d == shard.dim else n for d, n in enumerate(shape))


def _param_place(name: str, p: nn.Parameter, shard: Shard | None, rows: slice | None = None) -> TensorPlace:
    if shard is not None and shard.dim >= p.dim():  # a row-parallel layer's bias does not split
        shard = None
    if shard is not None and shard.dim == 0 and rows is None and shard.size < p.shape[0]:
        rows = slice(0, shard.size)  # the padding rows past the vocabulary stay zero
    shape = tuple(p.shape) if rows is None else (rows.stop - rows.start, *p.shape[1:])
    return TensorPlace(name, _full_shape(shape, shard), rows, shard)


def checkpoint_layout(model: nn.Module) -> dict[str, TensorPlace | None]:
    """Each checkpoint tensor name the model takes, and its place (a tied lm_head appears once, as the
    embedding); None for tensors other ranks hold (expert parallel)."""
    layout: dict[str, TensorPlace | None] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        shard = getattr(module, "weight_shard", None)
        for param_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # tied: the embedding's, placed already
                continue
            seen.add(id(p))
            name = ".".join(filter(None, (module_name, param_name)))
            if not isinstance(module, MergedLinear):
                layout[name] = _param_place(name, p, shard)
                continue
            parent = module_name.rpartition(".")[0]
            for i, part in enumerate(module.parts):
                layout[".".join(filter(None, (parent, part, param_name)))] = _param_place(
                    name, p, module.part_shards[i], module.part_rows(i))
        if hasattr(module, "foreign_tensors"):
            layout.update({f"{module_name}.{t}": None for t in module.foreign_tensors()})
    return layout


def load_weights(model: nn.Module, files: list[Path], dtype: torch.dtype, device: torch.device,
                 quantized: set[str] = frozenset()) -> None:
    """Replaces every meta parameter with its checkpoint tensor, checking names and shapes; the parameters in
    `quantized` become Q8_0 packings.

    Tensors already in the wanted dtype on CPU stay views of the memory-mapped file (no copy, pages
    shared with the OS cache), which is what makes a second load of a model take seconds; the parts of
    a merged projection are copied into its weight."""
    layout = checkpoint_layout(model)
    # A model that takes tensors stored stacked (Qwen3-VL-MoE's experts) splits them into the ones it has.
    split = getattr(model, "split_checkpoint_tensor", None)
    shapes = checkpoint_shapes(files) if split is not None else {}
    loaded: set[str] = set()
    held = PackedParts(dtype, device, layout)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                packed = packed_tensors(f)
                keys = [k for k in f.keys() if k.rpartition(".")[0] not in packed] + list(packed)  # noqa: SIM118 (no __iter__)
                for key in tqdm(keys, desc=f"Loading {file.name}", unit="tensor", leave=False):
                    if key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and key not in layout):
                        continue
                    tensor_name = key
                    if key not in layout and f"model.{key}" in layout:
                        key = f"model.{key}"  # a bare-decoder checkpoint (Qwen3Model) names tensors without it
                    if key not in layout and split is not None and (parts := split(key, shapes)) is not None:
                        stacked = PackedWeight.of(packed[key]()).dequantize() if key in packed else f.get_tensor(key)
                        _place_parts(model, layout, parts, stacked, dtype, device, file)
                        loaded.update(name for name, _ in parts)
                        continue
                    if key not in layout:
                        raise WeightsError(f"{file}: tensor {key!r} has no place in {type(model).__name__}")
                    place = layout[key]
                    if place is not None and tensor_name in packed:
                        held.place(model, place, packed[tensor_name](), file)
                    elif place is not None and place.param in quantized and (
                            q := _q8_0(f, tensor_name, place, file)) is not None:
                        held.place(model, place, q, file)
                    elif place is not None:
                        _place(model, place, _read(f, tensor_name, place, file), dtype, device)
                    loaded.add(key)
        except SafetensorError as e:
            raise WeightsError(f"{file}: cannot read safetensors ({e})") from None
    missing = sorted(set(layout) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise WeightsError(f"{files[0].parent}: checkpoint lacks {len(missing)} tensors: {shown}")
    held.finish(model)
    model.tie_weights()


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's checkpoint by its name, packed ones dequantized to float32 (exactly the
    weights they hold): what a float32 checkpoint of the same model would hold."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            packed = packed_tensors(f)
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k.rpartition(".")[0] not in packed})  # noqa: SIM118
            tensors.update({name: PackedWeight.of(read()).dequantize() for name, read in packed.items()})
    return tensors


def packed_tensors(f: Any) -> dict[str, Callable[[], PackedTensor]]:
    """A safetensors file's packed tensors (models/gguf.py writes them): name -> its PackedTensor, read when called
    (views of the memory-mapped file)."""
    listed = json.loads((f.metadata() or {}).get(PACKED_METADATA, "{}"))
    keys = set(f.keys())

    def reader(name: str, n: int, k: int, zero: int) -> Callable[[], PackedTensor]:
        parts = {part: f"{name}.packed_{part}" for part in PACKED_PARTS if f"{name}.packed_{part}" in keys}
        return lambda: PackedTensor.of_buffers({part: f.get_tensor(key) for part, key in parts.items()}, n, k, zero)

    return {name: reader(name, n, k, zero) for name, (n, k, zero) in listed.items()}


@dataclass
class PackedParts:
    """A checkpoint's packed tensors on their way into the model: a linear's or an embedding's weight (or the
    parts of a merged one, this rank's shard of each) becomes its packing (`hold_packed`) once all are read; any
    other, a merged weight with a part the checkpoint does not pack (a GGUF's BF16 q beside its Q8_0 k and v),
    or one whose parts do not stack on whole pairs of rows, is dequantized into a float32 parameter."""

    dtype: torch.dtype
    device: torch.device
    layout: dict[str, TensorPlace | None]
    parts: dict[nn.Module, list[tuple[TensorPlace, PackedTensor]]] = field(default_factory=dict)

    def place(self, model: nn.Module, place: TensorPlace, tensor: PackedTensor, file: Path) -> None:
        if (tensor.n, tensor.k) != place.shape[-2:] or len(place.shape) != 2:
            raise WeightsError(f"{file}: packed tensor of {place.param} has shape {(tensor.n, tensor.k)}, "
                               f"the config implies {place.shape}")
        module_name, _, param_name = place.param.rpartition(".")
        module = model.get_submodule(module_name)
        if (param_name == "weight" and isinstance(module, Linear | VocabEmbedding) and self.device.type == "cpu"
                and self.dtype == torch.float32):
            try:
                self.parts.setdefault(module, []).append((place, _packed_shard(tensor, place.shard)))
                return
            except ValueError:  # not on whole pairs or blocks: dequantized below
                self.parts.pop(module, None)
        _place(model, place, _dense_shard(tensor, place.shard), self.dtype, self.device)

    def finish(self, model: nn.Module) -> None:
        mappings = None
        for module, parts in self.parts.items():
            parts.sort(key=lambda part: 0 if part[0].rows is None else part[0].rows.start)
            rows = module.out_features if isinstance(module, Linear) else module.weight.shape[0]
            param = parts[0][0].param
            every_part = len(parts) == sum(p is not None and p.param == param for p in self.layout.values())
            try:
                if not every_part:
                    raise ValueError("some parts of the weight are not packed")
                tensor = PackedTensor.cat([t for _, t in parts]).padded(rows)
            except ValueError:  # a float32 weight, as a float32 checkpoint gives
                for place, t in parts:
                    _place(model, place, PackedWeight.of(t).dequantize(), self.dtype, self.device)
                continue
            if len(parts) > 1:  # copied into one: the parts' file pages are no longer read
                mappings = mappings or host_memory.FileMappings.read()
                for _, t in parts:
                    for buffer in t.buffers.values():
                        host_memory.release_pages(buffer, mappings)
            module.hold_packed(PackedWeight.of(tensor, getattr(module, "bias", None)))


def _packed_shard(tensor: PackedTensor, shard: Shard | None) -> PackedTensor:
    """This rank's part of a packed tensor (ValueError where it does not fall on pairs of rows or blocks)."""
    if shard is None:
        return tensor
    return tensor.pairs(shard.start, shard.stop) if shard.dim == 0 else tensor.columns(shard.start, shard.stop)


def _dense_shard(tensor: PackedTensor, shard: Shard | None) -> torch.Tensor:
    dense = PackedWeight.of(tensor).dequantize()
    if shard is None:
        return dense
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.stop),)
    return dense[index].contiguous()


def checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the safetensors headers."""
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = f.keys()
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in keys})
    return shapes


def _place_parts(model: nn.Module, layout: dict[str, TensorPlace | None], parts: TensorParts, stacked: torch.Tensor,
                 dtype: torch.dtype, device: torch.device, file: Path) -> None:
    for name, take in parts:
        place = layout.get(name, False)
        if place is False:
            raise WeightsError(f"{file}: tensor {name!r} (of a stacked tensor) has no place in {type(model).__name__}")
        if place is None:
            continue
        tensor = take(stacked)
        if tuple(tensor.shape) != place.shape:
            raise WeightsError(f"{file}: tensor {name!r} (of a stacked tensor) has shape {tuple(tensor.shape)}, "
                               f"the config implies {place.shape}")
        _place(model, place, tensor.contiguous(), dtype, device)


def _checked_slice(f: Any, name: str, place: TensorPlace, file: Path) -> Any:
    """The checkpoint tensor's lazy slice, once its shape is the one the config implies."""
    part = f.get_slice(name)
    shape = tuple(part.get_shape())
    if shape != place.shape:
        raise WeightsError(f"{file}: tensor {name!r} has shape {shape}, the config implies {place.shape}")
    return part


def _read(f: Any, name: str, place: TensorPlace, file: Path) -> torch.Tensor:
    """The checkpoint tensor, or the shard of it this rank holds (read alone from the file)."""
    part = _checked_slice(f, name, place, file)
    if place.shard is None:
        return f.get_tensor(name)
    index = (slice(None),) * place.shard.dim + (slice(place.shard.start, place.shard.stop),)
    return part[index].contiguous()


def _q8_0(f: Any, name: str, place: TensorPlace, file: Path) -> PackedTensor | None:
    """The whole checkpoint tensor (PackedParts takes this rank's shard of it) as Q8_0 blocks."""
    _checked_slice(f, name, place, file)
    return quantize_q8_0(f.get_tensor(name))


def _place(model: nn.Module, place: TensorPlace, tensor: torch.Tensor, dtype: torch.dtype,
           device: torch.device) -> None:
    module_name, _, param_name = place.param.rpartition(".")
    module = model.get_submodule(module_name)
    if place.rows is None:
        setattr(module, param_name, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
        return
    param = getattr(module, param_name)
    if param.is_meta:
        param = nn.Parameter(torch.zeros(param.shape, dtype=dtype, device=device), requires_grad=False)
        setattr(module, param_name, param)
    param.data[place.rows].copy_(tensor)


# ---- memory check ------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_GIB = 1 << 30
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class WeightFootprint:
    """Where a model's weights will live once loaded, in bytes."""

    mapped: int  # views of the memory-mapped checkpoint: page cache, never copied
    copied: int  # converted to another dtype or moved to a GPU: new memory


@dataclass(frozen=True)
class MemoryInfo:
    available: int  # bytes new allocations can take without swapping or an OOM kill
    total: int  # bytes of RAM the memory-mapped weights and the copies must share


def checkpoint_dtypes(files: list[Path]) -> dict[str, torch.dtype | None]:
    """Each tensor's stored dtype, read from the safetensors headers (no tensor data is read)."""
    dtypes: dict[str, torch.dtype | None] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = f.keys()  # a safe_open handle is not iterable itself
                for key in keys:
                    dtypes[key] = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
        except SafetensorError as e:
            raise WeightsError(f"{file}: cannot read safetensors ({e})") from None
    return dtypes


_ITEM_BYTES = {"U8": 1, "I8": 1, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class PackedSize:
    """A packed tensor's bytes as the checkpoint holds it, and at 8 bits a value (how it stacks with parts of
    other bits or zeros: PackedTensor.cat); `form` its bits and zero."""

    nbytes: int
    byte_nbytes: int
    form: tuple[int, int]


def packed_sizes(files: list[Path]) -> dict[str, PackedSize]:
    """Each packed tensor the checkpoint holds (models/gguf.py writes them), by its name."""
    sizes: dict[str, PackedSize] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = set(f.keys())
                for name, (_, _, zero) in json.loads((f.metadata() or {}).get(PACKED_METADATA, "{}")).items():
                    values, *rest = [f.get_slice(f"{name}.packed_{part}") for part in PACKED_PARTS
                                     if f"{name}.packed_{part}" in keys]
                    shape = values.get_shape()
                    scalars = sum(_ITEM_BYTES[s.get_dtype()] * math.prod(s.get_shape()) for s in rest)
                    in_bytes = math.prod(shape[:-1]) * 2 * TILE * BLOCK + scalars
                    sizes[name] = PackedSize(math.prod(shape) + scalars, in_bytes, (CHUNK_BITS[shape[-1]], zero))
        except SafetensorError as e:
            raise WeightsError(f"{file}: cannot read safetensors ({e})") from None
    return sizes


def weight_footprint(model: nn.Module, dtype: torch.dtype, device: torch.device,
                     stored: dict[str, torch.dtype | None] | None = None,
                     packed: dict[str, PackedSize] | None = None,
                     quantized: set[str] = frozenset()) -> WeightFootprint:
    """The bytes of `model`'s parameters (as built on the meta device from the config) in `dtype`.

    On CPU a tensor the checkpoint (`stored`: name -> dtype) already holds in `dtype` stays mapped
    from the file; without `stored` every weight counts as copied, as do merged projections (no
    checkpoint tensor has their name). A float32 CPU weight whose parts the checkpoint all holds packed
    (`packed`) takes their bytes: mapped where it is one, copied where they are stacked (at 8 bits a value where
    the parts' bits or zeros differ); one quantized at load (`quantized`), a Q8_0 packing's at most."""
    elem = torch.empty(0, dtype=dtype).element_size()
    mapped = copied = 0
    held = _held_parts(model, packed) if packed and device.type == "cpu" and dtype == torch.float32 else {}
    for name, p in model.named_parameters():  # a tied lm_head appears once
        if name in held and len(held[name]) == 1:
            mapped += held[name][0].nbytes
        elif name in held:
            mixed = len({part.form for part in held[name]}) > 1
            copied += sum(part.byte_nbytes if mixed else part.nbytes for part in held[name])
        elif name in quantized:
            copied += int(p.numel() * Q8_0_BYTES_PER_VALUE)
        elif device.type == "cpu" and stored is not None and stored.get(name) == dtype:
            mapped += p.numel() * elem
        else:
            copied += p.numel() * elem
    return WeightFootprint(mapped, copied)


def _held_parts(model: nn.Module, packed: dict[str, PackedSize]) -> dict[str, list[PackedSize]]:
    """Parameter name -> each of its checkpoint parts' packed sizes, for parameters packed in every part."""
    layout = checkpoint_layout(model)
    places = [(name, place) for name, place in layout.items() if place is not None]
    parts: dict[str, list[PackedSize]] = {}
    for name, place in places:
        if (size := packed.get(name, packed.get(name.removeprefix("model.")))) is not None:
            parts.setdefault(place.param, []).append(size)
    wanted = {param: sum(place.param == param for _, place in places) for param in parts}
    return {param: sizes for param, sizes in parts.items() if len(sizes) == wanted[param]}


def available_memory(device: torch.device) -> MemoryInfo:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return MemoryInfo(available=free, total=free)
    info = _parse_table(_MEMINFO.read_text())
    available, total = info["MemAvailable"] * 1024, info["MemTotal"] * 1024
    # Inside a container the cgroup (v2) limit binds before the machine's RAM does, and /proc/meminfo
    # does not show it. Its page cache is reclaimable, as MemAvailable assumes for the machine's.
    limit_file = _CGROUP / "memory.max"
    if limit_file.is_file() and (limit := limit_file.read_text().strip()) != "max":
        cache = _parse_table((_CGROUP / "memory.stat").read_text()).get("file", 0)
        used = int((_CGROUP / "memory.current").read_text()) - cache
        available, total = min(available, int(limit) - used), min(total, int(limit))
    return MemoryInfo(available=available, total=total)


def _parse_table(text: str) -> dict[str, int]:
    """`name: value [kB]` (/proc/meminfo) or `name value` (cgroup memory.stat) lines as a dict."""
    rows = (line.replace(":", " ").split() for line in text.splitlines())
    return {row[0]: int(row[1]) for row in rows if len(row) >= 2}


def check_memory(need: WeightFootprint, device: torch.device, mem: MemoryInfo | None = None) -> None:
    """Refuses, before anything is loaded, weights that would swap or get the process killed.

    Copies need memory that is free now. Mapped weights are file-backed page cache, which the
    kernel can evict and re-read rather than swap, and which may already be resident (a previous
    load, another process on the same files): they only have to fit in RAM beside the copies.
    The KV cache and activations come on top of the weights."""
    mem = mem or available_memory(device)
    gib = lambda n: f"{n / _GIB:.1f} GiB"  # noqa: E731
    if need.copied > mem.available:
        raise InsufficientMemoryError(
            f"the weights need {gib(need.copied)} of new memory on {device}, but only {gib(mem.available)} "
            f"is available; choose a smaller dtype or model")
    if need.mapped + need.copied > mem.total:
        raise InsufficientMemoryError(
            f"the weights need {gib(need.mapped + need.copied)} ({gib(need.mapped)} memory-mapped from the "
            f"checkpoint, {gib(need.copied)} copied), more than the {gib(mem.total)} of RAM; "
            f"choose a smaller dtype or model")
