"""`build_step` index tensors against a per-token reference: the ring rows of each group, where completed
pages gather their tokens, which ring rows take the new tokens, and the kernels' lengths, for random
mixes of decode steps, prefill chunks (crossing the ring's wrap), sinks and window sizes. The plan is
built from ``range`` runs and tensor operations over all sequences; the reference walks every token."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvstrata.radix.plan import NullRows, build_step, ring_start_after, upload
from kvstrata.radix.sequence import Sequence

NULLS = NullRows(page=999, sink=77, ring_row=5555)


def random_step(rnd: random.Random, P: int, W: int):
    seqs, n_new, new_pages, next_page = [], [], [], 0
    for i in range(rnd.randint(1, 10)):
        L = rnd.randint(0, 120)
        n = rnd.choice([1, 1, rnd.randint(1, 70)])
        cached = rnd.randint(0, L) // P * P if rnd.random() < 0.3 else 0
        ring_start = max(cached, (L - W) // P * P) if L else 0
        pages = list(range(next_page, next_page + (L + n) // P))
        next_page += len(pages)
        seq = Sequence(i, [0] * (L + n), None, i, cached, L, ring_start, page_ids=pages)
        seqs.append(seq)
        n_new.append(n)
        new_pages.append(pages[L // P :])
    return seqs, n_new, new_pages


def reference_writes(seqs, n_new, P: int, R: int, W: int, sink_of):
    """Per-token lists: (page ids, from ring (page rows, ring rows), from new (page rows, k/v rows),
    sink page indices, sink slots, ring destination rows, their k/v rows)."""
    out = {k: [] for k in ("pages", "fr_rows", "fr_ring", "fn_rows", "fn_src", "sk", "slots", "dst", "src")}
    off = 0
    for seq, n in zip(seqs, n_new, strict=True):
        L, base = seq.length, seq.slot * R
        first, last = L // P, (L + n) // P
        if last > first:
            row0 = len(out["pages"]) * P - first * P
            if first == 0 and sink_of is not None:
                out["sk"].append(len(out["pages"]))
                out["slots"].append(sink_of[seq.page_ids[0]])
            out["pages"] += seq.page_ids[first:last]
            for p in range(first * P, L):
                out["fr_rows"].append(row0 + p)
                out["fr_ring"].append(base + p % R)
            for p in range(L, last * P):
                out["fn_rows"].append(row0 + p)
                out["fn_src"].append(off + p - L)
        for p in range(max(L, ring_start_after(seq, L + n, W, P)), L + n):
            out["dst"].append(base + p % R)
            out["src"].append(off + p - L)
        off += n
    return out


@pytest.mark.parametrize("seed", range(6))
def test_plan_tensors_equal_per_token_reference(seed):
    rnd = random.Random(seed)
    for _ in range(40):
        P = rnd.choice([4, 16])
        W = rnd.choice([0, P, 4 * P])
        R = W + P
        seqs, n_new, new_pages = random_step(rnd, P, W)
        sink_of = {s.page_ids[0]: 100 + s.slot for s in seqs if s.page_ids} if rnd.random() < 0.5 else None
        step = build_step(
            seqs,
            n_new,
            new_pages,
            page_size=P,
            ring_capacity=R,
            window=W,
            sink_of=sink_of,
            nulls=NULLS,
            device=torch.device("cpu"),
        )
        ref = reference_writes(seqs, n_new, P, R, W, sink_of)
        w = step.write
        got = {
            "pages": w.page_ids,
            "fr_rows": w.from_ring[0],
            "fr_ring": w.from_ring[1],
            "fn_rows": w.from_new[0],
            "fn_src": w.from_new[1],
            "sk": w.sink_pages,
            "slots": w.sink_slots,
            "dst": w.ring_dst,
            "src": w.ring_src,
        }
        for key, tensor in got.items():
            assert tensor.dtype == torch.long and tensor.tolist() == ref[key], key
        assert sum(g.batch * g.tokens for g in step.groups) == step.num_tokens == sum(n_new)
        # groups: the maximal runs of adjacent sequences with equal new-token counts, each one slice
        assert all(a.tokens != b.tokens for a, b in itertools.pairwise(step.groups))
        first = at = 0
        for g in step.groups:
            group_seqs = seqs[first : first + g.batch]
            assert n_new[first : first + g.batch] == [g.tokens] * g.batch
            if len(step.groups) == 1:
                assert g.rows is None and g.span is None
            else:
                assert g.span == (at, at + g.batch * g.tokens)
                assert g.rows.tolist() == list(range(*g.span))
            first, at = first + g.batch, at + g.batch * g.tokens
            width = g.ring_rows.shape[1]
            for row, seq in zip(g.ring_rows.tolist(), group_seqs, strict=True):
                real = [seq.slot * R + p % R for p in range(seq.ring_start, seq.length)]
                assert row == real + [NULLS.ring_row] * (width - len(real))
            flags = [int(v) for v in g.sink_valid]
            assert g.kernel_lengths.dtype == torch.int32
            assert g.kernel_lengths.tolist() == [g.cold_pages, g.ring_len, flags]


def test_upload_keeps_host_tensors_on_the_cpu():
    parts = [torch.arange(6).view(2, 3), torch.zeros(0, dtype=torch.long), torch.tensor([7])]
    assert all(a is b for a, b in zip(upload(parts, torch.device("cpu")), parts, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_upload_to_cuda_in_one_buffer():
    parts = [torch.arange(6).view(2, 3), torch.zeros(0, dtype=torch.long), torch.tensor([7])]
    moved = upload(parts, torch.device("cuda"))
    assert all(torch.equal(m.cpu(), p) and m.shape == p.shape for m, p in zip(moved, parts, strict=True))
    assert moved[0].untyped_storage().data_ptr() == moved[2].untyped_storage().data_ptr()
