"""Shared by the tests of the whole-step decode graphs beside a raised or image pool: the drift monitor
switched on without ever acting by itself, the (whole, piecewise) steps a round ran, and rounds of
prompts at the fallback levels a test sets."""

from __future__ import annotations

from typing import Any

# Engine keywords: the drift monitor on (so a raised pool), never sampling, never raising the level by
# itself; a test sets ``engine.drift.policy.level`` (the engine thread reads it at its next step).
DRIFT_ON: dict[str, Any] = dict(drift_sample_rate=1e-12, drift_threshold=1e9, seed=0)


def take_steps(graphs: Any, engine: Any) -> tuple[int, int, int]:
    """(whole steps, piecewise steps) that ``graphs`` (`FullDecodeGraphs`) ran since the last call, and
    the steps past a round's end among them: 1 when overlap scheduling (CUDA) kept the round's sampled
    ids on the device, so its requests' last step was launched before they were known to be finished
    (the step runs, its rows are dropped), else 0. A round of ``max_new_tokens`` n whose requests all
    prefill in one step runs n - 1 decode steps plus that one. Resets the graphs' counters and the
    engine's ``deferred_steps``."""
    counts = (graphs.replayed_steps - graphs.piecewise_steps, graphs.piecewise_steps)
    past_end = int(engine.core.deferred_steps > 0)
    graphs.replayed_steps = graphs.piecewise_steps = engine.core.deferred_steps = 0
    return (*counts, past_end)


def rounds_at_levels(
    engine: Any, graphs: Any, rounds: list[list[list[int]]], new_tokens: int
) -> tuple[list[list[list[int]]], list[tuple[int, int, int]]]:
    """Greedy outputs of ``rounds`` of prompts, the first at fallback level 0, the others at level 1
    (new text pages in the raised pool); with ``graphs``, their `take_steps` per round."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    outs, counts = [], []
    for level, prompts in enumerate(rounds):
        engine.drift.policy.level = min(level, 1)
        outs.append([o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)])
        if graphs is not None:
            counts.append(take_steps(graphs, engine))
    return outs, counts
