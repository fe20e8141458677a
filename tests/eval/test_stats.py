"""The lab's statistics on synthetic data: perplexity, paired drift, bootstrap CI, KL, top-1."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvstrata.eval.stats import WindowScore, bootstrap_drift_ci, drift_pct, merge, score_window, summarize


def test_identical_logits_score_zero_drift_kl_and_full_agreement() -> None:
    torch.manual_seed(0)
    logits = torch.randn(50, 32)
    targets = torch.randint(0, 32, (50,))
    s = score_window(logits, logits.clone(), targets)
    assert s.count == 50
    assert s.nll == pytest.approx(s.ref_nll, abs=1e-12)
    assert s.kl == pytest.approx(0.0, abs=1e-12)
    assert s.top1 == 50


def test_score_window_matches_hand_computation() -> None:
    ref = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    q = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    targets = torch.tensor([1, 0])
    s = score_window(ref, q, targets)
    ref_nll = math.log(2) + math.log(1 + math.exp(-2))
    q_nll = math.log(1 + math.e) + math.log(1 + math.exp(2))
    assert s.ref_nll == pytest.approx(ref_nll, rel=1e-12)
    assert s.nll == pytest.approx(q_nll, rel=1e-12)
    p = torch.softmax(ref.double(), -1)
    kl = (p * (torch.log_softmax(ref.double(), -1) - torch.log_softmax(q.double(), -1))).sum().item()
    assert s.kl == pytest.approx(kl, rel=1e-12)
    # row 0 is a tie in the reference: argmax picks index 0, as does q; row 1 disagrees
    assert s.top1 == 1


def test_summary_perplexity_and_drift() -> None:
    scores = [
        WindowScore(count=100, nll=100 * math.log(10.1), ref_nll=100 * math.log(10.0), kl=1.0, top1=95)
    ] * 4
    s = summarize(scores, resamples=200)
    assert s.perplexity == pytest.approx(10.1, rel=1e-9)
    assert s.ref_perplexity == pytest.approx(10.0, rel=1e-9)
    assert s.drift_pct == pytest.approx(1.0, rel=1e-9)
    assert s.kl == pytest.approx(0.01)
    assert s.top1_agreement == pytest.approx(0.95)
    # identical windows: every resample gives the same drift
    assert s.drift_ci95[0] == pytest.approx(1.0, rel=1e-9)
    assert s.drift_ci95[1] == pytest.approx(1.0, rel=1e-9)


def test_paired_bootstrap_is_narrow_when_windows_differ_but_drift_is_constant() -> None:
    """Per-window perplexity varies 3x, drift per window is a constant +0.2%: paired CI stays tight."""
    rng = np.random.default_rng(1)
    scores = []
    for _ in range(32):
        ref = 1000 * rng.uniform(1.5, 3.0)
        scores.append(WindowScore(1000, nll=ref + 1000 * math.log1p(0.002), ref_nll=ref, kl=0.0, top1=1000))
    lo, hi = bootstrap_drift_ci(scores, resamples=500)
    assert lo == pytest.approx(0.2, abs=1e-9)
    assert hi == pytest.approx(0.2, abs=1e-9)


def test_bootstrap_interval_covers_the_true_drift_on_noisy_windows() -> None:
    """Window drifts ~ N(0.1%, 0.5%): the 95% interval contains 0.1 and has the expected width."""
    rng = np.random.default_rng(2)
    n, count = 64, 512
    per_window = rng.normal(0.1, 0.5, n)
    scores = [
        WindowScore(
            count, nll=2.0 * count + count * math.log1p(d / 100), ref_nll=2.0 * count, kl=0.0, top1=count
        )
        for d in per_window
    ]
    lo, hi = bootstrap_drift_ci(scores, resamples=4000, seed=3)
    mean = float(np.mean(per_window))
    assert lo < mean < hi
    assert lo < 0.1 < hi
    expected_half_width = 1.96 * 0.5 / math.sqrt(n)  # ~0.1225
    assert (hi - lo) / 2 == pytest.approx(expected_half_width, rel=0.2)
    total = merge(scores)
    assert drift_pct(total.nll, total.ref_nll, total.count) == pytest.approx(mean, abs=0.005)


def test_score_window_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        score_window(torch.zeros(3, 5), torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="no windows"):
        bootstrap_drift_ci([])


def test_score_batch_matches_score_window() -> None:
    from kvstrata.eval.stats import score_batch

    torch.manual_seed(4)
    logits = torch.randn(3, 2, 7, 40) * 3
    targets = torch.randint(0, 40, (2, 7))
    nll, ref_nll, kl, top1 = score_batch(logits, targets)
    for c in range(3):
        for b in range(2):
            s = score_window(logits[0, b], logits[c, b], targets[b])
            assert nll[c, b].item() == pytest.approx(s.nll, rel=1e-12)
            assert ref_nll[b].item() == pytest.approx(s.ref_nll, rel=1e-12)
            assert kl[c, b].item() == pytest.approx(s.kl, rel=1e-9, abs=1e-15)
            assert int(top1[c, b]) == s.top1
    assert kl[0].abs().max().item() == 0.0 and int(top1[0].min()) == 7


def test_group_width_balances_groups() -> None:
    from kvstrata.eval.runner import group_width

    assert group_width(33, 32, 16, 16384) == 16  # 31 fit; two groups of 16, not 31 + 1
    assert group_width(4, 8, 16, 1024) == 8
    assert group_width(100, 5, 16, 1024) == 1
