"""`RequestRows`: the ``ReqToTokenPool`` row of every running request, by request id, on the host.

A step's plan needs each entry's request row on the host (`step.RingBook` is indexed by row), but
SGLang gives a decode step its rows only as the device tensor ``req_pool_indices``: reading it waits
for every earlier GPU operation, every step, which undoes SGLang's overlap of the next batch's host
work with this batch's forward. So rows come from host data instead. Every extend step (a request's
prefill, each chunk, the re-prefill after a retraction) records ``rid -> row`` from SGLang's host
mirror ``req_pool_indices_cpu`` (SGLang 0.5.23; 0.5.17 has none, so its extend steps copy the row
tensor to the host, as they also do for their page tables), and decode steps map
``forward_batch.rids`` through it (a decode-graph replay's view of the batch gets the rids from
`replay_view_hook`).

A mapping that cannot be right raises `StaleRequestRows` rather than attending over another
request's ring: a request no extend step recorded, a row allocated again since it was recorded (its
generation moved on), two entries on one row. `assert_rows_on_device` also enqueues a device-side
check that the planned rows are SGLang's own: it does not wait, and a mismatch stops the process
with a device-side assertion.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstrata.integrations.sglang.step import PADDING_ROW

REPLAY_VIEW_TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.build_replay_fb_view"


class StaleRequestRows(RuntimeError):
    """A decode entry whose request row is unknown or no longer the request's."""


class RequestRows:
    def __init__(self, req_to_token_pool) -> None:
        self.req_to_token_pool = req_to_token_pool
        rows = req_to_token_pool.req_generation.numel()
        self.row_of: dict[str, int] = {}
        self.owner: list[str | None] = [None] * rows
        self.recorded = np.full(rows, -1, dtype=np.int64)  # each row's generation when recorded

    def _generation(self) -> np.ndarray:
        """SGLang's host tensor of row generations (read each time: never a stale copy)."""
        return self.req_to_token_pool.req_generation.numpy()

    def record(self, rids: Sequence[str], rows: Sequence[int]) -> None:
        """An extend step's requests hold these rows. A row taken by another request drops the
        previous request's entry, so the map never holds more entries than there are rows."""
        for rid, row in zip(rids, rows, strict=True):
            previous_owner = self.owner[row]
            if previous_owner not in (None, rid) and self.row_of.get(previous_owner) == row:
                del self.row_of[previous_owner]
            previous_row = self.row_of.get(rid)
            if previous_row is not None and previous_row != row and self.owner[previous_row] == rid:
                self.owner[previous_row] = None  # re-prefilled on a new row after a retraction
            self.row_of[rid] = row
            self.owner[row] = rid
        index = np.asarray(rows, dtype=np.int64)
        self.recorded[index] = self._generation()[index]

    def rows_of(self, rids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(rows, generations) of a decode step's requests, as int64 host arrays; `StaleRequestRows`
        when a mapping is missing or stale."""
        try:
            rows = np.fromiter((self.row_of[rid] for rid in rids), dtype=np.int64, count=len(rids))
        except KeyError as exc:
            raise StaleRequestRows(
                f"kvstrata attention: request {exc.args[0]!r} decodes, but no extend step of this "
                "server recorded its request row (requests must be prefilled here: kvstrata does not "
                "support prefill-decode disaggregation or speculative decoding)"
            ) from None
        generation = self._generation()[rows]
        stale = np.flatnonzero(generation != self.recorded[rows])
        if stale.size:
            i = int(stale[0])
            raise StaleRequestRows(
                f"kvstrata attention: request {rids[i]!r} decodes on request row {int(rows[i])}, which "
                f"was allocated again since its extend step (generation {int(self.recorded[rows[i]])} "
                f"then, {int(generation[i])} now)"
            )
        if np.unique(rows).size != rows.size:
            rows_named = rows.tolist()
            raise StaleRequestRows(f"kvstrata attention: two decode entries on one request row: {rows_named}")
        return rows, generation


def host_rows(forward_batch) -> list[int]:
    """An extend step's request rows on the host: SGLang's host mirror where it has one (0.5.23);
    0.5.17 has none, so this copies the row tensor (its extend steps also read page tables)."""
    rows = getattr(forward_batch, "req_pool_indices_cpu", None)
    if rows is None:
        rows = forward_batch.req_pool_indices.cpu()
    return rows.tolist()


def padded_rows(requests: RequestRows, rids: Sequence[str] | None, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, generations) of a decode batch of ``bs`` entries, the first ``len(rids)`` of them
    requests and the rest padding (`PADDING_ROW`, as SGLang pads a graph replay)."""
    if rids is None:
        raise StaleRequestRows(
            "kvstrata attention: the decode batch carries no request ids (forward_batch.rids), so its "
            "request rows are unknown on the host; a graph replay gets them from the hook on "
            + REPLAY_VIEW_TARGET
        )
    if len(rids) > bs:
        raise ValueError(f"kvstrata attention: {len(rids)} requests in a decode batch of {bs} entries")
    rows, generation = requests.rows_of(rids)
    pad = np.full(bs - len(rids), PADDING_ROW, dtype=np.int64)
    return np.concatenate([rows, pad]), np.concatenate([generation, np.zeros_like(pad)])


def assert_rows_on_device(planned: torch.Tensor, actual: torch.Tensor) -> None:
    """Enqueue the check that every planned row other than padding equals SGLang's row (device
    tensors of one length; no host wait, and it can be recorded in a CUDA graph)."""
    same = (planned == actual) | (planned == PADDING_ROW)
    torch._assert_async(same.all(), "kvstrata attention: host-planned request rows differ from SGLang's")


def replay_view_hook(view, *args, **kwargs):
    """AFTER hook on SGLang's ``build_replay_fb_view``: the replay view of a decode batch also
    carries the batch's request ids (the view SGLang builds has only device rows)."""
    forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else args[0]
    view.rids = getattr(forward_batch, "rids", None)
    return view
