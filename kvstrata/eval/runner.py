"""Teacher forcing through the real stratified cache, every configuration in lockstep.

Each window is fed to every configuration's ``StratifiedKVCache`` in chunks of ``page_size`` tokens,
exactly as serving stores and reads them: new K/V go to the ring, a page is quantized once into a
cold page when it completes, and attention reads cold pages plus the BF16 ring.

Why chunks of ``page_size``: with the ring invariant ``ring_start = floor((L - W) / P) * P``, the token
at offset i of a page-aligned chunk sees exactly the ``W + i`` most recent tokens in BF16 and
everything older from cold pages, which is what it would see if it were generated one token at a time
in decode. A longer chunk would let its tokens attend to each other unquantized (prefill), which is
kinder than decode; a shorter one only costs time.

The configurations advance together chunk by chunk, so the reference's log-probs for a chunk are
computed once and every other configuration is scored against them at once: no window of
vocabulary-sized logits is ever kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.eval.configs import REFERENCE, EvalConfig
from kvstrata.eval.stats import WindowScore, log_probs, merge, score_batch

Progress = Callable[[int], None]  # called with the number of (config, window) chunk-steps just done


def cache_config_for(model: Any, cfg: EvalConfig, page_size: int, context: int, width: int = 1) -> Any:
    from kvstrata.radix import CacheConfig

    mc = model.config
    unquantized = cfg.kv_cache_dtype in (REFERENCE, "fp32")
    return CacheConfig(
        num_layers=mc.num_layers,
        kv_heads=mc.kv_heads,
        head_dim=mc.head_dim,
        page_size=page_size,
        recent_window=cfg.recent_window,
        layer_codecs=cfg.codecs(mc.num_layers),
        ring_dtype=torch.float32 if unquantized else torch.bfloat16,
        num_pages=width * (context // page_size + 2),
        max_running=width,
        sinks=cfg.sinks,
        rotation=cfg.rotation,
        device=str(model.net.device),
    )


class CacheRunner:
    """One configuration's cache, fed ``width`` windows side by side (one ring slot each)."""

    def __init__(self, model: Any, cfg: EvalConfig, page_size: int, context: int, width: int) -> None:
        from kvstrata.radix import StratifiedKVCache

        self.config = cfg
        self.scale = model.config.head_dim**-0.5
        self.key_centers = None
        if cfg.key_centers is not None:
            self.key_centers = cfg.key_centers.to(device=model.net.device, dtype=model.net.dtype)
        self.cache = StratifiedKVCache(cache_config_for(model, cfg, page_size, context, width))
        self.seqs: list[Any] = []
        self.batch: Any = None

    def start(self, windows: Sequence[list[int]]) -> None:
        self.seqs = [self.cache.admit(list(w)) for w in windows]
        cached = [s.length for s in self.seqs if s.length]
        if cached:
            raise RuntimeError(f"{self.config.label}: a window matched {cached[0]} cached tokens")

    def begin(self, n_new: int) -> None:
        self.batch = self.cache.begin_step(self.seqs, [n_new] * len(self.seqs))

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.key_centers is not None:
            k = k - self.key_centers[layer]
        return self.cache.attention(layer, self.batch, q, k, v, self.scale)

    def end(self) -> None:
        self.cache.end_step(self.batch)
        self.batch = None

    def finish(self) -> None:
        for seq in self.seqs:
            self.cache.finish(seq, insert=False)
        self.seqs = []


def lockstep_attention(runners: Sequence[CacheRunner], rows: int) -> Callable[..., torch.Tensor]:
    """One attention callback for a forward whose rows are ``rows`` tokens per runner, in order."""

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [
            r.attention(
                layer,
                q[i * rows : (i + 1) * rows],
                k[i * rows : (i + 1) * rows],
                v[i * rows : (i + 1) * rows],
            )
            for i, r in enumerate(runners)
        ]
        return torch.cat(outs)

    return attn


@dataclass
class DenseCheck:
    """The unquantized cache path against ``dense_forward`` on the first window."""

    max_abs_logit_diff: float
    max_abs_logit: float
    nll_rel_diff: float  # |mean NLL(cache) - mean NLL(dense)| / mean NLL(dense)

    def to_json(self) -> dict[str, float]:
        return {
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "max_abs_logit": self.max_abs_logit,
            "nll_rel_diff": self.nll_rel_diff,
        }


def group_width(num_configs: int, num_windows: int, page_size: int, rows_per_step: int) -> int:
    """Windows each cache runs side by side so one forward has at most ~``rows_per_step`` rows,
    balanced so that the last group is not a straggler."""
    widest = max(1, min(num_windows, rows_per_step // (num_configs * page_size)))
    groups = -(-num_windows // widest)
    return -(-num_windows // groups)


@torch.inference_mode()
def evaluate(
    model: Any,
    windows: Sequence[list[int]],
    configs: Sequence[EvalConfig],
    page_size: int,
    progress: Progress | None = None,
    dense_check: bool = True,
    rows_per_step: int = 1024,
) -> tuple[dict[EvalConfig, list[WindowScore]], DenseCheck | None]:
    """Per-window scores of every configuration against the reference (``configs[0]`` = auto).

    Every configuration runs ``width`` windows side by side in its own cache, and one forward pass
    carries all of them: rows are [config 0: window 0 chunk, window 1 chunk, ...], [config 1: ...].
    The model's rows never interact outside attention, and attention is routed per configuration.
    """
    if not configs or configs[0].kv_cache_dtype != REFERENCE:
        raise ValueError("the first configuration must be the reference (auto)")
    context = len(windows[0])
    device = model.net.device
    width = group_width(len(configs), len(windows), page_size, rows_per_step)
    runners = [CacheRunner(model, cfg, page_size, context, width) for cfg in configs]
    scores: dict[EvalConfig, list[WindowScore]] = {cfg: [] for cfg in configs}
    check: DenseCheck | None = None
    for g in range(0, len(windows), width):
        group = list(windows[g : g + width])
        ids = torch.tensor(group, dtype=torch.long, device=device)  # [B, context]
        dense = model.net.dense_forward(ids[:1])[0] if dense_check and g == 0 else None
        diffs: list[float] = []
        parts: dict[EvalConfig, list[list[WindowScore]]] = {cfg: [[] for _ in group] for cfg in configs}
        for r in runners:
            r.start(group)
        for start in range(0, context, page_size):
            end = min(start + page_size, context)
            n, n_scored = end - start, min(end, context - 1) - start  # the last token predicts nothing
            chunk = ids[:, start:end].reshape(-1)
            rows = chunk.shape[0]
            positions = torch.arange(start, end, device=device).repeat(len(group))
            for r in runners:
                r.begin(n)
            logits = model.net(
                chunk.repeat(len(runners)),
                positions.repeat(len(runners)),
                attn=lockstep_attention(runners, rows),
            ).view(len(runners), len(group), n, -1)
            for r in runners:
                r.end()
            if dense is not None:
                diffs.append(float((logits[0, 0] - dense[start:end]).abs().max()))
            tgt = ids[:, start + 1 : start + 1 + n_scored]
            nll, ref_nll, kl, top1 = (t.tolist() for t in score_batch(logits[:, :, :n_scored], tgt))
            for i, cfg in enumerate(configs):
                for b in range(len(group)):
                    parts[cfg][b].append(
                        WindowScore(n_scored, nll[i][b], ref_nll[b], kl[i][b], int(top1[i][b]))
                    )
            if progress is not None:
                progress(len(runners) * len(group))
        for r in runners:
            r.finish()
        for cfg in configs:
            scores[cfg].extend(merge(p) for p in parts[cfg])
        if dense is not None:
            targets = ids[0, 1:]
            dense_nll = -log_probs(dense[:-1]).gather(-1, targets[:, None]).sum().item()
            ref_nll = scores[configs[0]][0].ref_nll
            check = DenseCheck(
                max_abs_logit_diff=max(diffs),
                max_abs_logit=float(dense.abs().max()),
                nll_rel_diff=abs(ref_nll - dense_nll) / abs(dense_nll),
            )
    return scores, check


def bytes_per_token(model: Any, cfg: EvalConfig, page_size: int) -> tuple[float, int]:
    """(cold bytes per token of history over all layers, K+V, scales included; ring bytes per sequence)."""
    from kvstrata.radix.pool import cold_page_bytes

    mc = model.config
    cold = cold_page_bytes(cfg.codecs(mc.num_layers), page_size, mc.kv_heads, mc.head_dim)
    ring_elem = 4 if cfg.kv_cache_dtype in (REFERENCE, "fp32") else 2
    ring = 2 * mc.num_layers * (cfg.recent_window + page_size) * mc.kv_heads * mc.head_dim * ring_elem
    return cold / page_size, ring
