"""The kernel warm-up (`warmup.warm_up`): the step shapes it compiles, on a scratch pool only."""

from __future__ import annotations

import pytest
import torch

from kvstrata.engine.warmup import EXTEND_TOKENS
from kvstrata.integrations.sglang.kernels import TorchStrataKernels, make_kernels
from kvstrata.integrations.sglang.options import PluginOptions
from kvstrata.integrations.sglang.pool import pool_class
from tests.integrations.sglang.conftest import PAGE, make_pools, require_interpreted_triton

WINDOW = 2 * PAGE
Q_HEADS = 4


class Recording(TorchStrataKernels):
    """The torch kernels, recording (decode, tokens per request, page-table width) of every group."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: set[tuple[bool, int, int]] = set()
        self.steps_with_groups: list[int] = []

    def attend(self, layer, batch, q, k, v, scale, pool, ring):
        for g in batch.groups:
            self.groups.add((g.tokens == 1, g.tokens, g.page_table.shape[1]))
        self.steps_with_groups.append(len(batch.groups))
        return super().attend(layer, batch, q, k, v, scale, pool, ring)


def served_pool():
    options = PluginOptions(codec="fp8_e4m3", recent_window=WINDOW)
    return make_pools(pool_class(options))[1]


def test_warm_up_covers_the_step_shapes_and_leaves_the_pool_alone():
    from kvstrata.integrations.sglang.warmup import warm_up

    pool = served_pool()
    before = [t.clone() for bufs in pool.cold.k + pool.cold.v for t in bufs.values()]
    kernels = Recording()
    warm_up(pool, Q_HEADS, kernels)
    extend = {(T, width) for decode, T, width in kernels.groups if not decode}
    decode_widths = {width for decode, _, width in kernels.groups if decode}
    # query tiles from 3 new tokens to 8 pages of them over history; 0, 1, 16 and 20 cold pages; several
    # groups per step
    assert {3, 8 * PAGE} <= {T for T, _ in extend}
    # and the engine's warm-up extends (every query tile at 1 to 16 query heads a KV head: its tests)
    assert set(EXTEND_TOKENS) <= {T for T, width in extend if width > 0}
    assert {0, 1, 16, 20} <= {width for _, width in extend}
    assert min(decode_widths) <= 1 and max(decode_widths) > 16  # decode over short and long histories
    assert max(kernels.steps_with_groups) > 1
    # the served pool: no page written, no ring bound
    after = [t for bufs in pool.cold.k + pool.cold.v for t in bufs.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert pool.quantized_pages == 0 and pool.ring is None


def test_warm_up_runs_the_triton_kernels():
    """Every warm-up step through the Triton kernels (interpreted on CPU, see conftest)."""
    from kvstrata.integrations.sglang.warmup import warm_up

    require_interpreted_triton()
    assert warm_up(served_pool(), Q_HEADS, make_kernels("triton")) > 0


@pytest.mark.parametrize(("value", "on"), [(None, True), ("0", False), ("no", False), ("1", True)])
def test_warm_up_switch(value, on, monkeypatch):
    from kvstrata.integrations.sglang.warmup import ENV_WARMUP, warmup_enabled

    if value is None:
        monkeypatch.delenv(ENV_WARMUP, raising=False)
    else:
        monkeypatch.setenv(ENV_WARMUP, value)
    assert warmup_enabled() is on


def test_warm_up_backend_logs_and_never_fails(published, caplog):
    """SGLang's factory path (`warm_up_backend`): query heads from the model config; a failure is a
    warning and the backend stays usable."""
    import logging
    from types import SimpleNamespace

    from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend, warm_up_backend

    req_pool, pool, _ = make_pools(pool_class(PluginOptions(codec="fp8_e4m3", recent_window=WINDOW)))
    backend = KvstrataAttnBackend(SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=req_pool))
    heads = SimpleNamespace(get_num_attention_heads=lambda tp: Q_HEADS * tp)
    with caplog.at_level(logging.INFO, logger="kvstrata.integrations.sglang.attention_backend"):
        assert warm_up_backend(backend, SimpleNamespace(model_config=heads)) > 0
        assert "kernels compiled in" in caplog.text
        assert warm_up_backend(backend, SimpleNamespace(model_config=None)) is None
        assert "kernel warm-up failed" in caplog.text
    assert pool.quantized_pages == 0
