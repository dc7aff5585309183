import dataclasses

import pytest

from slotserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_valid_edges_are_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01,
                   logit_bias={0: -100, 5: 100.0}, logprobs=0, prompt_logprobs=20, max_tokens=None,
                   min_tokens=1000, seed=0, top_k=1)
    SamplingParams(max_tokens=5, min_tokens=5)


def test_is_a_plain_serialisable_dataclass():
    p = SamplingParams(stop="x", logit_bias={3: 1.5}, seed=4)
    assert SamplingParams(**dataclasses.asdict(p)) == p


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, ">= 1"),
        ("n", 1.0, "int"),
        ("n", True, "int"),
        ("temperature", -1, ">= 0"),
        ("temperature", float("nan"), "finite"),
        ("temperature", float("inf"), "finite"),
        ("temperature", "1", "number"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_k", -2, ">= -1"),
        ("top_k", 2.0, "int"),
        ("min_p", -0.1, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("seed", 1.5, "int"),
        ("seed", 2**64, "in ["),
        ("presence_penalty", 2.1, "[-2, 2]"),
        ("presence_penalty", -2.1, "[-2, 2]"),
        ("frequency_penalty", 3, "[-2, 2]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("logit_bias", [1, 2], "dict"),
        ("logit_bias", {"12": 1.0}, "int token ids"),
        ("logit_bias", {-1: 1.0}, "int token ids"),
        ("logit_bias", {True: 1.0}, "int token ids"),
        ("logit_bias", {1: 100.5}, "[-100, 100]"),
        ("logit_bias", {1: "big"}, "number"),
        ("stop", "", "non-empty"),
        ("stop", ["ok", ""], "non-empty"),
        ("stop", 5, "string"),
        ("stop", ["a", 1], "string"),
        ("stop_token_ids", [1, -1], "token ids"),
        ("stop_token_ids", 7, "list"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", 1.5, "int"),
        ("min_tokens", -1, ">= 0"),
        ("min_tokens", 17, "<= max_tokens"),
        ("ignore_eos", 1, "bool"),
        ("skip_special_tokens", "yes", "bool"),
        ("include_stop_str_in_output", None, "bool"),
        ("logprobs", -1, "[0, 20]"),
        ("logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", 1.0, "int"),
    ],
)
def test_invalid_values_name_the_field(field, value, message):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    text = str(exc.value)
    assert text.startswith(field), text
    assert message in text, text
