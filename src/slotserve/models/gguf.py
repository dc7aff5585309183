"""GGUF conversion: turn a Qwen2/Qwen3/Qwen3-MoE GGUF into a Hugging Face-layout directory (config.json,
generation_config.json, model.safetensors with the quantized tensors packed as the kernels read them and the
rest in float32, tokenizer.json, tokenizer_config.json).

Reading the file is `gguf_reader`'s job; this module maps its metadata, tensors and vocabulary to
their Hugging Face equivalents and writes the directory atomically.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import shutil
import struct
import tempfile
import threading
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, Keys, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

from slotserve.models.gguf_reader import GGUFError, GGUFFile, read_gguf
from slotserve.parallel.threadpool import ThreadPool, get_pool
from slotserve.quantization import gguf_blocks

logger = logging.getLogger(__name__)

# llama.cpp architecture -> (transformers class, config.json model_type)
SUPPORTED_ARCHITECTURES = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}

# The Qwen2 pre-tokenizer split (also used by Qwen2.5 and Qwen3): contractions, letters with one
# leading non-letter, single digits, punctuation runs, newline runs, then other whitespace.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---- config ------------------------------------------------------------------------------------


_REQUIRED = object()


def _arch_key(g: GGUFFile, template: str, default: Any = _REQUIRED) -> Any:
    """The value of an architecture-scoped key such as `{arch}.block_count`."""
    name = template.format(arch=g.architecture)
    return g.require(name) if default is _REQUIRED else g.metadata.get(name, default)


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """config.json content for the model in `g`; raises GGUFError for what slotserve cannot run."""
    arch = g.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{g.path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if "token_embd.weight" not in g.tensors:
        raise GGUFError(f"{g.path}: missing tensors: token_embd.weight")
    hidden = _arch_key(g, Keys.LLM.EMBEDDING_LENGTH)
    heads = _arch_key(g, Keys.Attention.HEAD_COUNT)
    head_dim = _arch_key(g, Keys.Attention.KEY_LENGTH, hidden // heads)
    if _arch_key(g, Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise GGUFError(f"{g.path}: attention value_length differs from key_length; not supported")
    if (rope_dims := _arch_key(g, Keys.Rope.DIMENSION_COUNT, head_dim)) != head_dim:
        raise GGUFError(f"{g.path}: partial rotary embeddings (rope.dimension_count {rope_dims}, "
                        f"head_dim {head_dim}) are not supported")
    hf_class, model_type = SUPPORTED_ARCHITECTURES[arch]
    cfg: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": g.tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": _arch_key(g, Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": _arch_key(g, Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": _arch_key(g, Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _arch_key(g, Keys.Attention.LAYERNORM_RMS_EPS),
        "rope_theta": _arch_key(g, Keys.Rope.FREQ_BASE, 10000.0),
        "max_position_embeddings": _arch_key(g, Keys.LLM.CONTEXT_LENGTH),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": "float32",
    }
    if arch != "qwen2":  # Qwen2 always has q/k/v bias; Qwen3 declares it
        cfg["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
    if arch == "qwen3moe":
        cfg.update(_moe_config(g, cfg["num_hidden_layers"]))
    if (scaling := _rope_scaling(g)) is not None:
        cfg["rope_scaling"] = scaling
    for name, meta_key in (("bos_token_id", Keys.Tokenizer.BOS_ID), ("eos_token_id", Keys.Tokenizer.EOS_ID)):
        if meta_key in g.metadata:
            cfg[name] = g.metadata[meta_key]
    return cfg


def _moe_config(g: GGUFFile, layers: int) -> dict[str, Any]:
    gating = _arch_key(g, Keys.LLM.EXPERT_GATING_FUNC, ExpertGatingFuncType.SOFTMAX)
    if gating != ExpertGatingFuncType.SOFTMAX:
        raise GGUFError(f"{g.path}: expert gating function {gating} is not supported (Qwen3-MoE routes by softmax)")
    experts, used = _arch_key(g, Keys.LLM.EXPERT_COUNT), _arch_key(g, Keys.LLM.EXPERT_USED_COUNT)
    if not 0 < used <= experts:
        raise GGUFError(f"{g.path}: expert_used_count {used} must be between 1 and expert_count {experts}")
    # A layer is dense only if it has the dense FFN and no router: one with neither counts as sparse,
    # so that the missing-tensor check names the expert tensors it lacks.
    dense = [i for i in range(layers)
             if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors and f"blk.{i}.ffn_gate.weight" in g.tensors]
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": _arch_key(g, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        # Every Qwen3-MoE release renormalises the top-k weights (llama.cpp hard-codes it for qwen3moe).
        "norm_topk_prob": bool(_arch_key(g, Keys.LLM.EXPERT_WEIGHTS_NORM, True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _rope_scaling(g: GGUFFile) -> dict[str, Any] | None:
    kind = _arch_key(g, Keys.Rope.SCALING_TYPE, "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"{g.path}: rope scaling type {kind!r} is not supported (supported: linear, yarn)")
    scaling = {"rope_type": kind, "factor": _arch_key(g, Keys.Rope.SCALING_FACTOR)}
    if (original := _arch_key(g, Keys.Rope.SCALING_ORIG_CTX_LEN, 0)) > 0:
        scaling["original_max_position_embeddings"] = original
    if kind == "yarn":
        for name, template in (("beta_fast", Keys.Rope.SCALING_YARN_BETA_FAST),
                               ("beta_slow", Keys.Rope.SCALING_YARN_BETA_SLOW)):
            if (value := _arch_key(g, template, None)) is not None:
                scaling[name] = value
    return scaling


def generation_config(g: GGUFFile) -> dict[str, Any]:
    # Instruct models end a turn with an end-of-turn token that may differ from eos: stop on both.
    stops: list[int] = []
    for meta_key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
        if meta_key in g.metadata and g.metadata[meta_key] not in stops:
            stops.append(g.metadata[meta_key])
    gen: dict[str, Any] = {}
    if Keys.Tokenizer.BOS_ID in g.metadata:
        gen["bos_token_id"] = g.metadata[Keys.Tokenizer.BOS_ID]
    if stops:
        gen["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    if Keys.Tokenizer.PAD_ID in g.metadata:
        gen["pad_token_id"] = g.metadata[Keys.Tokenizer.PAD_ID]
    return gen


# ---- tensors -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMapping:
    """HF tensor `hf_name` is GGUF tensor `gguf_name`, or, when `expert` is set, that expert's slice of
    a tensor stacking a layer's experts along its first axis (llama.cpp's layout for MoE weights)."""

    hf_name: str
    gguf_name: str
    gguf_shape: tuple[int, ...]  # what the GGUF tensor must be, in numpy order
    expert: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.gguf_shape if self.expert is None else self.gguf_shape[1:]

    @property
    def rows(self) -> tuple[int, int]:
        """The HF tensor's rows [start, stop) in the GGUF tensor flattened to (rows, row_length)."""
        n = int(np.prod(self.shape[:-1]))
        index = self.expert or 0
        return index * n, (index + 1) * n


def tensor_mappings(g: GGUFFile, cfg: dict[str, Any]) -> list[TensorMapping]:
    """Every tensor the HF checkpoint needs, checked to exist in `g` with the shape `cfg` implies."""
    hidden = cfg["hidden_size"]
    q_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    has_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    wanted = [("model.embed_tokens.weight", "token_embd.weight", (cfg["vocab_size"], hidden))]
    for i in range(cfg["num_hidden_layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        wanted += [
            (hf + "input_layernorm.weight", gg + "attn_norm.weight", (hidden,)),
            (hf + "self_attn.q_proj.weight", gg + "attn_q.weight", (q_dim, hidden)),
            (hf + "self_attn.k_proj.weight", gg + "attn_k.weight", (kv_dim, hidden)),
            (hf + "self_attn.v_proj.weight", gg + "attn_v.weight", (kv_dim, hidden)),
            (hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (hidden, q_dim)),
            (hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (hidden,)),
            *_ffn_tensors(cfg, i),
        ]
        if has_bias:
            wanted += [
                (hf + "self_attn.q_proj.bias", gg + "attn_q.bias", (q_dim,)),
                (hf + "self_attn.k_proj.bias", gg + "attn_k.bias", (kv_dim,)),
                (hf + "self_attn.v_proj.bias", gg + "attn_v.bias", (kv_dim,)),
            ]
        if cfg["model_type"] != "qwen2":
            wanted += [
                (hf + "self_attn.q_norm.weight", gg + "attn_q_norm.weight", (cfg["head_dim"],)),
                (hf + "self_attn.k_norm.weight", gg + "attn_k_norm.weight", (cfg["head_dim"],)),
            ]
    wanted.append(("model.norm.weight", "output_norm.weight", (hidden,)))
    if not cfg["tie_word_embeddings"]:
        wanted.append(("lm_head.weight", "output.weight", (cfg["vocab_size"], hidden)))

    mappings = [TensorMapping(*w) for w in wanted]
    missing = list(dict.fromkeys(m.gguf_name for m in mappings if m.gguf_name not in g.tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise GGUFError(f"{g.path}: missing tensors: {shown}")
    for m in mappings:
        t = g.tensors[m.gguf_name]
        if t.shape != m.gguf_shape:
            raise GGUFError(f"{g.path}: tensor {m.gguf_name!r} has shape {list(t.shape)}, "
                            f"the config implies {list(m.gguf_shape)}")
    unused = sorted(set(g.tensors) - {m.gguf_name for m in mappings})
    if unused:
        logger.warning("%s: ignoring %d tensors slotserve does not use: %s", g.path, len(unused), unused[:5])
    for qtype in sorted({g.tensors[m.gguf_name].qtype for m in mappings}):
        if not _can_dequantize(qtype):
            name = next(m.gguf_name for m in mappings if g.tensors[m.gguf_name].qtype == qtype)
            raise GGUFError(f"{g.path}: tensor {name!r} has type {qtype.name}, which gguf-py cannot dequantize")
    return mappings


def _ffn_tensors(cfg: dict[str, Any], layer: int) -> list[tuple]:
    """TensorMapping fields for one layer's MLP: dense, or the router and every expert."""
    hf, gg = f"model.layers.{layer}.mlp.", f"blk.{layer}."
    hidden, experts = cfg["hidden_size"], cfg.get("num_experts")
    if not experts or layer in cfg["mlp_only_layers"]:
        inter = cfg["intermediate_size"]
        return [(hf + "gate_proj.weight", gg + "ffn_gate.weight", (inter, hidden)),
                (hf + "up_proj.weight", gg + "ffn_up.weight", (inter, hidden)),
                (hf + "down_proj.weight", gg + "ffn_down.weight", (hidden, inter))]
    inter = cfg["moe_intermediate_size"]
    wanted: list[tuple] = [(hf + "gate.weight", gg + "ffn_gate_inp.weight", (experts, hidden))]
    for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        wanted += [(f"{hf}experts.{e}.{proj}_proj.weight", f"{gg}ffn_{proj}_exps.weight", (experts, *shape), e)
                   for e in range(experts)]
    return wanted


def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    try:  # probing one zero block is cheaper and more honest than a hard-coded list
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


_Job = tuple[str, int, int, int]  # GGUF tensor, rows [start, stop), the first of them in the float32 array
PACKED_METADATA = "slotserve.packed"  # the safetensors metadata key: {tensor: [n, k, zero]} of the packed ones
# A packed tensor's buffers (quantization/packed_tensor.py's), each `{name}.packed_{part}`.
PACKED_PARTS = ("values", "scales", "offsets", "scale_factors", "offset_factors")
SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.float16: "F16", torch.float32: "F32"}
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def write_weights(g: GGUFFile, mappings: list[TensorMapping], out_file: Path, pool: ThreadPool | None = None) -> None:
    """Every mapped tensor into one safetensors file: a quantized 2-D tensor packed in its smallest exact form
    (quantization/packed_tensor.py), which the kernels read as it is: `{name}.packed_{part}` for each of its
    PACKED_PARTS, listed under PACKED_METADATA, where every block fits (K-quants read from their bytes,
    gguf_blocks.py; other types fitted to their dequantized values); the rest float32, and everything where the
    kernels do not build here. One tensor at a time is dequantized, on `pool`'s executors (default `get_pool()`:
    gguf-py's numpy kernels release the GIL), so memory stays at the largest tensor's float32 whatever the model
    size."""
    # Imported here: kernels.native imports model_store, which imports this module.
    from slotserve.quantization.packed_linear import built, pack_narrow


    entries: list[tuple[str, str, list[int], int]] = []  # name, dtype, shape, bytes
    packed: dict[str, list[int]] = {}
    pool = pool or get_pool()
    reserved = _header_bound(mappings)
    with out_file.open("wb") as out, tqdm(total=sum(int(np.prod(m.shape)) * 4 for m in mappings),
                                          desc="convert", unit="B", unit_scale=True) as bar:
        out.seek(8 + reserved)  # the data goes straight after the header's room: the file is never copied
        for m in mappings:
            qtype = g.tensors[m.gguf_name].qtype
            if qtype in gguf_blocks.QTYPES and len(m.shape) == 2 and built():
                tensor = gguf_blocks.packed_k_quant(g.raw_rows(m.gguf_name, *m.rows), qtype)
                bar.update(int(np.prod(m.shape)) * 4)
            else:
                rows = _dequantize(g, m, pool)
                bar.update(rows.nbytes)
                quantized = qtype not in _FLOAT_TYPES and rows.ndim == 2
                tensor = pack_narrow(torch.from_numpy(rows)) if quantized else None
            g.release_rows(m.gguf_name, *m.rows)
            if tensor is None:
                entries.append((m.hf_name, "F32", list(rows.shape), rows.nbytes))
                out.write(rows.data)
                continue
            packed[m.hf_name] = [tensor.n, tensor.k, tensor.zero]
            for part, t in tensor.buffers.items():
                entries.append((f"{m.hf_name}.packed_{part}", SAFETENSORS_DTYPES[t.dtype], list(t.shape), t.nbytes))
                out.write(t.contiguous().view(torch.uint8).numpy().data)
        header: dict[str, Any] = {"__metadata__": {"format": "pt", PACKED_METADATA: json.dumps(packed)}}
        offset = 0
        for name, dtype, shape, nbytes in entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        if len(header_bytes) > reserved:  # _header_bound is an upper bound by construction
            raise AssertionError(f"safetensors header of {len(header_bytes)} bytes over its {reserved} reserved")
        out.seek(0)
        out.write(struct.pack("<Q", reserved) + header_bytes.ljust(reserved, b" "))  # the format allows the spaces


# A header entry's bytes beside its name: `"NAME":{"dtype":"F32","shape":[..],"data_offsets":[..,..]},` with up to
# six dimensions, each number under 20 digits and a comma; a packed tensor's `\"NAME\": [n, k, zero], ` in the
# metadata (json.dumps' default separators, its quotes escaped).
_ENTRY_BYTES, _PACKED_ENTRY_BYTES = 49 + 8 * 21, 12 + 3 * 22


def _header_bound(mappings: list[TensorMapping]) -> int:
    """At least the bytes of the safetensors header write_weights writes for `mappings`, a multiple of 8 (the
    format wants its data 8-byte aligned): each tensor as every PACKED_PARTS entry and listed packed."""
    per_tensor = [len(PACKED_PARTS) * (_ENTRY_BYTES + len(m.hf_name) + len(".packed_offset_factors"))
                  + _PACKED_ENTRY_BYTES + len(m.hf_name) for m in mappings]
    bound = 256 + sum(per_tensor)
    return bound + -bound % 8


def _dequantize(g: GGUFFile, m: TensorMapping, pool: ThreadPool) -> np.ndarray:
    """The HF tensor `m` as float32, in its shape; its row chunks dequantized in parallel."""
    lo, hi = m.rows
    out = np.empty((hi - lo, m.shape[-1]), dtype=np.float32)
    jobs: list[_Job] = [(m.gguf_name, start, stop, start - lo)
                        for start, stop in _clip(g.tensors[m.gguf_name].row_chunks(), lo, hi)]

    def run(job: _Job) -> int:
        name, start, stop, at = job
        out[at:at + stop - start] = g.dequantize_rows(name, start, stop)
        return 0

    _run_jobs(jobs, run, pool)
    return out.reshape(m.shape)


def _run_jobs(jobs: list[_Job], run: Callable[[_Job], int], pool: ThreadPool) -> None:
    """run(job) for every job, each executor of `pool` taking the next job as soon as it is free: jobs
    differ in cost by quantization type, so a static split would leave executors idle at the end. Once
    a job raised, no more are taken, and the pool re-raises the error in the caller."""
    lock = threading.Lock()  # guards the job iterator and `failed`
    pending = iter(jobs)
    failed = False

    def executor(_ctx: Any, _index: int) -> None:
        nonlocal failed
        while True:
            with lock:
                job = None if failed else next(pending, None)
            if job is None:
                return
            try:
                run(job)
            except BaseException:
                with lock:
                    failed = True
                raise

    pool.parfor(0, pool.threads, executor)  # one item per executor; each drains the shared jobs


def _clip(chunks: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of `chunks` (consecutive row ranges from `row_chunks`) within rows [lo, hi).

    An expert's slice keeps the stacked tensor's chunking, so memory stays bounded by the reader's
    chunk size whatever the expert size, and a dense tensor's jobs are exactly its chunks."""
    i = bisect_right(chunks, lo, key=operator.itemgetter(0)) - 1  # the chunk holding row `lo`
    clipped = []
    for start, stop in chunks[i:]:
        if start >= hi:
            break
        clipped.append((max(start, lo), min(stop, hi)))
    return clipped


# ---- tokenizer ---------------------------------------------------------------------------------


def build_tokenizer(g: GGUFFile) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equivalent to the one the GGUF metadata describes."""
    kind = g.require(Keys.Tokenizer.MODEL)
    pre = g.metadata.get(Keys.Tokenizer.PRE, "default")
    if kind != "gpt2" or pre != "qwen2":
        raise GGUFError(f"{g.path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
                        "(supported: gpt2 with qwen2)")
    tokens: list[str] = g.require(Keys.Tokenizer.LIST)
    types: list[int] = g.metadata.get(Keys.Tokenizer.TOKEN_TYPE, [TokenType.NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{g.path}: {len(tokens)} tokens but {len(types)} token types")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise GGUFError(f"{g.path}: token {dup!r} appears more than once in the vocabulary")
    merges = []
    for merge in g.require(Keys.Tokenizer.MERGES):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise GGUFError(f"{g.path}: malformed merge {merge!r}")
        merges.append((left, right))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(g, tokens)
    # The tokens are already in the BPE vocabulary, so these keep their GGUF ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == TokenType.USER_DEFINED])
    return tok


def _post_processor(g: GGUFFile, tokens: list[str]) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    template, specials = "$A", []
    for flag, id_key, left in ((Keys.Tokenizer.ADD_BOS, Keys.Tokenizer.BOS_ID, True),
                               (Keys.Tokenizer.ADD_EOS, Keys.Tokenizer.EOS_ID, False)):
        if g.metadata.get(flag):
            token = tokens[g.require(id_key)]
            template = f"{token} {template}" if left else f"{template} {token}"
            specials.append((token, g.metadata[id_key]))
    if not specials:
        return byte_level
    return processors.Sequence([byte_level, processors.TemplateProcessing(single=template, special_tokens=specials)])


def tokenizer_config(g: GGUFFile) -> dict[str, Any]:
    tokens: list[str] = g.require(Keys.Tokenizer.LIST)
    cfg: dict[str, Any] = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": bool(g.metadata.get(Keys.Tokenizer.ADD_BOS, False)),
        "add_eos_token": bool(g.metadata.get(Keys.Tokenizer.ADD_EOS, False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _arch_key(g, Keys.LLM.CONTEXT_LENGTH),
    }
    for name, key in (("bos_token", Keys.Tokenizer.BOS_ID), ("eos_token", Keys.Tokenizer.EOS_ID),
                      ("pad_token", Keys.Tokenizer.PAD_ID)):
        if key in g.metadata:
            token_id = g.metadata[key]
            if not 0 <= token_id < len(tokens):
                raise GGUFError(f"{g.path}: {key} = {token_id} is outside the vocabulary of {len(tokens)}")
            cfg[name] = tokens[token_id]
    if Keys.Tokenizer.CHAT_TEMPLATE in g.metadata:
        cfg["chat_template"] = g.metadata[Keys.Tokenizer.CHAT_TEMPLATE]
    return cfg


# ---- conversion --------------------------------------------------------------------------------


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, pool: ThreadPool | None = None) -> None:
    """Write a Hugging Face-layout directory (config, float32 safetensors, tokenizer) for a GGUF model.

    `pool` (default `get_pool()`, sized by `--threads`) dequantizes and writes the weights, so the
    conversion uses every core it is given.

    Everything is checked before the slow dequantization starts, built in a temporary sibling
    directory and renamed into place, so `out_dir` either does not exist or is complete.
    Raises FileExistsError if `out_dir` exists (also when a concurrent conversion finished first).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: already exists")
    g = read_gguf(gguf_path)
    cfg = hf_config(g)
    mappings = tensor_mappings(g, cfg)
    tokenizer = build_tokenizer(g)
    if len(g.require(Keys.Tokenizer.LIST)) > cfg["vocab_size"]:
        raise GGUFError(f"{g.path}: the tokenizer has more tokens than token_embd has rows ({cfg['vocab_size']})")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out_dir)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=_partial_prefix(out_dir)))
    try:
        _write_json(tmp / "config.json", cfg)
        _write_json(tmp / "generation_config.json", generation_config(g))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(g))
        tokenizer.save(str(tmp / "tokenizer.json"))
        write_weights(g, mappings, tmp / "model.safetensors", pool)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            tmp.rename(out_dir)
        except OSError:
            if out_dir.exists():
                raise FileExistsError(f"{out_dir}: appeared while converting (another process?)") from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _partial_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.partial-{os.getpid()}-"


def remove_stale_partials(target: Path) -> None:
    """Delete leftovers `.{name}.partial-{pid}-*` of `target` written by processes that are gone."""
    for leftover in target.parent.glob(f".{target.name}.partial-*"):
        pid = leftover.name.removeprefix(f".{target.name}.partial-").split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            logger.info("removing %s, left by an interrupted run", leftover)
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
