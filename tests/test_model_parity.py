"""An architecture is proven by logit parity with `transformers` on tiny random configs (fp32)."""

from __future__ import annotations

import inspect

import pytest
import torch

from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, Want
from slotserve.layers import attention
from slotserve.models import qwen
from slotserve.models.loader import load_model
from tests.conftest import build_tiny_model

TOL = 1e-4
PROMPT = [9707, 11, 1879, 0, 358, 1079, 264, 1632, 17, 151644, 77091, 198, 40, 2776]


def _runner(path, block_size=4, num_blocks=16):
    model, cfg = load_model(path, torch.float32, torch.device("cpu"))
    return ModelRunner(model, cfg, num_blocks=num_blocks, block_size=block_size)


def _cache_kwarg(hf_model) -> str:
    # transformers 5.x renamed the forward argument `past_key_values` to `cache`.
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


def _check_prefill_and_decode(hf_model, runner, block_table, steps=16, prompt=PROMPT):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf_model(ids, use_cache=True)
    ours = runner.execute([ScheduledSeq(prompt, 0, block_table, want=Want.ALL)])[0].logits
    assert (ours - ref.logits[0]).abs().max().item() <= TOL

    past, token = ref.past_key_values, int(ref.logits[0, -1].argmax())
    pos = len(prompt)
    for _ in range(steps):
        with torch.no_grad():
            ref = hf_model(torch.tensor([[token]]), use_cache=True, **{_cache_kwarg(hf_model): past})
        past = ref.past_key_values
        ours = runner.execute([ScheduledSeq([token], pos, block_table)])[0].logits
        assert (ours[0] - ref.logits[0, -1]).abs().max().item() <= TOL
        token, pos = int(ref.logits[0, -1].argmax()), pos + 1


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("qwen2", True), ("qwen3", True), ("qwen3", False)])
def test_prefill_and_decode_match_transformers(tmp_path, arch, tie):
    hf = build_tiny_model(tmp_path, arch, tie=tie)
    _check_prefill_and_decode(hf, _runner(tmp_path), block_table=list(range(8)))


def test_pieces_of_a_long_prefill_match_transformers(tmp_path, monkeypatch):
    """A prompt longer than the attention's query pieces and the MLP's row pieces (both shrunk here), and
    than a few key alignments, so a piece that saw too few keys would show."""
    monkeypatch.setattr(attention, "QUERY_PIECE", 5)
    monkeypatch.setattr(qwen, "MLP_ROWS", 7)
    hf = build_tiny_model(tmp_path, "qwen2")
    _check_prefill_and_decode(hf, _runner(tmp_path), block_table=[9, 2, 14, 5, 0, 11, 7, 3, 1, 12, 4, 6],
                              steps=4, prompt=PROMPT * 3)


def test_scattered_blocks_match_transformers(tmp_path):
    """Blocks out of order force the gather path instead of the in-place slice."""
    hf = build_tiny_model(tmp_path, "qwen3")
    _check_prefill_and_decode(hf, _runner(tmp_path), block_table=[9, 2, 14, 5, 0, 11, 7, 3])


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    hf = build_tiny_model(tmp_path, "qwen3", rope_scaling=scaling)
    _check_prefill_and_decode(hf, _runner(tmp_path), block_table=list(range(8)), steps=4)


def test_chunked_prefill_equals_one_prefill(tmp_path):
    """A prompt computed in three chunks gives the same next-token logits as in one piece."""
    build_tiny_model(tmp_path, "qwen2")
    runner = _runner(tmp_path)
    whole = runner.execute([ScheduledSeq(PROMPT, 0, list(range(4)))])[0].logits
    table = list(range(4, 8))
    runner.execute([ScheduledSeq(PROMPT[:5], 0, table, want=Want.NONE)])
    runner.execute([ScheduledSeq(PROMPT[5:9], 5, table, want=Want.NONE)])
    chunked = runner.execute([ScheduledSeq(PROMPT[9:], 9, table)])[0].logits
    assert (whole - chunked).abs().max().item() <= TOL


def test_flat_batch_equals_separate_runs(tmp_path):
    """Two sequences in one flat batch (one prefilling, one decoding) each get their solo logits."""
    build_tiny_model(tmp_path, "qwen3")
    _check_flat_batch(_runner(tmp_path))


def _check_flat_batch(runner):
    a, b = PROMPT[:9], PROMPT[3:]
    solo_a = runner.execute([ScheduledSeq(a, 0, [0, 1, 2, 3])])[0].logits
    solo_b = runner.execute([ScheduledSeq(b, 0, [4, 5, 6, 7])])[0].logits
    runner.execute([ScheduledSeq(a[:-1], 0, [8, 9, 10])])
    mixed = [r.logits for r in runner.execute([ScheduledSeq(b, 0, [11, 12, 13]),
                                                ScheduledSeq(a[-1:], len(a) - 1, [8, 9, 10])])]
    assert (mixed[0] - solo_b).abs().max().item() <= TOL
    assert (mixed[1] - solo_a).abs().max().item() <= TOL


def test_a_step_outputs_the_rows_asked_for_as_if_every_row_were(tmp_path):
    """The last layer's MLP runs only for the rows a step outputs; those rows are as with every row output."""
    build_tiny_model(tmp_path, "qwen2")
    runner = _runner(tmp_path, num_blocks=32)
    prompts = [PROMPT[:7], PROMPT[2:], PROMPT[4:10]]
    tables = [[list(range(5 * i + j, 5 * i + j + 4)) for i in range(3)] for j in (0, 16)]  # 4 blocks each
    rows = []  # what the last layer's MLP is given
    runner.model.model.layers[-1].mlp.register_forward_hook(lambda _m, args, _out: rows.append(len(args[0])))
    full = [r.logits for r in runner.execute([ScheduledSeq(p, 0, t, want=Want.ALL)
                                              for p, t in zip(prompts, tables[0], strict=True)])]
    some = [r.logits for r in runner.execute([ScheduledSeq(p, 0, t, want=want) for p, t, want in zip(
        prompts, tables[1], (Want.LAST, Want.NONE, Want.ALL), strict=True)])]
    assert rows == [7 + 12 + 6, 1 + 6] and some[1] is None
    assert some[0].shape == (1, full[0].shape[1]) and some[2].shape == full[2].shape
    assert (some[0] - full[0][-1:]).abs().max().item() <= TOL and (some[2] - full[2]).abs().max().item() <= TOL
