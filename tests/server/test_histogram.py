"""`BatchHistogram` against prometheus_client's own `Histogram` on the same values."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from kvstrata.server.histogram import BatchHistogram
from kvstrata.server.metrics import ITL_BUCKETS


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name.startswith(name) and not s.name.endswith("_created")
    }


def test_equals_prometheus_client_histogram() -> None:
    rng = random.Random(0)
    values = [rng.uniform(0, 12) ** 2 / 10 for _ in range(3000)] + list(ITL_BUCKETS) + [0.0, 0.0025]
    ours_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("x_seconds", "doc", ITL_BUCKETS, ours_reg)
    ref = Histogram("x_seconds", "doc", buckets=ITL_BUCKETS, registry=ref_reg)
    for start in range(0, len(values), 511):  # request by request, as the server observes them
        ours.observe_many(values[start : start + 511])
    ours.observe(7.5)
    for v in values + [7.5]:
        ref.observe(v)
    got, want = samples(ours_reg, "x_seconds"), samples(ref_reg, "x_seconds")
    assert got.keys() == want.keys() and len(got) == len(ITL_BUCKETS) + 1 + 2  # buckets, +Inf, count, sum
    for key, value in want.items():
        if key[0] == "x_seconds_sum":
            assert got[key] == pytest.approx(value, rel=1e-12)
        else:
            assert got[key] == value, key
    # every bound lands in its own bucket (le is inclusive), 0.0 in the first
    assert got[("x_seconds_bucket", "0.001")] == sum(v <= 0.001 for v in values)


def test_nan_is_skipped_and_empty_calls_are_harmless() -> None:
    registry = CollectorRegistry()
    h = BatchHistogram("y", "doc", (1.0, 2.0), registry)
    h.observe_many([])
    h.observe_many([math.nan, 1.5, math.inf])
    s = samples(registry, "y")
    assert s[("y_bucket", "1.0")] == 0 and s[("y_bucket", "2.0")] == 1 and s[("y_bucket", "+Inf")] == 2
    assert s[("y_count", "")] == 2 and s[("y_sum", "")] == math.inf
    with pytest.raises(ValueError, match="strictly increasing"):
        BatchHistogram("z", "doc", (2.0, 1.0), CollectorRegistry())


def test_sums_past_the_float_range_do_not_raise() -> None:
    registry = CollectorRegistry()
    h = BatchHistogram("w", "doc", (1.0,), registry)
    h.observe_many([math.inf, -math.inf])
    h.observe_many([1e308, 1e308])
    s = samples(registry, "w")
    assert s[("w_count", "")] == 4 and math.isnan(s[("w_sum", "")])


def test_describe_names_the_family() -> None:
    registry = CollectorRegistry(auto_describe=True)
    BatchHistogram("v_seconds", "doc", (1.0,), registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram("v_seconds", "doc", registry=registry)
