"""Weights and KV cache in transparent huge pages (host_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from slotserve import host_memory

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not host_memory.enabled(), reason="no MADV_HUGEPAGE on this platform")


def _vma_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_zeros_are_zero_aligned_and_advised():
    t = host_memory.zeros((3, 1000, 7), torch.float32, CPU)
    assert t.shape == (3, 1000, 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert not t.any()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[never]" not in thp.read_text():
        assert "hg" in _vma_flags(t.data_ptr())["VmFlags"].split()  # advised: MADV_HUGEPAGE


def test_zeros_fall_back_to_torch_when_disabled(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_HUGE_PAGES", "0")
    assert not host_memory.enabled()
    t = host_memory.zeros((4, 5), torch.bfloat16, CPU)
    assert t.dtype == torch.bfloat16 and not t.any()
    assert "hg" not in _vma_flags(t.data_ptr()).get("VmFlags", "").split()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 256)  # 4 MB: moves
        self.head = nn.Linear(256, 4096, bias=False)
        self.head.weight = self.embed.weight
        self.proj = nn.Linear(1024, 1024)  # 4 MB weight moves, its 4 KB bias stays
        self.norm = nn.LayerNorm(256)


def test_move_weights_keeps_values_and_ties():
    model = _Tied()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    small = model.proj.bias
    moved = host_memory.move_weights(model, available=1 << 40)
    assert moved == 2 * 4 * 1024 * 1024
    assert model.head.weight is model.embed.weight
    assert model.proj.bias is small
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    for p in (model.embed.weight, model.proj.weight):
        assert p.data_ptr() % 4096 == 0 and "hg" in _vma_flags(p.data_ptr())["VmFlags"].split()
    x = torch.randn(3, 1024)
    assert torch.equal(model.proj(x), x @ before["proj.weight"].T + before["proj.bias"])


def test_move_weights_stays_put_without_room():
    model = _Tied()
    where = model.proj.weight.data_ptr()
    assert host_memory.move_weights(model, available=1 << 20) == 0
    assert model.proj.weight.data_ptr() == where


def test_engine_keeps_weights_and_cache_in_huge_pages(tiny_qwen3):
    from slotserve.config import EngineConfig
    from slotserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3), kv_cache_memory=8 << 20))
    runner = engine.runner
    assert runner.k_cache.data_ptr() % host_memory.HUGE_PAGE == 0
    assert "hg" in _vma_flags(runner.v_cache.data_ptr())["VmFlags"].split()
    large = [p for p in engine.core.model.parameters() if p.nbytes >= host_memory.MIN_BYTES]
    assert engine.core.worker.weights_in_huge_pages == bool(large)
    for p in large:
        assert "hg" in _vma_flags(p.data_ptr())["VmFlags"].split()


def _mapped_file_tensor(path: Path, values: torch.Tensor) -> torch.Tensor:
    """`values` written to `path`, read back as a tensor on a memory map of it, its pages resident."""
    values.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=values.numel(), dtype=values.dtype)
    assert torch.equal(mapped, values)  # every page read
    return mapped


def test_file_pages_are_released_as_they_are_copied(tmp_path):
    values = torch.randn(3 * host_memory.COPY_CHUNK // 4 + 1000)  # several chunks and a partial one
    mapped = _mapped_file_tensor(tmp_path / "w.bin", values)
    mappings = host_memory.FileMappings.read()
    assert mappings.holds(mapped.data_ptr()) and not mappings.holds(values.data_ptr())
    assert int(_vma_flags(mapped.data_ptr())["Rss"].split()[0]) * 1024 >= mapped.nbytes - 4096
    (copy,) = host_memory.into_huge_pages([mapped], available=1 << 40)
    assert torch.equal(copy, values) and "hg" in _vma_flags(copy.data_ptr())["VmFlags"].split()
    # Only the pages at the chunks' edges stay: the file's pages are the page cache's, no longer this process's.
    assert int(_vma_flags(mapped.data_ptr())["Rss"].split()[0]) * 1024 <= 8 * 4096
    assert torch.equal(mapped, values)  # still readable: the pages fault back in


def test_anonymous_memory_is_not_released():
    values = torch.randn(1 << 20)
    before = values.clone()
    host_memory.release_pages(values, host_memory.FileMappings.read())
    assert torch.equal(values, before)


def test_anonymous_originals_the_caller_frees_count_as_room(tmp_path):
    anonymous = [torch.randn(1 << 20) for _ in range(3)]  # 4 MB each
    mapped = _mapped_file_tensor(tmp_path / "w.bin", torch.randn(1 << 20))
    room = 6 << 20  # less than the 16 MB copied, more than the file-backed 4 MB and its alignment
    assert host_memory.into_huge_pages([*anonymous, mapped], room) is None
    copies = host_memory.into_huge_pages([*anonymous, mapped], room, originals_freed=True)
    assert copies is not None and all(torch.equal(c, t) for c, t in zip(copies, [*anonymous, mapped], strict=True))
