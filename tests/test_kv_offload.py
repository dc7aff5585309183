"""The prefix cache's disk tier in the engine (`kv_offload_dir`): a saved or evicted prefix read back after a
restart gives the same greedy tokens as computing it, damaged files are never served, and each refusal names its
field. Tiny random qwen2 in float32; the bundled model in the real_model tier."""

from __future__ import annotations

import pytest

from slotserve import LLM, SamplingParams
from slotserve.config import EngineConfig
from slotserve.engine.protocol import KVSave
from slotserve.kv_cache import block_file
from slotserve.model_store import DEFAULT_MODEL

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CACHE = dict(kv_cache_memory=8 << 20, dtype="float32")
PROMPT = [(i * 7919) % 150000 + 100 for i in range(200)]  # 12 full blocks of 16 and 8 tokens


def _llm(model, offload=None, **extra) -> LLM:
    return LLM(str(model), **{**CACHE, **extra}, **({"kv_offload_dir": str(offload)} if offload else {}))


@pytest.fixture(scope="module")
def reference(tiny_qwen2):
    llm = _llm(tiny_qwen2)
    outs = {n: llm.generate([PROMPT[:n]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for n in (200, 120)}
    llm.shutdown()
    return outs


def _files(llm: LLM) -> list:
    return sorted(llm.engine.core.disk.dir.glob(f"*{block_file.SUFFIX}"))


def test_a_saved_prefix_restored_after_a_restart_gives_the_same_tokens(tiny_qwen2, tmp_path, reference):
    llm = _llm(tiny_qwen2, tmp_path)
    saved = llm.save_cache(PROMPT, name="system")
    assert saved.num_saved_tokens == 192 and len(_files(llm)) == 12
    assert llm.engine.core.disk.manifest("system")["token_ids"] == PROMPT
    llm.engine.kv.pool.check_whole()
    llm.shutdown()

    restarted = _llm(tiny_qwen2, tmp_path)
    out = restarted.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[200]
    assert out.num_cached_tokens == 192
    stats = restarted.engine.stats()
    assert stats.prefix_cache_disk_hit_tokens == 192 and stats.kv_disk.bytes_read > 0
    # A second time the blocks are in memory: no more reads.
    again = restarted.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference[200]
    assert restarted.engine.stats().prefix_cache_disk_hit_tokens == 192
    restarted.engine.kv.pool.check_whole()
    restarted.shutdown()


def test_evicted_blocks_come_back_from_disk(tiny_qwen2, tmp_path, reference):
    llm = _llm(tiny_qwen2, tmp_path, kv_cache_memory=256 << 10)  # 32 blocks: the next prompts evict the first
    kv = llm.engine.kv
    first = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert first == reference[200] and kv.disk.num_files == 0
    for k in range(3):
        llm.generate([[t + 1 + k for t in PROMPT]], GREEDY, use_tqdm=False)
    kv.disk.flush()
    head = kv._hashes(_seq(PROMPT), 1)[0]
    assert kv.pool.lookup(head, tuple(PROMPT[:16])) is None and kv.disk.contains(head)
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[200]
    assert llm.engine.stats().prefix_cache_disk_hit_tokens == out.num_cached_tokens > 0
    kv.pool.check_whole()
    llm.shutdown()


def test_truncated_and_flipped_files_are_removed_and_intact_ones_still_hit(tiny_qwen2, tmp_path, reference):
    llm = _llm(tiny_qwen2, tmp_path)
    llm.save_cache(PROMPT[:120])  # 7 full blocks
    order = llm.engine.kv._hashes(_seq(PROMPT[:120]), 7)
    directory = llm.engine.core.disk.dir
    llm.shutdown()
    names = [directory / block_file.file_name(h) for h in order]
    names[5].write_bytes(names[5].read_bytes()[:-9])  # truncated
    data = bytearray(names[6].read_bytes())
    data[len(data) // 3] ^= 0x01  # one bit of the payload
    names[6].write_bytes(bytes(data))

    restarted = _llm(tiny_qwen2, tmp_path)
    out = restarted.generate([PROMPT[:120]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[120]
    stats = restarted.engine.stats()
    assert stats.prefix_cache_disk_hit_tokens == 5 * 16 and stats.kv_disk.corrupt_files == 1
    assert not names[5].exists() and names[6].exists()  # the first bad file ends the hit; the next is unread
    restarted.shutdown()
    again = _llm(tiny_qwen2, tmp_path)  # the blocks recomputed above are in memory only: read the rest
    assert again.engine.core.disk.read(order[6], tuple(PROMPT[96:112])) is None
    assert not names[6].exists() and again.engine.stats().kv_disk.corrupt_files == 1
    again.shutdown()


def test_another_block_size_or_dtype_never_reads_the_files(tiny_qwen2, tmp_path):
    llm = _llm(tiny_qwen2, tmp_path)
    llm.save_cache(PROMPT)
    llm.shutdown()
    other = _llm(tiny_qwen2, tmp_path, block_size=32)
    out = other.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and other.engine.stats().kv_disk.files == 0
    other.shutdown()


def _seq(tokens: list[int]):
    from types import SimpleNamespace

    return SimpleNamespace(block_hashes=[], images=None, token_ids=lambda s, e: tokens[s:e])


def test_a_save_needs_the_disk_tier(tiny_qwen2):
    llm = _llm(tiny_qwen2)
    with pytest.raises(ValueError, match=r"^kv_save:"):
        llm.engine.add_request("r", PROMPT, SamplingParams(max_tokens=1), kv_save=KVSave("x"))
    with pytest.raises(ValueError, match=r"^kv_save:"):
        llm.save_cache(PROMPT)
    llm.engine.kv.pool.check_whole()
    llm.shutdown()


@pytest.mark.parametrize(("fields", "message"), [
    (dict(kv_offload_dir="/tmp/x", tensor_parallel_size=2), "^kv_offload_dir: not supported with tensor_parallel"),
    (dict(kv_offload_dir="/tmp/x", enable_prefix_caching=False), "^kv_offload_dir: the disk tier"),
    (dict(kv_offload_bytes=0), "^kv_offload_bytes:"),
    (dict(kv_offload_dir=""), "^kv_offload_dir: must be"),
    (dict(kv_offload_dir="/tmp/x", speculative_config={"method": "draft_model", "model": "m",
                                                        "num_speculative_tokens": 2}), "^kv_offload_dir: not sup"),
])
def test_bad_settings_name_their_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_a_bad_save_name_is_refused(tiny_qwen2, tmp_path):
    llm = _llm(tiny_qwen2, tmp_path)
    with pytest.raises(ValueError, match=r"^name:"):
        llm.save_cache(PROMPT, name="../escape")
    llm.shutdown()


@pytest.mark.real_model
def test_the_bundled_model_restores_a_chat_prefix_token_for_token(tmp_path):
    params = SamplingParams(temperature=0, max_tokens=24)
    system = ("You are a careful senior Python reviewer. Answer briefly and cite the line you mean. " * 12).strip()
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "What does `x or []` do?"}]
    plain = LLM(DEFAULT_MODEL, kv_cache_memory=256 << 20)
    want = plain.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    prefix = plain.render_chat(chat[:1], add_generation_prompt=False)
    plain.shutdown()
    llm = LLM(DEFAULT_MODEL, kv_cache_memory=256 << 20, kv_offload_dir=str(tmp_path))
    assert llm.save_cache(prefix, name="reviewer").num_saved_tokens > 64
    llm.shutdown()
    restored = LLM(DEFAULT_MODEL, kv_cache_memory=256 << 20, kv_offload_dir=str(tmp_path))
    out = restored.chat(chat, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    assert restored.engine.stats().prefix_cache_disk_hit_tokens > 64
    restored.shutdown()
