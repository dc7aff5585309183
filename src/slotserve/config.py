"""Engine and model configuration: validated dataclasses built from user settings and config.json."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class ConfigError(ValueError):
    """A model's config.json or an engine setting is missing, malformed or unsupported."""


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto`/None picks float32 on CPU (no native bf16 GEMM there) and bfloat16 on CUDA."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype: unknown value {name!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def parse_device(name: str | torch.device | None) -> torch.device:
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {name!r} is not supported; choose cpu or cuda")
    return device


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling_type: str = "default"  # default | linear | yarn
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class VisionLanguageConfig:
    """What a vision-language checkpoint (Qwen3-VL) adds to its text model's config."""

    vision_config: dict[str, Any]  # the vision tower's fields (models/qwen3_vl_vision.py reads them)
    image_token_id: int  # <|image_pad|>: one per image token of the prompt
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the model code needs, normalised across config.json generations."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mixture of experts (Qwen3-MoE); num_experts 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Interleaved M-RoPE (Qwen3-VL): how many of the head's head_dim / 2 frequencies take the T, H, W position.
    mrope_section: tuple[int, ...] = ()
    vision: VisionLanguageConfig | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ConfigError("config.json: 'architectures' is missing or empty")
        vision = _parse_vision(cfg)
        if vision is not None:  # a vision-language config: its text model's fields are under `text_config`
            top = cfg
            cfg = {**cfg["text_config"], "architectures": archs}
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if key in top:
                    cfg[key] = top[key]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            model_type = cfg.get("model_type", "")
            return cls(
                architecture=archs[0],
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=_parse_rope(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias; Qwen3 follows `attention_bias` (False in every release).
                attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=model_type.startswith("qwen3") or archs[0].startswith("Qwen3"),
                eos_token_ids=_eos_ids(cfg, generation_config or {}),
                bos_token_id=cfg.get("bos_token_id"),
                # transformers >= 5 saves `num_experts` under its alias `num_local_experts`.
                num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
                num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
                mrope_section=_parse_mrope(cfg, hidden // heads if cfg.get("head_dim") is None else cfg["head_dim"]),
                vision=vision,
            )
        except KeyError as e:
            raise ConfigError(f"config.json: required field {e.args[0]!r} is missing") from None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file}: not found; a model directory needs a config.json")
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else {}
        return cls.from_dict(_read_json(cfg_file), gen)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear", "yarn"):
        raise ConfigError(f"config.json: rope type {kind!r} is not supported (supported: default, linear, yarn)")
    if kind == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ConfigError(f"config.json: rope type {kind!r} needs a 'factor'")
    return RopeConfig(
        theta=theta,
        scaling_type=kind,
        factor=float(params["factor"]),
        original_max_position=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _parse_vision(cfg: dict[str, Any]) -> VisionLanguageConfig | None:
    if "vision_config" not in cfg:
        return None
    if not isinstance(cfg.get("text_config"), dict) or not isinstance(cfg["vision_config"], dict):
        raise ConfigError("config.json: a vision-language model needs 'text_config' and 'vision_config' objects")
    try:
        return VisionLanguageConfig(dict(cfg["vision_config"]), int(cfg["image_token_id"]),
                                    int(cfg.get("video_token_id", -1)), int(cfg["vision_start_token_id"]),
                                    int(cfg["vision_end_token_id"]))
    except KeyError as e:
        raise ConfigError(f"config.json: required field {e.args[0]!r} is missing") from None


def _parse_mrope(cfg: dict[str, Any], head_dim: int) -> tuple[int, ...]:
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    section = tuple(int(n) for n in params.get("mrope_section") or ())
    if section and (len(section) != 3 or sum(section) != head_dim // 2):
        raise ConfigError(f"config.json: mrope_section {list(section)} must be 3 numbers summing to head_dim / 2 "
                          f"({head_dim // 2})")
    if section and params.get("mrope_interleaved") is False:
        raise ConfigError("config.json: only interleaved M-RoPE (Qwen3-VL) is supported")
    return section


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        if source is None:
            continue
        for i in source if isinstance(source, list) else [source]:
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


class ExecutorBackend(enum.Enum):
    """What runs the ranks of a model split over several (engine/executor.py)."""

    MP = "mp"  # worker processes the engine core starts on this machine
    RAY = "ray"  # Ray actors in a placement group, on any machines of a Ray cluster


class ExpertCommKind(enum.Enum):
    """How expert parallel moves tokens to their experts' ranks and back (distributed/expert_comm.py)."""

    ALL_TO_ALL = "all-to-all"  # each (token, expert) pair to its expert's rank alone, split counts first
    ALL_GATHER = "all-gather"  # every rank's tokens to every rank; the outputs reduce-scattered back


class PrefillPrecision(enum.Enum):
    """What calls of many rows (prefill) on a GGUF's packed weights multiply in (quantization/packed_linear.py), and
    a vision tower (models/qwen3_vl_vision.py: bfloat16 under AUTO only where its weights are bfloat16 values)."""

    AUTO = "auto"  # bfloat16 where the CPU has bfloat16 dot products (AMX, AVX512-BF16), else float32
    BFLOAT16 = "bfloat16"  # weights and activations rounded to bfloat16, float32 sums
    FLOAT32 = "float32"  # the weights' exact values


class SpeculativeMethod(enum.Enum):
    """Where speculative decoding's proposals come from (engine/proposers.py)."""

    NGRAM = "ngram"  # prompt lookup: what followed the latest n-gram where it occurred before in the sequence
    DRAFT_MODEL = "draft_model"  # a smaller model of the same tokenizer, greedy


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: up to `num_speculative_tokens` proposed tokens per sequence and step, all verified in
    the target model's next step (vLLM's `speculative_config`)."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    model: str | None = None  # the draft model (method draft_model): an alias, a directory or a GGUF file
    prompt_lookup_max: int = 5  # ngram: the longest n-gram looked up
    prompt_lookup_min: int = 2  # ngram: the shortest
    # No proposals while this many sequences or more run (a large batch is bound by compute, not by reading the
    # weights). None: where the verify rows of a step would pass 64, the native decode step's rows.
    disable_by_batch_size: int | None = None
    # draft_model: the draft proposes only the first this many token ids (its output head cut to them; None: all).
    # A byte-level BPE vocabulary's ids run roughly from the most merged pieces to the rarest, and a draft's head
    # is a large part of what it reads a step (Qwen2.5-0.5B's: a quarter): proposals stay exact, as verified.
    draft_vocab_size: int | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From vLLM's JSON shape (a dict, or its JSON text); ValueError naming the field that is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be an object, got {type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"speculative_config: unknown field {unknown[0]!r}; the fields are {', '.join(names)}")
        fields = dict(value)
        method = fields.pop("method", None)
        if method is None:
            method = "draft_model" if fields.get("model") else None
        try:
            fields["method"] = SpeculativeMethod(method)
        except ValueError:
            raise ValueError(f"speculative_config.method: unknown value {method!r}; choose one of "
                             f"{', '.join(m.value for m in SpeculativeMethod)}") from None
        if "num_speculative_tokens" not in fields:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        return cls(**fields)

    def __post_init__(self) -> None:
        def positive(name: str, value: object) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name}: must be a positive integer, got {value!r}")

        positive("num_speculative_tokens", self.num_speculative_tokens)
        positive("prompt_lookup_max", self.prompt_lookup_max)
        positive("prompt_lookup_min", self.prompt_lookup_min)
        for name in ("disable_by_batch_size", "draft_vocab_size"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: {self.prompt_lookup_min} is above "
                             f"prompt_lookup_max {self.prompt_lookup_max}")
        if self.method is SpeculativeMethod.DRAFT_MODEL and not self.model:
            raise ValueError("speculative_config.model: method draft_model needs the draft model")
        if self.method is SpeculativeMethod.NGRAM and self.model:
            raise ValueError("speculative_config.model: method ngram takes no model")


@dataclass
class EngineConfig:
    """What the user chose: which model, where, and the bounds of the KV cache and the batch."""

    model: str = "qwen2.5-coder-0.5b"
    dtype: str | None = None  # None/"auto": float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None/"auto": CUDA when available
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the cache
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: 1 GiB on CPU, 90 % of free memory on CUDA
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # tokens computed per step; longer prompts are prefilled in chunks
    enable_prefix_caching: bool = True
    task: str = "auto"  # "generate" | "embed" | "auto": embed for embedding checkpoints, else generate
    seed: int = 0
    # "int8": dynamically quantized int8 linear layers; "q8_0": a float checkpoint's linear and embedding weights
    # as GGUF Q8_0 blocks, quantized as they load (CPU, float32 only, both)
    quantization: str | None = None
    prefill_precision: PrefillPrecision = PrefillPrecision.AUTO  # a GGUF's prefill and a vision tower's GEMMs
    # CPU threads for torch and the parfor pool (they take turns; see parallel/cpu.py). None: the cores in
    # cpu_affinity, else SLOTSERVE_THREADS, else the cores this process may use.
    threads: int | None = None
    cpu_affinity: tuple[int, ...] | None = None  # restrict the process to these cores, one pool worker on each
    # One model over several ranks (tensor parallel), the experts split across them (expert parallel).
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_comm: ExpertCommKind = ExpertCommKind.ALL_TO_ALL
    distributed_executor_backend: ExecutorBackend | None = None  # None: mp when tensor_parallel_size > 1
    # Replicas of the whole engine behind one server's front end (engine/async_llm.py), the cores split between
    # them; with the ray backend, placed on the machines of a Ray cluster.
    data_parallel_size: int = 1
    distributed_timeout: float = 120.0  # seconds any collective or worker reply may take before the engine dies
    # The watchdog (engine/diagnostics.py) reports a core loop that has had work this long without finishing a step.
    stall_timeout: float = 300.0
    # Micro-batch overlap (parallel/ubatch.py): a step of at least the threshold's tokens (decode-only steps,
    # others) runs as this many micro-batches, one computing while another's collectives travel. 1: off.
    ubatches: int = 1
    ubatch_decode_threshold: int = 32
    ubatch_prefill_threshold: int = 512
    # Split only the kinds of steps that this engine has measured to run faster split (parallel/ubatch.py).
    ubatch_adaptive: bool = True
    # Vision-language models (Qwen3-VL): images a prompt may carry, and the pixel budget each is resized
    # into (None: the model's preprocessor_config.json).
    limit_mm_per_prompt: int = 4
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    # Speculative decoding (SpeculativeConfig, or its dict or JSON text); None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # The prefix cache's disk tier (docs/kv_offload.md): evicted and saved blocks as files in this directory,
    # at most kv_offload_bytes of them. None: off.
    kv_offload_dir: str | None = None
    kv_offload_bytes: int = 8 << 30

    def _check_kv_offload(self) -> None:
        if not isinstance(self.kv_offload_bytes, int) or isinstance(self.kv_offload_bytes, bool) \
                or self.kv_offload_bytes < 1:
            raise ValueError(f"kv_offload_bytes: must be a positive number of bytes, got {self.kv_offload_bytes!r}")
        if self.kv_offload_dir is None:
            return
        if not isinstance(self.kv_offload_dir, str | os.PathLike) or not str(self.kv_offload_dir):
            raise ValueError(f"kv_offload_dir: must be a directory path, got {self.kv_offload_dir!r}")
        self.kv_offload_dir = str(self.kv_offload_dir)
        if Path(self.kv_offload_dir).exists() and not Path(self.kv_offload_dir).is_dir():
            raise ValueError(f"kv_offload_dir: {self.kv_offload_dir} exists and is not a directory")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir: the disk tier extends the prefix cache; it needs prefix caching on")
        if self.data_parallel_size != 1:
            raise ValueError("kv_offload_dir: not supported with data_parallel_size > 1 (each replica would evict "
                             "the others' files from one directory); use one replica")
        if self.tensor_parallel_size != 1:
            raise ValueError("kv_offload_dir: not supported with tensor_parallel_size > 1 (each rank holds part of "
                             "every block); use one rank")
        if self.speculative_config is not None and self.speculative_config.method is SpeculativeMethod.DRAFT_MODEL:
            raise ValueError("kv_offload_dir: not supported with a draft model (its cache shares the blocks)")

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads: must be a positive integer, got {self.threads!r}")
        if self.cpu_affinity is not None:
            self._check_cpu_affinity()
        for name in ("max_model_len", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("image_min_pixels", "image_max_pixels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.stall_timeout, int | float) or self.stall_timeout <= 0:
            raise ValueError(f"stall_timeout: must be a positive number of seconds, got {self.stall_timeout!r}")
        if not isinstance(self.limit_mm_per_prompt, int) or self.limit_mm_per_prompt < 0:
            raise ValueError(f"limit_mm_per_prompt: must be a non-negative integer, got {self.limit_mm_per_prompt!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.quantization is not None:
            self._check_quantization()
        self._check_kinds()
        self._check_parallel()

    def _check_kinds(self) -> None:
        """The enum fields, given as their values (a CLI's strings) or as members."""
        for name, kind in (("distributed_executor_backend", ExecutorBackend), ("expert_comm", ExpertCommKind),
                           ("prefill_precision", PrefillPrecision)):
            value = getattr(self, name)
            if value is None or isinstance(value, kind):
                continue
            try:
                setattr(self, name, kind(value))
            except ValueError:
                raise ValueError(f"{name}: unknown value {value!r}; choose one of "
                                 f"{', '.join(k.value for k in kind)}") from None

    def _check_parallel(self) -> None:
        self._check_kv_offload()
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        tp = self.tensor_parallel_size
        if self.distributed_executor_backend is None and tp > 1:
            self.distributed_executor_backend = ExecutorBackend.MP
        if self.enable_expert_parallel and tp == 1:
            raise ValueError("enable_expert_parallel: needs tensor_parallel_size > 1 (the experts split over its "
                             "ranks)")
        for name in ("ubatches", "ubatch_decode_threshold", "ubatch_prefill_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.ubatches > 1 and tp == 1:
            raise ValueError("ubatches: micro-batches overlap the collectives of several ranks; needs "
                             "tensor_parallel_size > 1")
        if not isinstance(self.distributed_timeout, int | float) or self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout: must be a positive number of seconds, "
                             f"got {self.distributed_timeout!r}")

    def _check_cpu_affinity(self) -> None:
        if isinstance(self.cpu_affinity, str):  # the taskset syntax, as on the command line: "0-3,6"
            from slotserve.parallel.threadpool import parse_cpu_list

            try:
                self.cpu_affinity = tuple(parse_cpu_list(self.cpu_affinity))
            except ValueError as e:
                raise ValueError(f"cpu_affinity: {e}") from None
        cpus = tuple(self.cpu_affinity)
        if not cpus or not all(isinstance(c, int) and c >= 0 for c in cpus):
            raise ValueError(f"cpu_affinity: must be core numbers (e.g. (0, 1) or '0-3'), got {self.cpu_affinity!r}")
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        if not set(cpus) <= allowed:
            raise ValueError(f"cpu_affinity: cores {sorted(set(cpus) - allowed)} are not available to this process "
                             f"(it may use {sorted(allowed)})")
        self.cpu_affinity = cpus

    def _check_quantization(self) -> None:
        # The int8 kernels are fbgemm's (x86 CPU), Q8_0's the packed CPU kernels; both take float32 activations.
        if self.quantization not in ("int8", "q8_0"):
            raise ValueError(f"quantization: unknown value {self.quantization!r}; choose int8 or q8_0 (or leave it "
                             "unset)")
        # An explicit device is checked as named (a "cuda" request fails here even without CUDA).
        device = parse_device(None) if self.device in (None, "auto") else torch.device(self.device)
        if device.type != "cpu":
            raise ValueError(f"quantization: {self.quantization} runs on CPU only, but the device is {device}; "
                             "pass device='cpu'")
        if parse_dtype(self.dtype, device) != torch.float32:
            raise ValueError(f"quantization: {self.quantization} computes in float32, but dtype is {self.dtype!r}; "
                             "use dtype float32 or auto")
