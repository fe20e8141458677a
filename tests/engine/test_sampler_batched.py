"""The batched sampler equals a row-by-row reference (greedy, seeded sampling with temperature,
top-k / top-p / min-p and penalties) and reads the device back once per step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvstrata.engine.sampler import PenaltyState, Sampler, SampleRow, apply_penalties, filter_probs
from kvstrata.engine.sampling_params import SamplingParams

VOCAB = 64
# Tensor methods that copy device data to the host (each a host sync on CUDA).
HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    calls: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield calls
    monkeypatch.undo()


def reference_token(logits: torch.Tensor, row: SampleRow) -> int:
    """One row alone: penalties, argmax or tempered softmax, filters, a draw from its generator."""
    x = apply_penalties(logits.float().clone().unsqueeze(0), [row])
    p = row.params
    if p.greedy:
        return int(x[0].argmax())
    probs = torch.softmax(x / p.temperature, dim=-1)
    if p.needs_filters:
        probs = filter_probs(probs, torch.tensor([p.top_k]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))
    return int(torch.multinomial(probs[0], 1, generator=row.generator)[0])


def make_rows(seed: int) -> list[SampleRow]:
    """Greedy, greedy with a penalty, and seeded rows with each filter and penalty."""
    specs = [
        {"temperature": 0.0},
        {"temperature": 0.0, "repetition_penalty": 1.7},
        {"temperature": 0.8},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 0.7, "min_p": 0.2},
        {"temperature": 1.1, "top_k": 9, "top_p": 0.9, "min_p": 0.05, "frequency_penalty": 0.4},
        {"temperature": 0.9, "presence_penalty": 0.8, "repetition_penalty": 1.2},
    ]
    rows = []
    for i, spec in enumerate(specs):
        params = SamplingParams.from_dict(spec)
        state = None
        if params.needs_penalties:
            state = PenaltyState(VOCAB, [i, i + 1, i + 2])
            for t in (i, 3, 3, 40):
                state.add(t)
        generator = None if params.greedy else torch.Generator().manual_seed(1000 * seed + i)
        rows.append(SampleRow(params, generator, state))
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_equals_row_by_row_reference(seed):
    torch.manual_seed(seed)
    logits = torch.randn(8, VOCAB) * 3
    batched = make_rows(seed)
    reference = make_rows(seed)  # fresh generators in the same states
    for _ in range(5):  # several steps: the generators advance alike
        got = Sampler()(logits, batched).tokens
        assert got == [reference_token(logits[i], row) for i, row in enumerate(reference)]


def test_unseeded_rows_beside_seeded_rows_follow_the_default_generator():
    """Unseeded rows draw together from the default generator, seeded rows from their own."""
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=1.0, top_k=7)
    seeded = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]
    rows = [SampleRow(params), SampleRow(params, seeded[0]), SampleRow(params), SampleRow(params, seeded[1])]
    torch.manual_seed(3)
    got = Sampler()(logits, rows).tokens
    torch.manual_seed(3)
    k = torch.tensor([7, 7])
    free = filter_probs(torch.softmax(logits[[0, 2]], -1), k, torch.ones(2), torch.zeros(2))
    want_free = torch.multinomial(free, 1).squeeze(1).tolist()
    ref_rows = [SampleRow(params, torch.Generator().manual_seed(s)) for s in (5, 6)]
    assert got == [
        want_free[0],
        reference_token(logits[1], ref_rows[0]),
        want_free[1],
        reference_token(logits[3], ref_rows[1]),
    ]


@pytest.mark.parametrize("case", ["greedy", "mixed", "all_sampled"])
def test_one_host_read_per_step(monkeypatch, case):
    logits = torch.randn(8, VOCAB)
    rows = make_rows(0)
    if case == "greedy":
        rows = [SampleRow(SamplingParams(temperature=0.0)) for _ in range(8)]
    elif case == "all_sampled":
        rows = [SampleRow(SamplingParams(temperature=0.9, top_p=0.8)) for _ in range(8)]
    sampler = Sampler()
    with count_host_reads(monkeypatch) as calls:
        out = sampler(logits, rows)
    assert calls == ["tolist"]
    assert out.invalid == [False] * 8


def test_invalid_rows_flagged_in_the_same_read(monkeypatch):
    logits = torch.randn(3, VOCAB)
    logits[1, 4] = float("nan")
    logits[2] = float("-inf")
    rows = [SampleRow(SamplingParams(temperature=0.0)), *make_rows(0)[2:4]]
    with count_host_reads(monkeypatch) as calls:
        out = Sampler()(logits, rows)
    assert calls == ["tolist"]
    assert out.invalid == [False, True, True]
    assert out.tokens[0] == int(logits[0].argmax())


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_batch_flags_and_tokens_as_the_definition(seed, device):
    """All-greedy rows take one max reduction: invalid exactly when a row holds a NaN or a +Inf or only
    -Inf, the first of tied maxima, token 0 for an invalid row; against the definition per row."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, VOCAB, generator=gen)
    logits[0, 7] = float("nan")
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")
    logits[3, : VOCAB // 2] = float("-inf")  # valid: finite values remain
    logits[4, 9] = logits[4, 40] = logits[4].max() + 1  # a tie: the first index wins
    logits[5, 0] = float("nan")
    logits[5, 1] = float("inf")
    logits[6, 11] = float("-inf")
    rows = [SampleRow(SamplingParams(temperature=0.0)) for _ in range(12)]
    out = Sampler()(logits.to(device), rows)
    bad = [bool(r.isnan().any() or r.isposinf().any() or r.isneginf().all()) for r in logits]
    assert out.invalid == bad == [True, True, True, False, False, True] + [False] * 6
    want = [0 if b else int(r.argmax()) for r, b in zip(logits, bad, strict=True)]
    assert out.tokens == want and out.tokens[4] == 9
