"""Exceptions of the stratified cache. Each is raised before anything changes in pool, ring or tree."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Not enough free cold pages (or sink pages) even after evicting every evictable tree leaf."""


class OutOfSlots(RuntimeError):
    """Every hot-ring slot is held by a running sequence (``max_running`` reached)."""


class PinBudgetExceeded(RuntimeError):
    """Pinning the prefix would take the pinned bytes past ``CacheConfig.pin_budget_bytes``."""


class InvariantViolation(AssertionError):
    """`check_invariants` found the cache in a state DESIGN.md forbids."""
