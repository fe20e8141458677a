"""Prefill-only steps (the default, SGLang's) against mixed steps (``enable_mixed_chunk``): which
requests a step carries, the fallback to a decode step when no chunk gets pages, and equal greedy
outputs either way."""

from __future__ import annotations

from prompt_texts import PROMPT_TEXTS
from test_scheduler_cache import make, request, run

from kvstrata.engine.engine import Engine
from kvstrata.radix import OutOfPages


def two_requests(mixed: bool) -> tuple[list[list[str]], list]:
    """A (16-token prompt) runs alone for one step; then B (48 tokens, 16-token chunks) arrives.
    Returns the request ids of each of the next five steps, and the two requests."""
    cache, sched, ended = make(num_pages=32)
    sched.mixed_chunk = mixed
    sched.chunk_size = 16
    a = request("a", list(range(100, 116)), max_new=20)
    sched.add(a)
    run(cache, sched)  # A's prompt; A now decodes
    b = request("b", list(range(300, 348)), max_new=20)
    sched.add(b)
    steps = []
    for _ in range(5):
        reqs = run(cache, sched)
        steps.append([r.rid for r in reqs])
    assert not ended
    return steps, [a, b]


def test_prefill_chunks_run_alone_by_default() -> None:
    steps, (a, b) = two_requests(mixed=False)
    # B's three chunks first, A waiting; then both decode in one step.
    assert steps == [["b"], ["b"], ["b"], ["a", "b"], ["a", "b"]]
    assert len(a.output_ids) == 1 + 2 and len(b.output_ids) == 3


def test_mixed_chunk_carries_the_decodes_in_every_step() -> None:
    steps, (a, b) = two_requests(mixed=True)
    assert steps == [["a", "b"]] * 5
    assert len(a.output_ids) == 1 + 5 and len(b.output_ids) == 3


def test_decodes_run_when_no_prefill_chunk_gets_pages(monkeypatch) -> None:
    """A step of B's chunk alone finds no pages: the scheduler runs A's decode instead, with no
    preemption; B's chunk runs once pages are found again."""
    cache, sched, ended = make(num_pages=32)
    sched.chunk_size = 16
    a = request("a", list(range(100, 116)), max_new=20)
    sched.add(a)
    run(cache, sched)
    b = request("b", list(range(300, 348)), max_new=20)
    sched.add(b)
    real = cache.begin_step
    blocked = [True]

    def begin_step(seqs, n_new):
        if blocked[0] and any(n > 1 for n in n_new):
            raise OutOfPages("test: no pages for a prefill chunk")
        return real(seqs, n_new)

    monkeypatch.setattr(cache, "begin_step", begin_step)
    assert [r.rid for r in run(cache, sched)] == ["a"]
    assert [r.rid for r in run(cache, sched)] == ["a"]
    assert b in sched.waiting and not b.started  # its admission was rolled back
    blocked[0] = False
    assert [r.rid for r in run(cache, sched)] == ["b"]
    assert a.preemptions == 0 and b.preemptions == 0 and not ended


def test_greedy_outputs_do_not_depend_on_the_policy(default_model) -> None:
    """Four prompts in 16-token chunks, four running: the same greedy tokens with prefill-only
    steps and with mixed steps."""
    tok = default_model.tokenizer
    prompts = [tok.encode(PROMPT_TEXTS[i]) for i in (0, 1, 2, 5)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outs = []
    for mixed in (False, True):
        eng = Engine(
            model=default_model,
            kv_cache_dtype="auto",
            recent_window=16,
            max_total_tokens=2048,
            max_running_requests=4,
            chunked_prefill_size=16,
            enable_mixed_chunk=mixed,
        )
        try:
            outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)])
            eng.check_invariants()
        finally:
            eng.shutdown()
    assert all(len(o) == 12 for o in outs[0])
    assert outs[0] == outs[1]


def chunk_steps(
    prompt_lens: list[int], chunk: int, defer_fill: float, cached: int = 0
) -> list[list[tuple[str, int]]]:
    """Prompts submitted at once and prefilled in chunks of ``chunk`` tokens (prefill-only steps): each
    step's requests with the prompt tokens it computed for them, until every prompt is in. ``cached``:
    that many first tokens of the last prompt are in the prefix tree before (a finished request's)."""
    cache, sched, ended = make(num_pages=64, max_running=8)
    reqs = [
        request(f"p{i}", list(range(100 * i + 10, 100 * i + 10 + n)), max_new=4)
        for i, n in enumerate(prompt_lens)
    ]
    if cached:
        earlier = request("earlier", reqs[-1].prompt_ids[:cached] + [9], max_new=1)
        sched.add(earlier)
        run(cache, sched)  # its whole prompt, and its one token
        sched.release(earlier, insert=True)
    sched.chunk_size, sched.defer_fill = chunk, defer_fill
    for r in reqs:
        sched.add(r)
    steps = []
    while any(not r.started or r.in_prefill for r in reqs):
        before = {r.rid: r.computed for r in reqs}
        stepped = run(cache, sched)
        steps.append([(r.rid, r.computed - before[r.rid]) for r in stepped])
        # a withdrawn admission keeps nothing: its ring slot is free again and it waits, unstarted
        assert cache.ring.slots.num_free == cache.ring.slots.total - len(sched.running)
        assert all(not r.started and r.seq is None for r in sched.waiting)
    assert not ended
    return steps


def test_a_prompt_that_would_be_cut_waits_for_the_next_step() -> None:
    """Chunks of 64 tokens: a step holding 60 (three 20-token prompts, >= 0.75 of the chunk) leaves the
    fourth prompt whole for the next step instead of computing 4 of its tokens; at 1 (SGLang's way)
    it is cut."""
    assert chunk_steps([20] * 4, 64, 0.75) == [[("p0", 20), ("p1", 20), ("p2", 20)], [("p3", 20)]]
    assert chunk_steps([20] * 4, 64, 1.0) == [[("p0", 20), ("p1", 20), ("p2", 20), ("p3", 4)], [("p3", 16)]]


def test_prompts_are_still_cut_below_the_fill_or_when_longer_than_a_chunk() -> None:
    # 40 of 64 held (< 48): the second prompt is cut as before
    assert chunk_steps([40, 40], 64, 0.75) == [[("p0", 40), ("p1", 24)], [("p1", 16)]]
    # a prompt longer than a chunk is cut whatever the fill (it can never run whole)
    assert chunk_steps([50, 100], 64, 0.75) == [[("p0", 50), ("p1", 14)], [("p1", 64)], [("p1", 22)]]
    # a prompt whose first 32 tokens are cached reads history anyway: cut (4 of its 18 left), not held;
    # the same prompt with nothing cached waits
    assert chunk_steps([20, 20, 20, 50], 64, 0.75) == [[("p0", 20), ("p1", 20), ("p2", 20)], [("p3", 50)]]
    assert chunk_steps([20, 20, 20, 50], 64, 0.75, cached=32) == [
        [("p0", 20), ("p1", 20), ("p2", 20), ("p3", 32 + 4)],  # its cached 32 count as computed
        [("p3", 14)],
    ]
