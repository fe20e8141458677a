"""Sampler: exact masks, exact penalties, seeds, validation messages."""

import math

import pytest
import torch

from kvstrata.engine.sampler import PenaltyState, Sampler, SampleRow, apply_penalties, filter_probs
from kvstrata.engine.sampling_params import SamplingParams


def _filter(probs, top_k=-1, top_p=1.0, min_p=0.0):
    p = torch.tensor([probs])
    out = filter_probs(p, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return (out[0] > 0).tolist()


def test_top_k_keeps_exactly_k():
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    assert _filter(probs, top_k=2) == [False, True, False, True, False]
    assert _filter(probs, top_k=1) == [False, True, False, False, False]
    assert _filter(probs, top_k=-1) == [True] * 5
    assert _filter(probs, top_k=10) == [True] * 5


def test_top_p_keeps_smallest_head_reaching_p():
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]  # sorted: .4 .3 .15 .1 .05
    assert _filter(probs, top_p=0.4) == [False, True, False, False, False]
    assert _filter(probs, top_p=0.41) == [False, True, False, True, False]
    assert _filter(probs, top_p=0.7) == [False, True, False, True, False]
    assert _filter(probs, top_p=0.71) == [False, True, False, True, True]
    assert _filter(probs, top_p=1.0) == [True] * 5


def test_min_p_relative_to_max():
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    assert _filter(probs, min_p=0.5) == [False, True, False, True, False]  # >= 0.2
    assert _filter(probs, min_p=0.25) == [False, True, True, True, True]  # >= 0.1
    assert _filter(probs, min_p=1.0) == [False, True, False, False, False]


def test_filters_combine_per_row():
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15], [0.2] * 5])
    out = filter_probs(probs, torch.tensor([3, 2]), torch.tensor([0.71, 1.0]), torch.tensor([0.3, 0.0]))
    assert (out > 0).tolist() == [[False, True, False, True, True], [True, True, False, False, False]]
    assert out[0, 1].item() == pytest.approx(0.4)  # not renormalised here


def _row(vocab, prompt, outputs, **params):
    p = SamplingParams.from_dict(params)
    state = PenaltyState(vocab, prompt)
    for t in outputs:
        state.add(t)
    return SampleRow(p, None, state)


def test_repetition_penalty_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    row = _row(5, [0, 1], [2], repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), [row])
    assert out[0].tolist() == [1.0, -2.0, 0.25, -3.0, 1.0]


def test_frequency_and_presence_penalties_exact():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    row = _row(4, [3], [0, 0, 1], frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), [row])
    # token 0: 1 - 2*0.5 - 0.25; token 1: 1 - 0.5 - 0.25; prompt token 3 untouched (output only)
    assert out[0].tolist() == [-0.25, 0.25, 1.0, 1.0]


def test_greedy_with_penalty_changes_argmax():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    row = _row(3, [0], [], repetition_penalty=1.5, temperature=0.0)
    assert Sampler()(logits, [row]).tokens == [1]
    plain = SampleRow(SamplingParams(temperature=0.0))
    assert Sampler()(logits, [plain]).tokens == [0]


def test_seed_reproducible_and_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    params = SamplingParams(temperature=1.0, top_p=0.9)

    def draw(seed, batch_extra):
        g = torch.Generator().manual_seed(seed)
        rows = [SampleRow(params, g)] + [SampleRow(params) for _ in range(batch_extra)]
        big = torch.cat([logits, torch.randn(batch_extra, 100)]) if batch_extra else logits
        return [Sampler()(big, rows).tokens[0] for _ in range(20)]

    a, b, c = draw(7, 0), draw(7, 3), draw(8, 0)
    assert a == b
    assert a != c


def test_sampling_respects_mask_and_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(1)
    row = SampleRow(SamplingParams(temperature=1.0, top_k=2), g)
    s = Sampler()
    counts = [0] * 4
    for _ in range(2000):
        counts[s(logits, [row]).tokens[0]] += 1
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 2000 - 0.625) < 0.04  # 0.5 / 0.8


def test_logprobs_raw_distribution_and_top_n():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    row = SampleRow(SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=2))
    out = Sampler()(logits, [row])
    lse = math.log(sum(math.exp(x) for x in [1.0, 2.0, 3.0, 0.0]))
    assert out.tokens == [2]
    assert out.token_logprobs[0] == pytest.approx(3.0 - lse, abs=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1]
    assert out.top_logprobs[0][1][1] == pytest.approx(2.0 - lse, abs=1e-6)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be -1"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0"),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
        ({"n": 0}, "n must be >= 1"),
        ({"frequency_penalty": 3}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty must be > 0"),
        ({"top_k": 2**70}, "top_k must be -1"),
        ({"stop": ["x" * 1025]}, "at most 1024 characters"),
        ({"stop": [""]}, "stop must be"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"bogus": 1}, "unknown sampling parameter"),
        ({"top_logprobs_num": 50}, "top_logprobs_num must be in"),
    ],
)
def test_validation_messages(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(params)


def test_stop_string_normalised_to_list():
    assert SamplingParams.from_dict({"stop": "END"}).stop == ["END"]
    assert SamplingParams.from_dict({"stop": None}).stop == []


def test_extreme_but_valid_parameters_never_produce_nan():
    """A temperature that underflows is greedy; a top_k beyond the vocabulary keeps everything."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.5, 0.1, 0.2, 0.3]])
    tiny = SampleRow(SamplingParams(temperature=1e-39))
    assert tiny.params.greedy
    huge_k = SampleRow(
        SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=3), torch.Generator().manual_seed(3)
    )
    out = Sampler()(logits, [tiny, huge_k])
    assert out.tokens[0] == 2
    assert 0 <= out.tokens[1] < 4
