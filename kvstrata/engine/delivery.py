"""Handing results from the engine thread to asyncio event loops once per step, not once per chunk.

``loop.call_soon_threadsafe`` writes to the loop's self-pipe: a system call that releases the GIL and
then has to win it back from the event loop thread. One per request per step (256 a step at batch
256) made the engine thread wait on the HTTP loop for most of its host time. A `LoopMailbox` collects
the chunks of every request of one loop; the engine calls `flush` at the end of each iteration, which
wakes the loop once, and the loop moves every chunk into its request's queue in one callback.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any


class LoopMailbox:
    """Chunks bound for one event loop's request queues; `put` from the engine thread, then `flush`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: `Engine` keeps its mailboxes in a WeakKeyDictionary keyed by their loops.
        self._loop = weakref.ref(loop)
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []
        self._lock = threading.Lock()
        self._armed = False  # a drain is scheduled on the loop and has not taken the items yet

    def sink(self, queue: asyncio.Queue[Any]) -> MailboxSink:
        return MailboxSink(self, queue)

    def put(self, queue: asyncio.Queue[Any], chunk: Any) -> None:
        with self._lock:
            self._items.append((queue, chunk))

    def flush(self) -> None:
        """Wake the loop once for everything put so far (engine thread; cheap when nothing is new)."""
        with self._lock:
            if self._armed or not self._items:
                return
            self._armed = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed or gone: nobody listens any more
            with self._lock:
                self._items.clear()
                self._armed = False

    def _drain(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, []
            self._armed = False
        for queue, chunk in items:
            queue.put_nowait(chunk)


class MailboxSink:
    """A request's result callback: its chunks go through ``mailbox`` into ``queue``."""

    __slots__ = ("mailbox", "queue")

    def __init__(self, mailbox: LoopMailbox, queue: asyncio.Queue[Any]) -> None:
        self.mailbox = mailbox
        self.queue = queue

    def __call__(self, chunk: Any) -> None:
        self.mailbox.put(self.queue, chunk)
