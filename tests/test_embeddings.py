"""Embedding models through the same engine: parity with transformers, batching, dimensions, task errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from slotserve import LLM, PoolingParams, SamplingParams
from slotserve.engine.input_processor import TaskMismatchError
from tests.conftest import QWEN_TOKENIZER_DIR, TINY

TEXTS = ["The cat sat on the mat.", "A kitten rests on a rug.", "def add(a, b): return a + b", "你好，世界",
         "Quarterly revenue rose by twelve percent."]
SMALL_CACHE = dict(kv_cache_memory=8 << 20)


def _build_qwen3_model(path):
    """A bare Qwen3Model checkpoint with sentence-transformers files, as Qwen3-Embedding ships."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    cfg = Qwen3Config(**TINY, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen3Model(cfg).eval()
    model.save_pretrained(path)
    for f in QWEN_TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    return model


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    reference = _build_qwen3_model(path)
    return LLM(str(path), **SMALL_CACHE), reference


def _reference(model, tokenizer, text, dims=None):
    ids = tokenizer.encode(text)
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden[:dims] if dims else hidden, dim=-1)


def test_qwen3_embedding_checkpoint_matches_transformers(embedder):
    llm, reference = embedder
    assert llm.engine.task == "embed"
    outs = llm.embed(TEXTS)
    for text, out in zip(TEXTS, outs, strict=True):
        expected = _reference(reference, llm.get_tokenizer(), text)
        got = torch.tensor(out.embedding)
        assert torch.nn.functional.cosine_similarity(got, expected, dim=0).item() >= 0.9999
        assert abs(got.norm().item() - 1.0) < 1e-5


def test_batched_chunked_and_alone_agree(embedder, tmp_path):
    llm, _ = embedder
    together = [o.embedding for o in llm.embed(TEXTS)]
    alone = [llm.embed(t)[0].embedding for t in TEXTS]
    assert torch.allclose(torch.tensor(together), torch.tensor(alone), atol=1e-5)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks  # no KV kept after an embedding


def test_dimensions_truncate_then_renormalise(embedder):
    llm, reference = embedder
    out = llm.embed(TEXTS[0], PoolingParams(dimensions=16))[0]
    expected = _reference(reference, llm.get_tokenizer(), TEXTS[0], dims=16)
    assert len(out.embedding) == 16
    assert torch.allclose(torch.tensor(out.embedding), expected, atol=1e-4)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=1000))
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)


def test_embedding_model_refuses_to_generate(embedder):
    llm, _ = embedder
    with pytest.raises(TaskMismatchError, match="does not generate"):
        llm.generate("hello", SamplingParams(max_tokens=2))


def test_generative_model_in_embed_mode(tiny_qwen3):
    """--task embed on a causal LM: last-token pooling of the final hidden state, normalised."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_qwen3), task="embed", **SMALL_CACHE)
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen3).model.eval()
    out = llm.embed(TEXTS[2])[0]
    expected = _reference(reference, llm.get_tokenizer(), TEXTS[2])
    assert torch.nn.functional.cosine_similarity(torch.tensor(out.embedding), expected, dim=0).item() >= 0.9999
    generator = LLM(str(tiny_qwen3), **SMALL_CACHE)
    with pytest.raises(TaskMismatchError, match="--task embed"):
        generator.embed("hello")


def test_long_input_is_prefilled_in_chunks(tiny_qwen3):
    text = " ".join(TEXTS * 6)
    whole = LLM(str(tiny_qwen3), task="embed", **SMALL_CACHE).embed(text)[0].embedding
    chunked = LLM(str(tiny_qwen3), task="embed", max_num_batched_tokens=16, **SMALL_CACHE).embed(text)[0].embedding
    assert torch.allclose(torch.tensor(whole), torch.tensor(chunked), atol=1e-5)
