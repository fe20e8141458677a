"""`BatchHistogram`: a Prometheus histogram that takes a request's values in one call.

A finished request carries one inter-token gap per generated token (511 for a 512-token answer).
`prometheus_client.Histogram.observe` takes a lock and walks the buckets for each value, about
0.33 ms for 511 values on the CI machine's CPU: when a batch of 256 requests ends in one step (a
benchmark's last step), that is 84 ms on the engine thread before their last chunks go out (1,024
requests: a third of a second). Here the values of one call are bucketed by `numpy.searchsorted`
and added once. The exposition is prometheus_client's ``_bucket`` samples (cumulative, ``le`` as it
writes them), ``_count`` and ``_sum`` (the sum of a call's values is taken with `math.fsum`, so it can
differ from one-by-one float additions in the last bits), without the ``_created`` series.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BatchHistogram(Collector):
    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"buckets must be strictly increasing: {buckets}")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name, self.documentation = name, documentation
        self.bounds = np.asarray(bounds)
        self._counts = np.zeros(len(bounds), dtype=np.int64)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Iterable[float]) -> None:
        """Add every value: one bucket search and one locked update for the whole call. A value
        equal to a bound counts in that bound's bucket (Prometheus ``le``); NaN is skipped (it
        belongs to no bucket, and would make the sum NaN for good)."""
        array = np.fromiter(values, dtype=np.float64)
        array = array[~np.isnan(array)]
        if not array.size:
            return
        counts = np.bincount(np.searchsorted(self.bounds, array, side="left"), minlength=len(self.bounds))
        try:
            total = math.fsum(array.tolist())
        except (ValueError, OverflowError):  # inf - inf, or a sum past the float range: as numpy sums
            with np.errstate(all="ignore"):
                total = float(array.sum())
        with self._lock:
            self._counts += counts
            self._sum += total

    def describe(self) -> Iterator[Metric]:
        """The family's name and type without values (a registry that describes its collectors
        finds duplicate names by this)."""
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        family = HistogramMetricFamily(self.name, self.documentation)
        les = [floatToGoString(b) for b in self.bounds.tolist()]
        family.add_metric([], [(le, float(c)) for le, c in zip(les, cumulative, strict=True)], total)
        yield family
