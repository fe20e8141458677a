"""Cold page pool, BF16 recent ring, radix prefix tree, pinning and eviction."""

from kvstrata.radix.cache import StratifiedKVCache
from kvstrata.radix.config import CacheConfig
from kvstrata.radix.errors import InvariantViolation, OutOfPages, OutOfSlots, PinBudgetExceeded
from kvstrata.radix.plan import StepBatch
from kvstrata.radix.sequence import PrefixMatch, Sequence
from kvstrata.radix.stats import CacheStats, TierStats

__all__ = [
    "CacheConfig",
    "CacheStats",
    "InvariantViolation",
    "OutOfPages",
    "OutOfSlots",
    "PinBudgetExceeded",
    "PrefixMatch",
    "Sequence",
    "StepBatch",
    "StratifiedKVCache",
    "TierStats",
]
