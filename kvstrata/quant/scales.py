"""Calibration statistics and the scales file (static clip values per layer, head and K/V).

`ScaleStats` accumulates, per layer and kind ("k"/"v"), the absmax and a log-spaced histogram of
``|x|`` per head (or per head and channel). Whoever runs the model feeds it with
``stats.observe(layer, kind, x[tokens, heads, head_dim])``; ``stats.to_scales_file(...)`` turns the
statistics into a `ScalesFile`, a versioned JSON document read back by the cache.

The percentile estimate is the upper edge of the histogram bin holding the requested rank, capped at
the absmax: never below the true percentile, at most a factor ``2 ** (1 / bins_per_octave)`` above
it (4.4% with the default 16 bins per octave). Non-finite inputs are counted and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
KINDS = ("k", "v")
METHODS = ("max", "percentile")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


@dataclass
class _Accumulator:
    absmax: torch.Tensor  # [groups] float64
    counts: torch.Tensor  # [groups, bins] int64
    nonfinite: int = 0


class ScaleStats:
    """Per-layer, per-head (optionally per-channel) absmax and histogram of K and V magnitudes."""

    def __init__(
        self,
        per_channel: bool = False,
        bins_per_octave: int = 16,
        min_exp: int = -16,
        max_exp: int = 16,
    ) -> None:
        self.per_channel = per_channel
        self.bins_per_octave = bins_per_octave
        self.min_exp = min_exp
        # bin 0: |x| < 2**min_exp (zeros included); last bin: |x| >= 2**max_exp.
        self.num_bins = (max_exp - min_exp) * bins_per_octave + 2
        self.heads: int | None = None
        self.head_dim: int | None = None
        self._acc: dict[tuple[int, str], _Accumulator] = {}

    def observe(self, layer: int, kind: str, x: torch.Tensor) -> None:
        """Add ``x`` (``[tokens, heads, head_dim]``, or any leading dims) of ``layer``'s keys or values."""
        _check_kind(kind)
        if not x.is_floating_point() or x.dim() < 3:
            raise ValueError(
                f"observe needs a float [tokens, heads, head_dim] tensor, got {x.dtype} {tuple(x.shape)}"
            )
        heads, head_dim = x.shape[-2], x.shape[-1]
        if self.heads is None:
            self.heads, self.head_dim = heads, head_dim
        elif (heads, head_dim) != (self.heads, self.head_dim):
            raise ValueError(
                f"geometry changed: first observed heads={self.heads}, head_dim={self.head_dim}, "
                f"now heads={heads}, head_dim={head_dim}"
            )
        groups = heads * head_dim if self.per_channel else heads
        acc = self._acc.get((layer, kind))
        if acc is None:
            acc = _Accumulator(
                torch.zeros(groups, dtype=torch.float64),
                torch.zeros(groups, self.num_bins, dtype=torch.int64),
            )
            self._acc[(layer, kind)] = acc
        a = x.detach().to(device="cpu", dtype=torch.float64).reshape(-1, heads, head_dim).abs()
        finite = torch.isfinite(a)
        acc.nonfinite += int(a.numel() - finite.sum())
        a = torch.where(finite, a, torch.zeros((), dtype=a.dtype))
        group = torch.arange(groups).view(heads, head_dim if self.per_channel else 1).expand(heads, head_dim)
        reduce_dims = (0,) if self.per_channel else (0, 2)
        if a.shape[0]:
            acc.absmax = torch.maximum(acc.absmax, a.amax(dim=reduce_dims).reshape(groups))
        bins = self._bin_index(a)
        flat = (group.unsqueeze(0) * self.num_bins + bins)[finite]
        # not in place: the accumulator may have been created under torch.inference_mode()
        acc.counts = acc.counts + torch.bincount(flat, minlength=groups * self.num_bins).view(
            groups, self.num_bins
        )

    def _bin_index(self, a: torch.Tensor) -> torch.Tensor:
        pos = torch.floor((torch.log2(a) - self.min_exp) * self.bins_per_octave) + 1
        pos = torch.nan_to_num(pos, nan=0.0, neginf=0.0, posinf=float(self.num_bins - 1))
        return pos.clamp(0, self.num_bins - 1).to(torch.int64)

    def _bin_upper_edge(self, index: torch.Tensor) -> torch.Tensor:
        edge = torch.pow(2.0, self.min_exp + index.to(torch.float64) / self.bins_per_octave)
        return torch.where(index == self.num_bins - 1, torch.inf, edge)  # the overflow bin: absmax caps it

    def layers(self) -> int:
        """Number of layers observed (highest layer index + 1)."""
        return 1 + max((layer for layer, _ in self._acc), default=-1)

    def nonfinite(self, layer: int, kind: str) -> int:
        return self._get(layer, kind).nonfinite

    def absmax(self, layer: int, kind: str) -> torch.Tensor:
        """Absmax ``[heads]`` or ``[heads, head_dim]`` (float32)."""
        return self._shape(self._get(layer, kind).absmax)

    def percentile(self, layer: int, kind: str, q: float) -> torch.Tensor:
        """Estimate of the ``q``-th percentile of ``|x|``, same shape as `absmax`."""
        if not 0.0 < q <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {q}")
        acc = self._get(layer, kind)
        total = acc.counts.sum(dim=1, keepdim=True)
        rank = torch.ceil(total.to(torch.float64) * (q / 100.0)).clamp(min=1)
        index = (acc.counts.cumsum(dim=1) < rank).sum(dim=1)
        estimate = torch.minimum(self._bin_upper_edge(index), acc.absmax)
        return self._shape(torch.where(total.squeeze(1) > 0, estimate, torch.zeros_like(estimate)))

    def to_scales_file(
        self,
        method: str = "max",
        percentile: float | None = 99.9,
        model_identity: str | dict[str, Any] = "",
    ) -> ScalesFile:
        """The scales file: clip = absmax (``method="max"``) or the percentile estimate."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "percentile" and percentile is None:
            raise ValueError('method="percentile" needs a percentile, e.g. 99.9')
        num_layers = self.layers()
        wanted = [(layer, kind) for layer in range(num_layers) for kind in KINDS]
        missing = [f"{layer}{kind}" for layer, kind in wanted if (layer, kind) not in self._acc]
        if num_layers == 0 or missing:
            raise ValueError(f"no statistics for layer/kind: {', '.join(missing) or 'all'}")
        absmax: dict[str, torch.Tensor] = {}
        clip: dict[str, torch.Tensor] = {}
        for kind in KINDS:
            absmax[kind] = torch.stack([self.absmax(layer, kind) for layer in range(num_layers)])
            if method == "max":
                clip[kind] = absmax[kind].clone()
            else:
                per_layer = [self.percentile(layer, kind, percentile) for layer in range(num_layers)]
                clip[kind] = torch.stack(per_layer)
        assert self.heads is not None and self.head_dim is not None
        return ScalesFile(
            num_layers=num_layers,
            kv_heads=self.heads,
            head_dim=self.head_dim,
            per_channel=self.per_channel,
            method=method,
            percentile=percentile if method == "percentile" else None,
            model=model_identity,
            absmax=absmax,
            clips=clip,
        )

    def _get(self, layer: int, kind: str) -> _Accumulator:
        _check_kind(kind)
        try:
            return self._acc[(layer, kind)]
        except KeyError:
            raise KeyError(f"no statistics observed for layer {layer}, kind {kind!r}") from None

    def _shape(self, values: torch.Tensor) -> torch.Tensor:
        assert self.heads is not None
        return values.to(torch.float32).reshape(self.heads, -1 if self.per_channel else 1).squeeze(-1)


@dataclass
class ScalesFile:
    """Static clip values per layer, head (optionally channel) and kind, with their provenance.

    ``absmax[kind]`` and ``clips[kind]`` are float32 ``[num_layers, kv_heads]`` (or
    ``[num_layers, kv_heads, head_dim]`` when ``per_channel``).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    per_channel: bool
    method: str
    percentile: float | None
    model: str | dict[str, Any]
    absmax: dict[str, torch.Tensor]
    clips: dict[str, torch.Tensor]
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.kv_heads) + ((self.head_dim,) if self.per_channel else ())
        for name, table in (("absmax", self.absmax), ("clips", self.clips)):
            if set(table) != set(KINDS):
                raise ValueError(f"{name} must have kinds {KINDS}, got {sorted(table)}")
            for kind in KINDS:
                table[kind] = torch.as_tensor(table[kind], dtype=torch.float32)
                got = tuple(table[kind].shape)
                if got != shape:
                    raise ValueError(f"{name}[{kind!r}] has shape {got}, expected {shape}")
                if not torch.isfinite(table[kind]).all() or (table[kind] < 0).any():
                    raise ValueError(f"{name}[{kind!r}] must be finite and >= 0")

    def clip(self, layer: int, kind: str) -> torch.Tensor:
        """The ``static_absmax`` for a codec: ``[kv_heads, 1]`` per head or ``[kv_heads, head_dim]``."""
        _check_kind(kind)
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for a scales file of {self.num_layers} layers")
        c = self.clips[kind][layer]
        return c if self.per_channel else c.unsqueeze(-1)

    def check_geometry(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        """Raise ``ValueError`` naming both geometries when this file does not fit the model."""
        mine = (self.num_layers, self.kv_heads, self.head_dim)
        theirs = (num_layers, kv_heads, head_dim)
        if mine != theirs:
            raise ValueError(
                "scales file does not match the model: file has (num_layers, kv_heads, head_dim) = "
                f"{mine}, model has {theirs} (model in file: {self.model!r}); re-run `kvstrata calibrate`"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "kvstrata-scales",
            "format_version": self.format_version,
            "model": self.model,
            "created": self.created,
            "method": self.method,
            "percentile": self.percentile,
            "geometry": {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim},
            "per_channel": self.per_channel,
            "absmax": {kind: self.absmax[kind].tolist() for kind in KINDS},
            "clip": {kind: self.clips[kind].tolist() for kind in KINDS},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScalesFile:
        if not isinstance(data, dict) or data.get("format") != "kvstrata-scales":
            raise ValueError("not a kvstrata scales file (missing format: kvstrata-scales)")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"unsupported scales file format_version {version!r}; this kvstrata reads {FORMAT_VERSION}"
            )
        try:
            geometry = data["geometry"]
            return cls(
                num_layers=int(geometry["num_layers"]),
                kv_heads=int(geometry["kv_heads"]),
                head_dim=int(geometry["head_dim"]),
                per_channel=bool(data["per_channel"]),
                method=str(data["method"]),
                percentile=data["percentile"],
                model=data["model"],
                absmax=dict(data["absmax"]),
                clips=dict(data["clip"]),
                created=str(data["created"]),
                format_version=version,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed scales file: missing or bad field {exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> ScalesFile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read scales file {path}: {exc}") from exc
        return cls.from_json(data)
