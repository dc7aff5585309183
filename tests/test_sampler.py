import math

import pytest
import torch

from slotserve.layers.sampler import Sampler, SamplingState, process_logits, prompt_logprobs
from slotserve.sampling_params import SamplingParams

V = 32
EOS = 0
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def state(prompt=(1, 2, 3), vocab=V, device="cpu", **kw) -> SamplingState:
    return SamplingState.new(SamplingParams(**kw), list(prompt), [EOS], vocab, device)


def logits_from_probs(*probs: float, vocab: int = V) -> torch.Tensor:
    """One row whose softmax puts `probs` on ids 1.. and (almost) nothing anywhere else."""
    row = torch.full((vocab,), -1e4)
    row[1:len(probs) + 1] = torch.log(torch.tensor(probs))
    return row


def support(row: torch.Tensor, draws: int = 400, device="cpu", **kw) -> set[int]:
    states = [state(seed=i, device=device, **kw) for i in range(draws)]
    return set(Sampler()(row.to(device).expand(draws, -1), states).token_ids)


# ---- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    out = Sampler()(logits, [state(temperature=0) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_tiny_temperature_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, V) * 3
    # 1e-6 takes the greedy path; 1e-3 samples, but from a distribution that is one-hot in float32.
    for t in (1e-6, 1e-3):
        assert Sampler()(logits, [state(temperature=t, seed=i) for i in range(16)]).token_ids == \
            logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(16, V)
    logits[3, 5] = logits[3, 9] = 10.0  # a tie: both paths take the lower id
    out = Sampler()(logits, [state(top_k=1, seed=i) for i in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_sampler_leaves_logits_untouched():
    logits = torch.randn(2, V)
    before = logits.clone()
    Sampler()(logits, [state(repetition_penalty=1.5, logit_bias={4: 3.0}, min_tokens=2), state(top_p=0.5, seed=1)])
    assert torch.equal(logits, before)


# ---- restricting the support ----------------------------------------------------------------------


def test_unrestricted_sampling_covers_the_distribution():
    row = logits_from_probs(0.5, 0.3, 0.15, 0.05)
    tokens = Sampler()(row.expand(4000, -1), [state(seed=i) for i in range(4000)]).token_ids
    freq = [tokens.count(t) / len(tokens) for t in (1, 2, 3, 4)]
    for got, want in zip(freq, (0.5, 0.3, 0.15, 0.05), strict=True):
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / len(tokens))


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_keeps_the_smallest_set_reaching_p(device):
    row = logits_from_probs(0.5, 0.3, 0.15, 0.05)
    assert support(row, top_p=0.7, device=device) == {1, 2}
    assert support(row, top_p=0.45, device=device) == {1}
    assert support(row, top_p=0.85, device=device) == {1, 2, 3}


def test_top_k_keeps_k_tokens():
    row = logits_from_probs(0.5, 0.3, 0.15, 0.05)
    assert support(row, top_k=2) == {1, 2}
    assert support(row, top_k=3) == {1, 2, 3}


def test_wide_nucleus_grows_the_candidate_set():
    # 1000 equal logits: top_p=0.5 keeps 500 of them, well over the first candidates looked at.
    states = [state(vocab=1000, seed=i, top_p=0.5) for i in range(3000)]
    tokens = Sampler()(torch.zeros(3000, 1000), states).token_ids
    assert 450 < len(set(tokens)) <= 501


def test_top_k_then_top_p_over_the_renormalised_top_k():
    # top_k=2 leaves 0.5/0.3 -> 0.625/0.375; top_p=0.6 then keeps only the first.
    row = logits_from_probs(0.5, 0.3, 0.15, 0.05)
    assert support(row, top_k=2, top_p=0.6) == {1}
    assert support(row, top_p=0.6) == {1, 2}


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_drops_tokens_below_a_fraction_of_the_top(device):
    row = logits_from_probs(0.5, 0.3, 0.15, 0.05)
    assert support(row, min_p=0.2, device=device) == {1, 2, 3}  # threshold 0.1
    assert support(row, min_p=0.5, device=device) == {1, 2}  # threshold 0.25


def test_temperature_is_applied_before_min_p():
    # At temperature 2 the probabilities flatten to about 0.37/0.29/0.20/0.14 (of the top: 1/.77/.55/.32).
    row = logits_from_probs(0.5, 0.3, 0.15, 0.05)
    assert support(row, min_p=0.5, temperature=2.0) == {1, 2, 3}


# ---- per-request generators -----------------------------------------------------------------------


def run(states_factory, steps: int, target: int, device: str = "cpu") -> list[int]:
    """Sample `steps` tokens for a batch; return the tokens of row `target`."""
    torch.manual_seed(123)  # the logits; never the draws
    states = states_factory()
    got = []
    for _ in range(steps):
        logits = torch.randn(len(states), V).to(device)
        logits[target] = torch.linspace(0, 2, V)
        out = Sampler()(logits, states)
        for s, t in zip(states, out.token_ids, strict=True):
            s.append(t)
        got.append(out.token_ids[target])
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [{"top_p": 0.9}, {"presence_penalty": 1.0}])
def test_seeded_row_is_independent_of_the_batch(device, kind):
    def seeded():
        return state(seed=42, device=device, **kind)

    def other(**kw):
        return state(device=device, **kw)

    alone = run(lambda: [seeded()], 20, 0, device)
    first = run(lambda: [seeded(), other(), other(temperature=0), other(seed=7, top_k=3)], 20, 0, device)
    last = run(lambda: [other(min_p=0.1), other(seed=1, repetition_penalty=1.2), other(temperature=0), seeded()],
               20, 3, device)
    assert alone == first == last
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_rows_differ():
    row = torch.zeros(1, 1000)
    draws = {Sampler()(row, [state(vocab=1000)]).token_ids[0] for _ in range(5)}
    assert len(draws) > 1


# ---- penalties, bias, masks -----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_and_bias_exact_values(device):
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, -0.5, 3.0]], device=device)
    s = SamplingState.new(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={5: -1.0}),
        prompt_token_ids=[1], eos_token_ids=[0], vocab_size=6, device=device,
    )
    for t in (2, 2, 3):
        s.append(t)
    out = process_logits(logits, [s])[0].tolist()
    # id 0: untouched; 1: prompt only -> repetition 2/2; 2: output x2 -> -1*2 - 0.5*2 - 0.25;
    # 3: output x1 -> 0.5/2 - 0.5 - 0.25; 4: unseen; 5: bias only.
    assert out == pytest.approx([1.0, 1.0, -2.0 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, -0.5, 2.0])


def test_penalty_bookkeeping_grows():
    s = SamplingState.new(SamplingParams(frequency_penalty=1.0), [], [0], 500)
    for t in [*range(300), 7, 7]:
        s.append(t)
    out = process_logits(torch.zeros(1, 500), [s])[0]
    want = torch.tensor([-1.0] * 300 + [0.0] * 200)
    want[7] = -3.0
    assert torch.equal(out, want)


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(6)
    logits = torch.randn(6, V)
    states = [state(temperature=0), state(seed=1), state(temperature=0), state(seed=2, top_k=3),
              state(temperature=0), state(seed=3, min_p=0.2)]
    out = Sampler()(logits, states).token_ids
    assert [out[i] for i in (0, 2, 4)] == [int(logits[i].argmax()) for i in (0, 2, 4)]
    assert all(0 <= t < V for t in out)


def test_penalties_are_per_row():
    logits = torch.zeros(2, 4) + 1.0
    a = SamplingState.new(SamplingParams(presence_penalty=1.0), [], [0], 4)
    b = SamplingState.new(SamplingParams(), [], [0], 4)
    a.append(2)
    b.append(2)
    out = process_logits(logits, [a, b])
    assert out.tolist() == [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_logit_bias_can_force_a_token():
    logits = torch.randn(1, V)
    assert Sampler()(logits, [state(temperature=0, logit_bias={17: 100})]).token_ids == [17]


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 9], logits[0, 5] = 10.0, 9.0, 8.0
    s = state(temperature=0, min_tokens=2, stop_token_ids=[9])
    for want in (5, 5, EOS):
        (token,) = Sampler()(logits, [s]).token_ids
        assert token == want
        s.append(token)


def test_ignore_eos_does_not_mask_eos():
    # As in vLLM: the engine keeps going after EOS, but the sampler still sees the model's distribution.
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    assert Sampler()(logits, [state(temperature=0, ignore_eos=True)]).token_ids == [EOS]
    s = state(temperature=0, ignore_eos=True, min_tokens=1)
    assert Sampler()(logits, [s]).token_ids != [EOS]


def test_bias_does_not_unban_a_token():
    logits = torch.zeros(1, V)
    s = state(temperature=0, min_tokens=1, logit_bias={EOS: 100})
    assert Sampler()(logits, [s]).token_ids != [EOS]


def test_out_of_vocab_ids_are_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        state(logit_bias={V: 1.0})
    with pytest.raises(ValueError, match="stop_token_ids"):
        state(stop_token_ids=[V + 3])


# ---- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_of_the_raw_distribution(device):
    torch.manual_seed(3)
    logits = torch.randn(3, V).to(device)
    states = [state(temperature=0, logprobs=3, presence_penalty=2.0, prompt=(), device=device),
              state(seed=5, logprobs=0, top_k=4, device=device),
              state(temperature=0, device=device)]
    states[0].append(int(logits[0].argmax()))  # penalised now, but logprobs stay raw
    out = Sampler()(logits, states)
    raw = torch.log_softmax(logits, -1).cpu()
    assert out.logprobs[2] is None
    for row in (0, 1):
        entry = out.logprobs[row]
        token = out.token_ids[row]
        assert next(iter(entry)) == token  # the sampled token comes first
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(raw[row, t].item())
            assert lp.rank == 1 + int((raw[row] > raw[row, t]).sum())
    assert len(out.logprobs[1]) == 1
    top3 = raw[0].topk(3).indices.tolist()
    assert set(out.logprobs[0]) == {out.token_ids[0], *top3}
    assert out.token_ids[0] != top3[0]  # the presence penalty moved the greedy pick
    assert len(out.logprobs[0]) in (3, 4)


def test_logprob_ranks_share_ties():
    logits = torch.zeros(1, V)
    logits[0, 4] = logits[0, 7] = 5.0
    logits[0, 2] = 3.0
    entry = Sampler()(logits, [state(temperature=0, logprobs=3)]).logprobs[0]
    assert {t: lp.rank for t, lp in entry.items()} == {4: 1, 7: 1, 2: 3}


def test_prompt_logprobs_alignment():
    torch.manual_seed(4)
    prompt = [5, 9, 2, 30]
    logits = torch.randn(len(prompt), V)
    out = prompt_logprobs(logits, prompt, 2)
    raw = torch.log_softmax(logits, -1)
    assert len(out) == len(prompt) and out[0] is None
    for i in range(1, len(prompt)):
        entry = out[i]
        assert next(iter(entry)) == prompt[i]
        assert entry[prompt[i]].logprob == pytest.approx(raw[i - 1, prompt[i]].item())
        assert entry[prompt[i]].rank == 1 + int((raw[i - 1] > raw[i - 1, prompt[i]]).sum())
        assert set(entry) == {prompt[i], *raw[i - 1].topk(2).indices.tolist()}
    assert prompt_logprobs(logits[:-1], prompt, 0) == [None] + [{t: out[i][t]} for i, t in enumerate(prompt) if i]
    with pytest.raises(ValueError, match="logits"):
        prompt_logprobs(logits[:2], prompt, 1)


def test_prompt_logprobs_over_several_chunks():
    torch.manual_seed(5)
    prompt = torch.randint(0, V, (600,)).tolist()
    logits = torch.randn(600, V)
    out = prompt_logprobs(logits, prompt, 1)
    raw = torch.log_softmax(logits, -1)
    assert len(out) == 600
    assert out[599][prompt[599]].logprob == pytest.approx(raw[598, prompt[599]].item())
    assert out[300][prompt[300]].logprob == pytest.approx(raw[299, prompt[300]].item())


@pytest.mark.parametrize("kw, takes", [
    ({"temperature": 0.0}, True),
    ({"temperature": 1.0}, False),
    ({"temperature": 0.0, "logprobs": 1}, False),
    ({"temperature": 0.0, "logit_bias": {3: 1.0}}, False),
    ({"temperature": 0.0, "repetition_penalty": 1.2}, False),
    ({"temperature": 0.0, "presence_penalty": 0.5}, False),
])
def test_only_unprocessed_greedy_rows_take_the_raw_argmax(kw, takes):
    """The runner may pick these rows' tokens itself (ScheduledSeq "greedy"): the sampler would take the
    argmax of the logits as they come."""
    assert state(**kw).takes_argmax() is takes


def test_a_greedy_row_under_min_tokens_takes_the_argmax_once_eos_is_allowed():
    s = state(temperature=0.0, min_tokens=2)
    assert not s.takes_argmax()  # EOS is banned until then
    s.append(5)
    s.append(6)
    assert s.takes_argmax()
