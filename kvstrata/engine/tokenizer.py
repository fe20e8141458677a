"""`LockedTokenizer`: one tokenizer shared by the engine thread, worker threads and the event loop.

A Hugging Face fast tokenizer is a Rust object behind a ``RefCell``: two threads inside it at once
(an encode that adjusts truncation or padding while another thread decodes) fail with "Already
borrowed". Every call goes through one lock; a call is short (an encode or a decode of a few ids),
so the lock costs far less than a second tokenizer per thread would.
"""

from __future__ import annotations

import functools
import threading
from typing import Any


class LockedTokenizer:
    """Proxy that serialises every method call of ``inner``; attributes read through unchanged."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lock = threading.RLock()  # re-entrant: a tokenizer method may call another one

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                return value(*args, **kwargs)

        return locked

    def __len__(self) -> int:
        with self.lock:
            return len(self.inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return self.inner(*args, **kwargs)


def thread_safe(tokenizer: Any) -> Any:
    """``tokenizer`` behind a `LockedTokenizer` (None and already locked ones pass through)."""
    if tokenizer is None or isinstance(tokenizer, LockedTokenizer):
        return tokenizer
    return LockedTokenizer(tokenizer)
