"""GGUF reading and conversion: tiny synthetic GGUFs against `transformers`, error cases, and the real
default model's tokenizer against the Qwen tokenizer."""

from __future__ import annotations

import json
import time
import unicodedata
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from slotserve.config import ModelConfig
from slotserve.models import gguf as gguf_mod
from slotserve.models import gguf_reader
from slotserve.models.gguf import build_tokenizer, convert_gguf, hf_config
from slotserve.models.gguf_reader import GGUFError, GGUFFile, read_gguf
from slotserve.parallel.threadpool import ThreadPool, worker_id
from slotserve.tokenizer import Tokenizer
from tests.gguf_fixtures import (
    QWEN3_TOKENIZER_JSON,
    TinyGGUF,
    converted_arrays,
    hf_model_of,
    hf_to_gguf_name,
    tiny_gguf,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def _convert(tg: TinyGGUF, tmp_path: Path, **kwargs) -> Path:
    out = tmp_path / "out"
    convert_gguf(tg.write(tmp_path / "m.gguf"), out, **kwargs)
    return out


@pytest.fixture(scope="module")
def qwen2_converted(tmp_path_factory) -> tuple[TinyGGUF, object, Path]:
    tg, model = tiny_gguf("qwen2", tie=False)
    return tg, model, _convert(tg, tmp_path_factory.mktemp("qwen2"))


# ---- conversion against transformers -----------------------------------------------------------


@pytest.mark.parametrize(("arch", "tie", "rope_scaling"), [("qwen2", False, None), ("qwen3", True, YARN)])
def test_converted_weights_and_config_match_source(tmp_path, arch, tie, rope_scaling):
    tg, source = tiny_gguf(arch, tie=tie, rope_scaling=rope_scaling)
    assert {tg.types.get(n, gguf.GGMLQuantizationType.F32).name for n in tg.tensors} == {
        "F32", "F16", "BF16", "Q8_0", "Q5_0"}
    out = _convert(tg, tmp_path)
    loaded = hf_model_of(out)

    src, got = source.config, loaded.config
    for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(got, attr) == getattr(src, attr), attr
    head_dim = getattr(src, "head_dim", src.hidden_size // src.num_attention_heads)
    assert type(loaded).__name__ == type(source).__name__
    assert got.rope_parameters == src.rope_parameters

    state = loaded.state_dict()
    assert set(state) == set(source.state_dict())
    for name, tensor in state.items():
        if tie and name == "lm_head.weight":
            continue
        gguf_name = hf_to_gguf_name(name)
        got_np = tensor.numpy()
        # Bit-exact against gguf-py's own round trip; close to the original within quantization error.
        np.testing.assert_array_equal(got_np, tg.expected(gguf_name), err_msg=name)
        scale = np.abs(tg.tensors[gguf_name]).max()
        np.testing.assert_allclose(got_np, tg.tensors[gguf_name], atol=0.1 * scale, err_msg=name)

    cfg = ModelConfig.from_dir(out)
    assert cfg.architecture == type(source).__name__
    assert (cfg.head_dim, cfg.tie_word_embeddings, cfg.qk_norm) == (head_dim, tie, arch == "qwen3")
    assert cfg.rope.scaling_type == (rope_scaling or {}).get("rope_type", "default")
    assert cfg.eos_token_ids == (tg.metadata["tokenizer.ggml.eos_token_id"],)


def test_f32_gguf_gives_the_source_logits(tmp_path):
    tg, source = tiny_gguf("qwen2", tie=False, mixed=False)
    loaded = hf_model_of(_convert(tg, tmp_path))
    ids = torch.tensor([[3, 70, 200, 5, 99, 264, 1, 42]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)


class _Bar:
    """Stands in for tqdm: counts the bytes reported."""

    def __init__(self, total: int, **_) -> None:
        self.total, self.n = total, 0

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int) -> None:
        self.n += n


def test_thread_pool_gives_identical_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_reader, "_DEQUANT_CHUNK_ELEMENTS", 64 * 5)  # many small jobs to share out
    bars: list[_Bar] = []

    def bar(**kwargs) -> _Bar:
        bars.append(_Bar(**kwargs))
        return bars[-1]

    monkeypatch.setattr(gguf_mod, "tqdm", bar)
    executors: set[int] = set()
    dequantize_rows = GGUFFile.dequantize_rows

    def recorded(self, *args):
        executors.add(worker_id())
        time.sleep(0.002)  # each job long enough that the other executors take some: one alone can drain them all
        return dequantize_rows(self, *args)

    monkeypatch.setattr(GGUFFile, "dequantize_rows", recorded)
    tg, _ = tiny_gguf("qwen2", tie=False)
    path = tg.write(tmp_path / "m.gguf")
    convert_gguf(path, tmp_path / "serial", pool=ThreadPool(1))
    assert executors == {0}  # a 1-thread pool: the caller's executor index
    executors.clear()
    pool = ThreadPool(3)  # more executors than the machine's 2 cores: jobs finish out of order
    convert_gguf(path, tmp_path / "pooled", pool=pool)
    pool.shutdown()
    assert len(executors) > 1
    assert (tmp_path / "pooled" / "model.safetensors").read_bytes() == (
        tmp_path / "serial" / "model.safetensors").read_bytes()
    assert [bar.n for bar in bars] == [bar.total for bar in bars]  # the progress bar saw every byte


def test_failing_job_raises_in_the_caller(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_reader, "_DEQUANT_CHUNK_ELEMENTS", 64 * 5)
    dequantize_rows = GGUFFile.dequantize_rows

    def broken(self, name, start, stop):
        if name == "blk.1.attn_q.weight":
            raise GGUFError("bad block")
        return dequantize_rows(self, name, start, stop)

    tg, _ = tiny_gguf("qwen2")
    path = tg.write(tmp_path / "m.gguf")
    pool = ThreadPool(2)
    with monkeypatch.context() as m:
        m.setattr(GGUFFile, "dequantize_rows", broken)
        with pytest.raises(GGUFError, match="bad block"):
            convert_gguf(path, tmp_path / "out", pool=pool)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    convert_gguf(path, tmp_path / "out", pool=pool)  # the pool is still usable
    pool.shutdown()
    loaded = converted_arrays(tmp_path / "out")
    np.testing.assert_array_equal(loaded["model.layers.1.self_attn.q_proj.weight"],
                                  tg.expected("blk.1.attn_q.weight"))


def test_large_tensors_are_dequantized_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_reader, "_DEQUANT_CHUNK_ELEMENTS", 64 * 5)  # 5 rows of 64: ragged last chunk
    tg, _ = tiny_gguf("qwen2")
    g = read_gguf(tg.write(tmp_path / "m.gguf"))
    assert g.tensors["blk.0.attn_k.weight"].row_chunks() == [(i, min(i + 5, 32)) for i in range(0, 32, 5)]
    for name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.1.attn_q.weight"):
        np.testing.assert_array_equal(g.dequantize(name), tg.expected(name))
    convert_gguf(g.path, tmp_path / "out", pool=ThreadPool(2))
    loaded = converted_arrays(tmp_path / "out")
    np.testing.assert_array_equal(loaded["model.embed_tokens.weight"], tg.expected("token_embd.weight"))


# ---- tokenizer and the other files ------------------------------------------------------------


def test_tokenizer_and_chat_template_from_gguf(qwen2_converted):
    tg, _, out = qwen2_converted
    tokens = tg.metadata["tokenizer.ggml.tokens"]
    tok = Tokenizer.from_dir(out)
    assert tok.vocab_size == len(tokens)
    assert tok.encode("hello world") == [tokens.index("hello"), tokens.index("Ġworld")]
    im_start, im_end = tokens.index("<|im_start|>"), tokens.index("<|im_end|>")
    ids = tok.encode("<|im_start|>hello<|im_end|><tool_call>")
    assert ids == [im_start, tokens.index("hello"), im_end, tokens.index("<tool_call>")]
    assert tok.decode(ids) == "hello<tool_call>"  # control tokens are special, user-defined ones are not
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|><tool_call>"
    assert tok.decode(tok.encode("héllo 世界 🙂\n\t x")) == "héllo 世界 🙂\n\t x"
    assert tok.eos_token_id == im_end
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == tg.metadata["tokenizer.chat_template"]
    assert (tok_cfg["eos_token"], tok_cfg["bos_token"], tok_cfg["pad_token"]) == (
        "<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    assert tok_cfg["add_bos_token"] is False
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == im_end and gen["bos_token_id"] == tokens.index("<|endoftext|>")


def test_add_bos_token_adds_bos(tmp_path):
    tg, _ = tiny_gguf("qwen2")
    tg.metadata["tokenizer.ggml.add_bos_token"] = True
    tok = build_tokenizer(read_gguf(tg.write(tmp_path / "m.gguf")))
    bos, hello = tg.metadata["tokenizer.ggml.bos_token_id"], tg.metadata["tokenizer.ggml.tokens"].index("hello")
    assert tok.encode("hello").ids == [bos, hello]
    assert tok.encode("hello", add_special_tokens=False).ids == [hello]


@pytest.mark.parametrize(("scaling", "expected"), [
    ({"type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ({"type": "yarn", "factor": 4.0, "original_context_length": 32768, "yarn_beta_fast": 16.0},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 16.0}),
    ({"type": "none"}, None),
])
def test_rope_scaling_metadata(tmp_path, scaling, expected):
    tg, _ = tiny_gguf("qwen2")
    tg.metadata.update({f"qwen2.rope.scaling.{k}": v for k, v in scaling.items()})
    assert hf_config(read_gguf(tg.write(tmp_path / "m.gguf"))).get("rope_scaling") == expected


def test_metadata_is_read_exactly(tmp_path):
    tg, _ = tiny_gguf("qwen3", tie=True)
    g = read_gguf(tg.write(tmp_path / "m.gguf"))
    assert g.architecture == "qwen3"
    assert g.metadata["qwen3.attention.layer_norm_rms_epsilon"] == 1e-6  # float32, shortest decimal
    assert g.metadata["tokenizer.ggml.tokens"] == tg.metadata["tokenizer.ggml.tokens"]
    assert g.metadata["tokenizer.ggml.token_type"] == tg.metadata["tokenizer.ggml.token_type"]
    assert g.tensors["blk.0.ffn_down.weight"].shape == (64, 128)  # numpy order, not ggml's
    assert g.tensors["blk.0.ffn_down.weight"].qtype == gguf.GGMLQuantizationType.Q5_0


# ---- errors ------------------------------------------------------------------------------------


def _convert_error(tg: TinyGGUF, tmp_path: Path) -> str:
    path = tg.write(tmp_path / "bad.gguf")
    with pytest.raises(GGUFError) as info:
        convert_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))
    return str(info.value)


def test_bad_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match=r"model\.gguf: not a GGUF file"):
        read_gguf(path)
    path.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(path)
    with pytest.raises(GGUFError, match="cannot be read"):
        read_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("keep", [0.01, 0.5, 0.999])
def test_truncated_file(tmp_path, keep):
    tg, _ = tiny_gguf("qwen2")
    data = tg.write(tmp_path / "full.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(GGUFError, match=r"cut\.gguf: truncated"):
        read_gguf(path)


def test_missing_tensor(tmp_path):
    tg, _ = tiny_gguf("qwen2")
    del tg.tensors["blk.1.ffn_up.weight"], tg.tensors["blk.0.attn_q.bias"]
    message = _convert_error(tg, tmp_path)
    assert "missing tensors: blk.0.attn_q.bias, blk.1.ffn_up.weight" in message


def test_wrong_shape(tmp_path):
    tg, _ = tiny_gguf("qwen2")
    tg.tensors["blk.0.attn_k.weight"] = np.zeros((64, 64), dtype=np.float32)
    message = _convert_error(tg, tmp_path)
    assert "'blk.0.attn_k.weight' has shape [64, 64], the config implies [32, 64]" in message


def test_unsupported_architecture(tmp_path):
    tg, _ = tiny_gguf("qwen2")
    tg.metadata = {k.replace("qwen2.", "llama."): v for k, v in tg.metadata.items()}
    tg.metadata["general.architecture"] = "llama"
    assert "architecture 'llama' is not supported" in _convert_error(tg, tmp_path)


def test_missing_metadata_key(tmp_path):
    tg, _ = tiny_gguf("qwen2")
    del tg.metadata["qwen2.attention.head_count"]
    assert "metadata key 'qwen2.attention.head_count' is missing" in _convert_error(tg, tmp_path)


def test_unsupported_tensor_type(tmp_path, monkeypatch):
    tg, _ = tiny_gguf("qwen2")
    # gguf-py can neither quantize nor dequantize Q8_1: store raw blocks of the right byte size.
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block_size, type_size = gguf.GGML_QUANT_SIZES[q8_1]
    real_quantize = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", lambda a, t: (
        np.zeros((*a.shape[:-1], a.shape[-1] // block_size * type_size), np.uint8) if t == q8_1
        else real_quantize(a, t)))
    tg.types["blk.1.ffn_gate.weight"] = q8_1
    assert "tensor 'blk.1.ffn_gate.weight' has type Q8_1, which gguf-py cannot dequantize" in _convert_error(
        tg, tmp_path)


def test_unsupported_rope_scaling(tmp_path):
    tg, _ = tiny_gguf("qwen2")
    tg.metadata["qwen2.rope.scaling.type"] = "longrope"
    assert "rope scaling type 'longrope' is not supported" in _convert_error(tg, tmp_path)


def test_unsupported_tokenizer(tmp_path):
    tg, _ = tiny_gguf("qwen2")
    tg.metadata["tokenizer.ggml.pre"] = "llama3"
    assert "pre-tokenizer 'llama3' is not supported" in _convert_error(tg, tmp_path)


def test_existing_output_directory_is_refused(tmp_path, qwen2_converted):
    tg, _, _ = qwen2_converted
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(tg.write(tmp_path / "m.gguf"), tmp_path / "out")


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    tg, _ = tiny_gguf("qwen2")
    path = tg.write(tmp_path / "m.gguf")
    stale = tmp_path / ".out.partial-999999999-abc"  # a dead process's leftover
    stale.mkdir()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_mod, "write_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


# ---- the real default model's tokenizer (metadata only) ----------------------------------------

SAMPLES = [
    "Hello, world! It's a test.",
    "def f(x):\n    return x ** 2  # square\n\n\n\tif  y:\r\n        pass   \n",
    "    leading spaces and trailing   ",
    "你好，世界！这是一个测试。日本語のテキストも。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "digits 1234567890 3.14159 1e-6 0x1F 2024-05-24",
    "I'm, you're, they've, we'll, he'd, IT'S, She'S",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <tool_call>{\"a\": 1}</tool_call>",
    "e\u0301 café cafe\u0301 Ångström",  # NFC: decomposed input normalises like the Qwen tokenizer
    "a\n\n\n b \n  \n\t\t\n",
    "mixed English和中文 with code `x=1;` and URLs https://example.com/a?b=c&d=e",
    "",
]


@pytest.fixture(scope="module")
def real_tokenizers() -> tuple[HFTokenizer, HFTokenizer]:
    from slotserve.model_store import DEFAULT_MODEL, assemble

    return build_tokenizer(read_gguf(assemble(DEFAULT_MODEL))), HFTokenizer.from_file(str(QWEN3_TOKENIZER_JSON))


def _check_same_encoding(ours: HFTokenizer, ref: HFTokenizer, text: str) -> None:
    ids = ours.encode(text).ids
    assert ids == ref.encode(text).ids, text
    assert ours.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


@pytest.mark.real_model
def test_real_tokenizer_matches_qwen(real_tokenizers):
    ours, ref = real_tokenizers
    ref_vocab = ref.get_vocab(with_added_tokens=True)
    ours_vocab = ours.get_vocab(with_added_tokens=True)
    assert {t: i for t, i in ref_vocab.items() if i < 151665} == {t: i for t, i in ours_vocab.items() if i < 151665}
    assert json.loads(ours.to_str())["model"]["merges"] == json.loads(ref.to_str())["model"]["merges"]
    for text in SAMPLES:
        _check_same_encoding(ours, ref, text)


@pytest.mark.real_model
@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=80) | st.text(alphabet=" \t\n\r'.,:;(){}[]<>|_aA1é你🙂", max_size=80))
def test_real_tokenizer_matches_qwen_on_random_text(real_tokenizers, text):
    _check_same_encoding(*real_tokenizers, text)
