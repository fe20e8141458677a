"""Scores of one window against the reference, and their paired aggregation.

Everything here is plain tensor/NumPy arithmetic so that it can be tested on synthetic data:
- ``score_window`` turns the reference and quantized next-token logits of one window into sums
  (NLL both ways, KL(reference || quantized), top-1 agreement);
- ``summarize`` aggregates windows into perplexity, drift in percent, a paired bootstrap 95% interval
  of the drift (windows resampled with replacement, the same resample for both sides), mean KL and
  top-1 agreement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class WindowScore:
    """Sums over the scored positions of one window (each position predicts the next token)."""

    count: int
    nll: float  # sum of -log p(target) under this configuration
    ref_nll: float  # the same under the reference
    kl: float  # sum of KL(reference || this configuration) over positions
    top1: int  # positions whose argmax agrees with the reference's


@dataclass(frozen=True)
class Summary:
    tokens: int
    perplexity: float
    ref_perplexity: float
    drift_pct: float
    drift_ci95: tuple[float, float]
    kl: float
    top1_agreement: float


def score_window(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> WindowScore:
    """Score ``logits`` [T, V] against ``ref_logits`` [T, V] for next tokens ``targets`` [T]."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"shape mismatch: ref {tuple(ref_logits.shape)}, logits {tuple(logits.shape)}")
    return score_logprobs(log_probs(ref_logits), logits, targets)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Float64 log-softmax over the vocabulary (computed once for the reference, reused per config)."""
    return torch.log_softmax(logits.double(), dim=-1)


def score_logprobs(ref_lp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> WindowScore:
    """Like ``score_window`` with the reference given as log-probs ``ref_lp`` [T, V] (``log_probs``)."""
    if ref_lp.shape != logits.shape or logits.shape[0] != targets.shape[0]:
        raise ValueError(
            f"shape mismatch: ref {tuple(ref_lp.shape)}, logits {tuple(logits.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    lp = log_probs(logits)
    idx = targets.long().unsqueeze(-1)
    nll = -lp.gather(-1, idx).sum().item()
    ref_nll = -ref_lp.gather(-1, idx).sum().item()
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0.0).sum().item()
    top1 = int((ref_lp.argmax(-1) == lp.argmax(-1)).sum().item())
    return WindowScore(count=int(targets.shape[0]), nll=nll, ref_nll=ref_nll, kl=kl, top1=top1)


def score_batch(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Vectorized scores of ``logits`` [C, B, T, V] against row 0 (the reference) for ``targets`` [B, T].

    Returns float64/int64 tensors ``(nll [C, B], ref_nll [B], kl [C, B], top1 [C, B])`` summed over T.
    """
    ref_lp = log_probs(logits[0])  # [B, T, V]
    ref_p = ref_lp.exp()
    ref_top = ref_lp.argmax(-1)
    idx = targets.long().unsqueeze(-1)
    ref_nll = -ref_lp.gather(-1, idx).squeeze(-1).sum(-1)
    nll, kl, top1 = [], [], []
    for c in range(logits.shape[0]):  # one config at a time bounds the float64 temporaries
        lp = log_probs(logits[c])
        nll.append(-lp.gather(-1, idx).squeeze(-1).sum(-1))
        kl.append((ref_p * (ref_lp - lp)).sum(-1).clamp_min(0.0).sum(-1))
        top1.append((lp.argmax(-1) == ref_top).sum(-1))
    return torch.stack(nll), ref_nll, torch.stack(kl), torch.stack(top1)


def merge(scores: Sequence[WindowScore]) -> WindowScore:
    """Sum of several scores (e.g. the chunks of one window)."""
    return WindowScore(
        count=sum(s.count for s in scores),
        nll=sum(s.nll for s in scores),
        ref_nll=sum(s.ref_nll for s in scores),
        kl=sum(s.kl for s in scores),
        top1=sum(s.top1 for s in scores),
    )


def drift_pct(nll: float, ref_nll: float, count: int) -> float:
    """Perplexity drift in percent: (ppl / ref_ppl - 1) * 100 on the same ``count`` tokens."""
    return float(np.expm1((nll - ref_nll) / count) * 100.0)


def bootstrap_drift_ci(
    scores: Sequence[WindowScore], resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Paired bootstrap interval of the drift: resample windows, both sides with the same draw."""
    if not scores:
        raise ValueError("no windows to bootstrap")
    counts = np.array([s.count for s in scores], dtype=np.float64)
    diff = np.array([s.nll - s.ref_nll for s in scores], dtype=np.float64)
    rng = np.random.default_rng(seed)
    n = len(scores)
    weights = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)
    drifts = np.expm1((weights @ diff) / (weights @ counts)) * 100.0
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(drifts, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def summarize(scores: Sequence[WindowScore], resamples: int = 2000, seed: int = 0) -> Summary:
    """Aggregate per-window scores of one configuration (paired with the reference)."""
    total = merge(scores)
    if total.count == 0:
        raise ValueError("no scored tokens")
    return Summary(
        tokens=total.count,
        perplexity=float(np.exp(total.nll / total.count)),
        ref_perplexity=float(np.exp(total.ref_nll / total.count)),
        drift_pct=drift_pct(total.nll, total.ref_nll, total.count),
        drift_ci95=bootstrap_drift_ci(scores, resamples=resamples, seed=seed),
        kl=total.kl / total.count,
        top1_agreement=total.top1 / total.count,
    )
