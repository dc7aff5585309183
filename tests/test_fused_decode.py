"""The fused CPU decode step (models/fused_decode.py): which steps and models take it, and that it gives
the layer-by-layer path's exact bits and cache contents. (Its agreement with transformers is
test_model_parity's: those decode steps run fused.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from slotserve.bench.random_gguf import Arch, Shapes, write_random_gguf
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, SeqResult, Want
from slotserve.kernels import decode_layers
from slotserve.layers.linear import Linear
from slotserve.models.fused_decode import FusedDecode
from slotserve.models.gguf import convert_gguf
from slotserve.models.loader import load_model
from slotserve.multimodal.inputs import SeqVision
from slotserve.quantization.int8 import quantize_int8
from tests.gguf_fixtures import VOCAB_ROWS, tiny_gguf

pytestmark = pytest.mark.skipif(not decode_layers.available(), reason="native kernels not built here")

BLOCK = 4


def _runners(path) -> tuple[ModelRunner, ModelRunner]:
    """Two runners over two loads of one checkpoint: the first fused, the second layer by layer."""
    fused, layers = (ModelRunner(*load_model(path, torch.float32, torch.device("cpu")), num_blocks=48,
                                 block_size=BLOCK) for _ in range(2))
    assert fused.fused is not None
    layers.fused = None
    return fused, layers


def _scattered_tables(lengths: list[int], rng: random.Random) -> list[list[int]]:
    blocks = list(range(48))
    rng.shuffle(blocks)
    tables, start = [], 0
    for n in lengths:
        count = -(-n // BLOCK)
        tables.append(blocks[start:start + count])
        start += count
    return tables


def _count_fused_steps(monkeypatch) -> list[int]:
    """Counts the steps FusedDecode runs (and still runs them)."""
    calls, run = [], FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    return calls


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    """Qwen3-MoE with float32 experts (8, top-2), a dense layer between two sparse ones."""
    path = tmp_path_factory.mktemp("tiny-moe")
    tiny_gguf("qwen3moe", mixed=False, mlp_only_layers=(1,))[0].write(path / "moe.gguf")
    convert_gguf(path / "moe.gguf", path / "model")
    return path / "model"


@pytest.fixture(scope="module")
def packed_moe(tmp_path_factory) -> Path:
    """Qwen3-MoE with Q4_K and Q6_K experts, packed (the few-row kernel's), 8 of them, top-2."""
    path = tmp_path_factory.mktemp("packed-moe")
    tokenizer = tiny_gguf()[0].write(path / "tokenizer.gguf")
    write_random_gguf(path / "moe.gguf", Shapes(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2,
                                                vocab=VOCAB_ROWS, context=512, arch=Arch.QWEN3_MOE, head_dim=64,
                                                experts=8, experts_used=2, moe_intermediate=256), tokenizer)
    convert_gguf(path / "moe.gguf", path / "model")
    return path / "model"


# q/k/v bias; q/k norm and head_dim 32; mixtures of experts, float32 and packed
@pytest.mark.parametrize("arch", ["tiny_qwen2", "tiny_qwen3", "tiny_moe", "packed_moe"])
def test_decode_steps_match_the_layer_path_bitwise(arch, request, monkeypatch):
    fused, layers = _runners(request.getfixturevalue(arch))
    calls = _count_fused_steps(monkeypatch)
    rng = random.Random(0)
    vocab = fused.cfg.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in (3, 9, 17)]
    tables = _scattered_tables([len(p) + 6 for p in prompts], rng)
    for runner in (fused, layers):
        runner.execute([ScheduledSeq(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    tokens = [[7], [8], [9]]
    for step in range(6):
        seqs = [ScheduledSeq(tok, len(p) + step, t) for tok, p, t in zip(tokens, prompts, tables, strict=True)]
        if step == 3:
            seqs = seqs[1:2]  # a step of one sequence too
        a, b = fused.execute(seqs), layers.execute(seqs)
        assert all(torch.equal(x.logits, y.logits) for x, y in zip(a, b, strict=True))
        tokens = [[int(x.logits[0].argmax())] for x in a] if step != 3 else tokens
    assert len(calls) == 6  # every decode step of the first runner ran fused, none of the second's
    assert torch.equal(fused.k_cache, layers.k_cache) and torch.equal(fused.v_cache, layers.v_cache)


def test_prefill_and_mixed_steps_keep_the_layer_path(tiny_qwen2, monkeypatch):
    fused, _ = _runners(tiny_qwen2)
    calls = _count_fused_steps(monkeypatch)
    fused.execute([ScheduledSeq([5, 6, 7], 0, [0, 1])])
    fused.execute([ScheduledSeq([8], 3, [0, 1]), ScheduledSeq([5, 6], 0, [2])])  # one decode, one prefill
    assert not calls
    fused.execute([ScheduledSeq([9], 4, [0, 1]), ScheduledSeq([7], 2, [2])])  # decodes only
    assert len(calls) == 1


def test_models_it_cannot_run_keep_the_layer_path(tiny_qwen2):
    model, cfg = load_model(tiny_qwen2, torch.float32, torch.device("cpu"))
    assert ModelRunner(quantize_int8(model), cfg, num_blocks=8, block_size=BLOCK).fused is None
    model, cfg = load_model(tiny_qwen2, torch.float32, torch.device("cpu"))
    model.model.layers[1].mlp = nn.Identity()  # not a dense Qwen MLP (an MoE block, say)
    assert ModelRunner(model, cfg, num_blocks=8, block_size=BLOCK).fused is None
    assert FusedDecode.bind(nn.Linear(2, 2)) is None


def test_replaced_weights_are_bound_on_rebind(tiny_qwen2):
    fused, layers = _runners(tiny_qwen2)
    table = [3, 1]
    for runner in (fused, layers):
        runner.execute([ScheduledSeq([5, 6, 7], 0, table)])
    weight = torch.randn_like(fused.model.model.layers[1].self_attn.o_proj.weight)
    for runner in (fused, layers):
        runner.model.model.layers[1].self_attn.o_proj.weight = nn.Parameter(weight.clone())
    fused.rebind()
    a, b = fused.execute([ScheduledSeq([8], 3, table)]), layers.execute([ScheduledSeq([8], 3, table)])
    assert fused.fused.tensors[1][5] is fused.model.model.layers[1].self_attn.o_proj.weight
    assert torch.equal(a[0].logits, b[0].logits)
    # A replaced module: the kernel read its weight through the old one.
    weight = torch.randn_like(fused.model.model.layers[0].mlp.down_proj.weight)
    for runner in (fused, layers):
        mlp = runner.model.model.layers[0].mlp
        mlp.down_proj = Linear(weight.shape[1], weight.shape[0], bias=False).requires_grad_(False)
        mlp.down_proj.weight.copy_(weight)
    fused.rebind()
    a, b = fused.execute([ScheduledSeq([9], 4, table)]), layers.execute([ScheduledSeq([9], 4, table)])
    assert fused.fused.tensors[0][8] is fused.model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(a[0].logits, b[0].logits)
    # The final norm's weight, read by the kernel too (as is the embedding).
    weight = torch.rand_like(fused.model.model.norm.weight)
    for runner in (fused, layers):
        runner.model.model.norm.weight = nn.Parameter(weight.clone())
    fused.rebind()
    a, b = fused.execute([ScheduledSeq([10], 5, table)]), layers.execute([ScheduledSeq([10], 5, table)])
    assert fused.fused.final_norm is fused.model.model.norm.weight
    assert torch.equal(a[0].logits, b[0].logits)


def test_until_a_rebind_the_step_computes_with_what_it_holds(tiny_qwen2):
    """A replaced cache is written by the fused step only once it is bound; before, the step writes the cache it
    holds (the old tensor stays alive: the kernel's pointers into it stay valid)."""
    fused, _ = _runners(tiny_qwen2)
    fused.execute([ScheduledSeq([5, 6, 7], 0, [0, 1])])
    attn = fused.model.model.layers[1].self_attn.attn
    old, new = attn.k_cache, attn.k_cache.clone()
    attn.k_cache = new
    fused.execute([ScheduledSeq([8], 3, [0, 1])])
    assert not torch.equal(old, new) and fused.fused.tensors[1][9] is old
    fused.rebind()
    fused.execute([ScheduledSeq([9], 4, [0, 1])])
    assert fused.fused.tensors[1][9] is new and new[4].abs().sum() > 0 and not old[4].any()


@pytest.mark.parametrize("table, position", [([48], 3), ([-1], 3), ([0], 4), ([0], -1)])
def test_a_block_or_position_outside_the_cache_is_refused_before_any_write(tiny_qwen2, table, position):
    fused, _ = _runners(tiny_qwen2)
    fused.execute([ScheduledSeq([5, 6, 7], 0, [0])])
    before = fused.k_cache.clone()
    with pytest.raises(ValueError, match=r"block id|position"), torch.inference_mode():
        fused.fused([8], [position], [table], BLOCK)
    assert torch.equal(fused.k_cache, before)


@pytest.mark.parametrize("token", [-1, 10**9])
def test_a_token_outside_the_vocabulary_is_refused_before_any_write(tiny_qwen2, token):
    fused, _ = _runners(tiny_qwen2)
    fused.execute([ScheduledSeq([5, 6, 7], 0, [0])])
    before = fused.k_cache.clone()
    with pytest.raises(ValueError, match="token id"), torch.inference_mode():
        fused.fused([token], [3], [[0]], BLOCK)
    assert torch.equal(fused.k_cache, before)


def test_rows_asking_for_hidden_states_or_nothing_match_the_layer_path(tiny_qwen2):
    fused, layers = _runners(tiny_qwen2)
    tables, starts = [[3, 1], [0, 4], [2, 5]], [3, 2, 0]
    for runner in (fused, layers):
        runner.execute([ScheduledSeq([5, 6, 7], 0, tables[0]), ScheduledSeq([8, 9], 0, tables[1])])
    for wants in ([Want.HIDDEN, Want.LAST, Want.NONE], [Want.NONE] * 3, [Want.HIDDEN] * 3):
        seqs = [ScheduledSeq([10 + i], start, table, want=want)
                for i, (start, table, want) in enumerate(zip(starts, tables, wants, strict=True))]
        a, b = fused.execute(seqs), layers.execute(seqs)
        for x, y, want in zip(a, b, wants, strict=True):
            assert (x.logits is not None, x.tokens, x.hidden is not None) == (want is Want.LAST, None,
                                                                             want is Want.HIDDEN)
            assert all((u is None and v is None) or torch.equal(u, v) for u, v in ((x.logits, y.logits),
                                                                                  (x.hidden, y.hidden)))
        starts = [n + 1 for n in starts]
    # A hidden state handed out is the caller's: the next step does not overwrite it.
    first = fused.execute([ScheduledSeq([20], starts[0], tables[0], want=Want.HIDDEN)])[0].hidden
    kept = first.clone()
    fused.execute([ScheduledSeq([21], starts[0] + 1, tables[0], want=Want.HIDDEN)])
    assert torch.equal(first, kept)


def test_greedy_rows_get_the_argmax_of_their_logits(tiny_qwen2):
    fused, layers = _runners(tiny_qwen2)
    tables = [[3, 1], [0, 4], [2, 5]]
    for runner in (fused, layers):
        runner.execute([ScheduledSeq([5, 6, 7], 0, tables[0]), ScheduledSeq([8, 9], 0, tables[1]),
                        ScheduledSeq([4], 0, tables[2])])
    step = [([11], 3), ([12], 2), ([13], 1)]
    logits = [r.logits for r in fused.execute([ScheduledSeq(ids, start, table)
                                               for (ids, start), table in zip(step, tables, strict=True)])]
    argmax = [int(row[0].argmax()) for row in logits]
    for wants in ([Want.GREEDY] * 3, [Want.GREEDY, Want.LAST, Want.GREEDY], [Want.NONE, Want.GREEDY, Want.HIDDEN]):
        seqs = [ScheduledSeq(ids, start, table, want=want)
                for (ids, start), table, want in zip(step, tables, wants, strict=True)]  # the same step again
        for runner in (fused, layers):
            out = runner.execute(seqs)
            assert [x.tokens[0] for x, want in zip(out, wants, strict=True) if want is Want.GREEDY] == [
                a for a, want in zip(argmax, wants, strict=True) if want is Want.GREEDY]
            assert all(torch.equal(x.logits, y) for x, y, want in zip(out, logits, wants, strict=True)
                       if want is Want.LAST)
    one = fused.execute([ScheduledSeq([11], 3, tables[0], want=Want.GREEDY)])  # a step of one row
    assert one == [SeqResult(tokens=[argmax[0]])]


def test_a_head_the_kernel_cannot_run_is_applied_after_it(tiny_qwen2):
    fused, layers = _runners(tiny_qwen2)
    for runner in (fused, layers):
        runner.execute([ScheduledSeq([5, 6, 7], 0, [0, 1]), ScheduledSeq([4, 3, 2], 0, [2, 3])])
        head = runner.model.lm_head
        plain = nn.Linear(head.in_features, head.out_features, bias=False).requires_grad_(False)
        plain.weight.copy_(head.weight)
        runner.model.lm_head = plain  # torch's own Linear: not one the kernel runs
    fused.rebind()
    step = [ScheduledSeq([8], 3, [0, 1]), ScheduledSeq([9], 3, [2, 3], want=Want.GREEDY)]
    a, b = fused.execute(step), layers.execute(step)
    assert fused.fused is not None and fused.fused.head is None
    assert torch.equal(a[0].logits, b[0].logits)
    assert a[1].tokens == b[1].tokens == [int(fused.model.compute_logits(fused.fused.x[1:2]).argmax())]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    from tests.test_qwen3_vl import build_tiny_vl

    path = tmp_path_factory.mktemp("tiny-vl")
    build_tiny_vl(path)
    return path


def test_vision_language_text_decodes_fused_at_its_rope_offset(tiny_vl, monkeypatch):
    """Qwen3-VL's text tokens after an image: M-RoPE at position + offset on every axis, plain RoPE there; the
    fused step rotates by it and caches by the position, as the layer path does, to the bit."""
    fused, layers = _runners(tiny_vl)
    calls = _count_fused_steps(monkeypatch)
    prompts, offsets, tables = [[11, 12, 13, 14], [21, 22]], [-2, 5], [[0, 1, 2], [3, 4]]
    for runner in (fused, layers):  # (the offsets of the prompts' images, which these prompts lack)
        runner.execute([ScheduledSeq(p, 0, t, vision=SeqVision(None, 0, [])) for p, t in zip(prompts, tables,
                                                                                              strict=True)])
    tokens = [[7], [8]]
    for step in range(4):
        seqs = [ScheduledSeq(tok, len(p) + step, t, vision=SeqVision(None, o, []))
                for tok, p, o, t in zip(tokens, prompts, offsets, tables, strict=True)]
        a, b = fused.execute(seqs), layers.execute(seqs)
        assert all(torch.equal(x.logits, y.logits) for x, y in zip(a, b, strict=True))
        tokens = [[int(x.logits[0].argmax())] for x in a]
    assert len(calls) == 4
    assert torch.equal(fused.k_cache, layers.k_cache) and torch.equal(fused.v_cache, layers.v_cache)
