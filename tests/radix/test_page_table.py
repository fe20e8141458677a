"""`SlotPageTable`: after any sequence of admissions, decode and prefill steps (ended or cancelled),
prefix insertions (which swap private pages for the tree's copies), finishes and evictions, the page
tables and ring rows a step gathers on the device equal the ones `build_step` builds from the lists."""

from __future__ import annotations

import contextlib

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstrata.radix.errors import OutOfPages, OutOfSlots
from kvstrata.radix.page_table import SlotPageTable
from kvstrata.radix.plan import build_step
from tests.radix.radix_helpers import small_cache

OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "step", "step", "step", "prefix", "finish", "evict"]), st.integers(0, 99)
    ),
    min_size=1,
    max_size=40,
)


def rebuilt(cache, batch):
    """The plan of the same step built from the sequences' lists (no table)."""
    return build_step(
        batch.seqs,
        batch.n_new,
        batch.new_pages,
        page_size=cache.page_size,
        ring_capacity=cache.ring.capacity,
        window=cache.recent_window,
        sink_of=cache.sinks.of_page if cache.sinks is not None else None,
        nulls=cache.nulls,
        device=cache.device,
    )


def assert_same_plan(got, ref) -> None:
    assert len(got.groups) == len(ref.groups)
    for g, r in zip(got.groups, ref.groups, strict=True):
        assert g.device_index is not None and r.device_index is None
        assert torch.equal(g.page_table, r.page_table)
        assert torch.equal(g.ring_rows, r.ring_rows)
        assert torch.equal(g.lengths, r.lengths)
        assert g.cold_pages == r.cold_pages and g.ring_len == r.ring_len
        assert (g.sink_table is None) == (r.sink_table is None)
        if g.sink_table is not None:
            assert torch.equal(g.sink_table, r.sink_table)
    for name in ("page_ids", "ring_dst", "ring_src"):
        assert torch.equal(getattr(got.write, name), getattr(ref.write, name))


@settings(max_examples=60, deadline=None)
@given(ops=OPS, sinks=st.booleans(), window=st.sampled_from([0, 4, 8]), shared=st.booleans())
# a cancelled step cuts a page that the next step replaces by another at the same entry
@example(ops=[("admit", 0), ("admit", 0), ("step", 68), ("step", 0), ("step", 1), ("step", 0)], sinks=False,
         window=0, shared=False)  # fmt: skip
def test_gathered_tables_equal_rebuild(ops, sinks, window, shared) -> None:
    cache = small_cache(sinks=sinks, recent_window=window, num_pages=40, max_running=4)
    cache.page_tables = SlotPageTable(cache.ring.slots.total, cache.nulls.page, cache.device, width=1)
    running = []
    steps = 0
    for kind, arg in ops:
        if kind == "admit":
            # shared: prompts share a prefix, so inserts swap private pages for the tree's copies
            prompt = [1 + (i if shared else arg * 7 + i) % 50 for i in range(5 + arg % 23)]
            with contextlib.suppress(OutOfSlots):
                running.append(cache.admit(prompt))
        elif kind == "step" and running:
            seqs = [s for s in running if s.length < len(s.token_ids)] or running[:1]
            for s in seqs:
                if s.length == len(s.token_ids):
                    s.token_ids.append(arg % 50 + 1)
            n_new = [min(len(s.token_ids) - s.length, 1 + arg % 6) for s in seqs]
            try:
                batch = cache.begin_step(seqs, n_new)
            except OutOfPages:
                continue
            assert_same_plan(batch, rebuilt(cache, batch))
            steps += 1
            if arg % 5 == 0:
                cache.cancel_step(batch)
                for s in [s for s in running if s.ring_clobbered]:  # a clobbered ring cannot go on
                    cache.finish(s)
                    running.remove(s)
            else:
                batch.layers_done.update(range(cache.cfg.num_layers))
                cache.end_step(batch)
        elif kind == "prefix" and running:
            cache.cache_prefix(running[arg % len(running)])
        elif kind == "finish" and running:
            cache.finish(running.pop(arg % len(running)), insert=arg % 2 == 0)
        elif kind == "evict":
            cache.evict(1 + arg % 4)
    for seq in running:
        cache.finish(seq)
    cache.check_invariants()


def test_table_grows_and_keeps_rows() -> None:
    table = SlotPageTable(3, null_page=9, device=torch.device("cpu"), width=2)
    cache = small_cache(num_pages=40, max_running=3)
    seq = cache.admit(list(range(1, 30)))
    seq.page_ids = [4, 5, 6, 7, 8]
    table.apply(table.sync([seq]))
    assert table.width == 8
    slots = torch.tensor([seq.slot])
    got = table.gather(slots, torch.tensor([1]), torch.tensor([3]), 5)
    assert got.tolist() == [[5, 6, 7, 9, 9]]
    seq.page_ids[1:3] = [20, 21]  # swapped in place, as cache_prefix does
    table.invalidate(seq, 1)
    table.apply(table.sync([seq]))
    assert table.gather(slots, torch.tensor([0]), torch.tensor([5]), 5).tolist() == [[4, 20, 21, 7, 8]]


@given(sinks=st.booleans(), prompt_len=st.integers(9, 30))
@settings(max_examples=10, deadline=None)
def test_prefix_insert_swaps_pages_in_the_table(sinks, prompt_len) -> None:
    """Two equal prompts computed side by side: inserting the second hands its private pages back and
    it reads the tree's copies; the next steps' tables hold the tree's pages."""
    cache = small_cache(sinks=sinks, recent_window=4, num_pages=40, max_running=4)
    cache.page_tables = SlotPageTable(cache.ring.slots.total, cache.nulls.page, cache.device, width=1)
    prompt = [1 + i % 11 for i in range(prompt_len)]
    seqs = [cache.admit(list(prompt)), cache.admit(list(prompt))]
    for step in range(4):
        n_new = [len(s.token_ids) - s.length for s in seqs]
        batch = cache.begin_step(seqs, n_new)
        assert_same_plan(batch, rebuilt(cache, batch))
        batch.layers_done.update(range(cache.cfg.num_layers))
        cache.end_step(batch)
        if step == 0:
            for s in seqs:
                cache.cache_prefix(s)
            assert seqs[0].page_ids[:2] == seqs[1].page_ids[:2]
        for s in seqs:
            s.token_ids.append(5)
    for s in seqs:
        cache.finish(s)
