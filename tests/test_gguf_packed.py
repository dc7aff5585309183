"""A converted GGUF runs on the packings its file holds (no float32 copy): tiny synthetic GGUFs from random
`transformers` models, loaded by slotserve, against transformers on the same dequantized weights; prefill in
float32 within float32 rounding, in bfloat16 within bfloat16's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slotserve import host_memory
from slotserve.config import ModelConfig, PrefillPrecision
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, Want
from slotserve.layers.embedding import VocabEmbedding
from slotserve.layers.linear import Linear
from slotserve.models.gguf import convert_gguf
from slotserve.models.loader import (
    build_meta_model,
    checkpoint_dtypes,
    load_model,
    packed_sizes,
    weight_files,
    weight_footprint,
)
from slotserve.models.packing import move_packings
from slotserve.quantization import packed_linear
from slotserve.quantization.packed_linear import PANEL_ROWS
from tests.gguf_fixtures import hf_model_of, tiny_gguf
from tests.test_host_memory import _vma_flags

pytestmark = pytest.mark.skipif(not packed_linear.built(), reason="native kernels not built here")

# Every linear and the embedding in an integer-block type, each merged weight's parts in different ones.
PACKED = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q5_0, "attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q5_0,
          "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q4_1, "ffn_gate.weight": Q.Q8_0,
          "ffn_up.weight": Q.Q5_1, "ffn_down.weight": Q.Q5_0}
IDS = [(i * 37 + 5) % 280 for i in range(PANEL_ROWS + 16)]


def _converted(tmp_path: Path, arch: str, tie: bool, packed: bool) -> tuple[Path, torch.nn.Module]:
    """A converted tiny GGUF (every linear in PACKED's types, or the fixtures' mix of float and integer types,
    a merged weight's parts then partly float) and transformers' model on its dequantized weights."""
    tg, _ = tiny_gguf(arch, tie=tie)
    if packed:
        tg.types = {name: qtype for name in tg.tensors for suffix, qtype in PACKED.items() if name.endswith(suffix)}
    out = tmp_path / "out"
    convert_gguf(tg.write(tmp_path / "m.gguf"), out)
    return out, hf_model_of(out)


def _runner(out: Path, prefill: PrefillPrecision) -> ModelRunner:
    model, cfg = load_model(out, torch.float32, torch.device("cpu"))
    return ModelRunner(model, cfg, num_blocks=64, block_size=4, prefill=prefill)


def _reference(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "mixed"])
@pytest.mark.parametrize(("arch", "tie"), [("qwen2", False), ("qwen3", True), ("qwen3moe", False)])
def test_a_gguf_runs_on_its_packings_with_transformers_logits(tmp_path, arch, tie, packed):
    out, reference = _converted(tmp_path, arch, tie, packed)
    runner = _runner(out, PrefillPrecision.FLOAT32)
    # qwen3moe's experts and router are not in PACKED's types (the fixtures keep them in float32).
    linears = {name: m for name, m in runner.model.named_modules()
               if isinstance(m, Linear) and ".experts." not in name and not name.endswith("mlp.gate")}
    held = [m for m in linears.values() if m.weight is None]
    embedding = next(m for m in runner.model.modules() if isinstance(m, VocabEmbedding))
    if packed:
        assert len(held) == len(linears) and embedding.packed is not None
        assert runner.packing_report.held == len(held)
        assert {m.packed.bits for m in held} == {4, 5, 8}  # Q4_0/Q4_1 in nibbles, Q5_0 with a fifth bit
    else:  # BF16 q, BF16 up: the merged q/k/v and gate/up take float32 weights
        merged = [m for name, m in linears.items() if name.endswith(("qkv_proj", "gate_up_proj"))]
        assert merged and all(m.weight is not None for m in merged)
    expected = _reference(reference, IDS)
    blocks = list(range(len(IDS) // 4 + 1))
    for rows in (16, len(IDS)):  # the few-row / AMX kernels, then float32 panels
        ours = runner.execute([ScheduledSeq(IDS[:rows], 0, blocks, want=Want.ALL)])[0].logits
        torch.testing.assert_close(ours, expected[:rows], atol=1e-4, rtol=1e-4)
    for pos in range(16, 20):  # decode steps on the cache of the first 16
        ours = runner.execute([ScheduledSeq(IDS[pos:pos + 1], pos, blocks)])[0].logits
        torch.testing.assert_close(ours[0], expected[pos], atol=1e-4, rtol=1e-4)


def test_a_bfloat16_prefill_is_within_bfloat16_rounding(tmp_path):
    out, reference = _converted(tmp_path, "qwen2", False, packed=True)
    expected = _reference(reference, IDS)
    logits = {}
    for prefill in (PrefillPrecision.FLOAT32, PrefillPrecision.BFLOAT16):
        runner = _runner(out, prefill)
        logits[prefill] = runner.execute([ScheduledSeq(IDS, 0, list(range(len(IDS) // 4 + 1)), want=Want.ALL)])[0]
    exact = (logits[PrefillPrecision.FLOAT32].logits - expected).abs().max().item()
    rounded = (logits[PrefillPrecision.BFLOAT16].logits - expected).abs().max().item()
    scale = expected.abs().max().item()
    # bfloat16 keeps 8 bits: errors of a few 2^-8 of the logits' size, far above float32's.
    assert exact < 1e-4 < rounded < 2**-4 * scale


@pytest.mark.skipif(not host_memory.enabled(), reason="no MADV_HUGEPAGE on this platform")
def test_packings_move_into_huge_pages_with_the_same_logits(tmp_path):
    out, _ = _converted(tmp_path, "qwen3", True, packed=True)
    model, cfg = load_model(out, torch.float32, torch.device("cpu"))
    blocks = list(range(len(IDS) // 4 + 1))
    logits = []
    for move in (False, True):  # the engine moves them before it builds the runner
        if move:
            held = {id(m.packed): m.packed for m in model.modules() if isinstance(m, Linear) and m.weight is None}
            assert move_packings(model, available=1 << 40) == sum(p.nbytes for p in held.values())
        runner = ModelRunner(model, cfg, num_blocks=64, block_size=4)
        logits.append(runner.execute([ScheduledSeq(IDS[:16], 0, blocks, want=Want.ALL)])[0].logits)
    for m in model.modules():
        if isinstance(m, Linear) and m.weight is None:
            assert "hg" in _vma_flags(m.packed.values.data_ptr())["VmFlags"].split()
    embedding = next(m for m in model.modules() if isinstance(m, VocabEmbedding))
    assert embedding.packed is model.lm_head.packed  # tied: the head and the embedding share the moved packing
    assert torch.equal(*logits)


def test_the_memory_check_counts_a_gguf_by_its_packings(tmp_path):
    out, _ = _converted(tmp_path, "qwen2", False, packed=True)
    files = weight_files(out)
    need = weight_footprint(build_meta_model(ModelConfig.from_dir(out)), torch.float32, torch.device("cpu"),
                            checkpoint_dtypes(files), packed_sizes(files))
    model, _ = load_model(out, torch.float32, torch.device("cpu"))
    packings = {id(m.packed): m.packed for m in model.modules() if getattr(m, "packed", None) is not None}
    merged = [m.packed.nbytes for name, m in model.named_modules() if name.endswith(("qkv_proj", "gate_up_proj"))]
    floats = sum(p.nbytes for p in model.parameters())
    loaded = floats + sum(p.nbytes for p in packings.values())
    # Stacked parts take the widest form among them (gate's Q8_0 gains up's Q5_1 offsets): a little more.
    assert 0.97 * loaded <= need.mapped + need.copied <= loaded
    assert 0.95 * sum(merged) <= need.copied <= sum(merged) + floats
