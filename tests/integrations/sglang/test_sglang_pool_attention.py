"""The stratified pool and ``--attention-backend kvstrata`` driven as SGLang drives them.

Requests get ``ReqToTokenPool`` rows and slots from SGLang's paged allocator; each forward batch
is planned by the backend and every layer attends and stores through the pool. The same tokens
also run through kvstrata's own `StratifiedKVCache`: pool contents and attention outputs must be
identical, and attention must match dense causal attention over the same K/V.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstrata.integrations.sglang.options import PluginOptions
from kvstrata.integrations.sglang.pool import pool_class
from kvstrata.quant import relative_rmse
from kvstrata.radix import CacheConfig, StratifiedKVCache
from tests.integrations.sglang.conftest import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PAGE,
    alloc_row,
    make_pools,
    require_interpreted_triton,
)

Q_HEADS = 4
WINDOW = 2 * PAGE
SCALE = HEAD_DIM**-0.5
VOCAB = 500


class World:
    """One SGLang side (pool + backend) and one kvstrata side (its own cache), same tokens."""

    def __init__(self, codec: str, kernels: str = "torch", max_context: int = 256) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend
        from kvstrata.integrations.sglang.kernels import make_kernels

        if kernels == "triton":
            require_interpreted_triton()
        gen = torch.Generator().manual_seed(0)
        self.k_of = torch.randn(LAYERS, VOCAB, KV_HEADS, HEAD_DIM, generator=gen) * 2
        self.v_of = torch.randn(LAYERS, VOCAB, KV_HEADS, HEAD_DIM, generator=gen)
        self.gen = gen
        options = PluginOptions(codec=codec, recent_window=WINDOW)
        self.req_pool, self.pool, self.allocator = make_pools(pool_class(options), max_context=max_context)
        runner = SimpleNamespace(token_to_kv_pool=self.pool, req_to_token_pool=self.req_pool)
        self.backend = KvstrataAttnBackend(runner, make_kernels(kernels))
        self.ref_kernels = kernels == "triton"
        self.layers = [RadixAttention(Q_HEADS, HEAD_DIM, SCALE, KV_HEADS, layer) for layer in range(LAYERS)]
        cfg = CacheConfig(
            num_layers=LAYERS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            page_size=PAGE,
            recent_window=WINDOW,
            layer_codecs=[codec] * LAYERS,
            num_pages=64,
            max_running=4,
        )
        self.ref = StratifiedKVCache(cfg)
        self.rows: dict[str, int] = {}
        self.seqs: dict = {}
        self.tokens: dict[str, list[int]] = {}
        self.history_q: dict[str, list[torch.Tensor]] = {}

    def admit(self, name: str, tokens: list[int], shared_slots: torch.Tensor | None = None) -> int:
        """Row + slots for all ``tokens`` (a tree prefix reuses ``shared_slots``); returns the
        cached prefix length."""
        row = alloc_row(self.req_pool)
        cached = 0 if shared_slots is None else shared_slots.numel()
        need = -(-(len(tokens) + 16 - cached) // PAGE) * PAGE
        new = self.allocator.alloc(need)
        slots = new if shared_slots is None else torch.cat([shared_slots, new])
        self.req_pool.write((row, slice(0, slots.numel())), slots.to(torch.int32))
        self.rows[name], self.tokens[name] = row, list(tokens)
        self.seqs[name] = self.ref.admit(list(tokens) + [0] * 16)
        assert self.seqs[name].cached_tokens == cached
        return cached

    def step(self, batch: list[tuple[str, int, int]], decode: bool, graph_bs: int | None = None):
        """One forward batch of (request, cached length, new tokens); returns both sides' outputs.
        ``graph_bs``: a decode batch padded to that bucket and run as SGLang replays a captured
        graph (`padded_decode`)."""
        from kvstrata.integrations.sglang.warmup import forward_batch

        rows, locs, qs, ks, vs = [], [], [], [], []
        for name, L, n in batch:
            row = self.rows[name]
            toks = torch.tensor(self.tokens[name][L : L + n])
            rows.append(row)
            locs.append(self.req_pool.req_to_token[row, L : L + n].to(torch.int64))
            qs.append(torch.randn(n, Q_HEADS, HEAD_DIM, generator=self.gen))
            ks.append(self.k_of[:, toks])
            vs.append(self.v_of[:, toks])
        q, k, v = torch.cat(qs), torch.cat(ks, dim=1), torch.cat(vs, dim=1)
        prefix, extend = [L for _, L, _ in batch], [n for _, _, n in batch]
        names = [name for name, _, _ in batch]
        fb = forward_batch(rows, prefix, extend, torch.cat(locs), decode, rids=names)
        if graph_bs is None:
            self.backend.init_forward_metadata(fb)
        else:
            fb, q, k, v = padded_decode(self.backend, fb, q, k, v, graph_bs)
        ref_batch = self.ref.begin_step([self.seqs[name] for name, _, _ in batch], [n for _, _, n in batch])
        outs, refs = [], []
        real = sum(n for _, _, n in batch)
        for layer in self.layers:
            qb = q.to(torch.bfloat16)
            kb, vb = k[layer.layer_id].to(torch.bfloat16), v[layer.layer_id].to(torch.bfloat16)
            forward = self.backend.forward_decode if decode else self.backend.forward_extend
            outs.append(forward(*fused_qkv_views(qb, kb, vb), layer, fb)[:real])
            qr, kr, vr = qb[:real], kb[:real], vb[:real]
            refs.append(self.ref.attention(layer.layer_id, ref_batch, qr, kr, vr, SCALE, self.ref_kernels))
        self.ref.end_step(ref_batch)
        return q, outs, refs


def fused_qkv_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q ``[T, Hq * D]`` and k, v ``[T, H, D]`` as SGLang's models pass them: views of one fused QKV
    projection output ``[T, (Hq + 2H) * D]`` (split along the channels, so not contiguous)."""
    T = q.shape[0]
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    qv, kv, vv = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    assert not kv.is_contiguous()
    return qv, kv.view(T, KV_HEADS, HEAD_DIM), vv.view(T, KV_HEADS, HEAD_DIM)


def padded_decode(backend, fb, q, k, v, bs: int):
    """A decode batch padded to ``bs`` entries as SGLang's decode graph runner pads it (row 0, sequence
    length 1, slot 0), planned as for a replay (``init_forward_metadata_out_graph``, then the graph's
    ``init_forward_metadata_in_graph``); the padded batch and q/k/v (padding rows random)."""
    n = fb.req_pool_indices.numel()
    pad = bs - n

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad,), value, dtype=t.dtype)])

    fb = SimpleNamespace(
        forward_mode=fb.forward_mode,
        batch_size=bs,
        num_padding=pad,
        rids=fb.rids,  # what kvstrata's hook on build_replay_fb_view adds to SGLang's replay view
        req_pool_indices=padded(fb.req_pool_indices, 0),
        seq_lens=padded(fb.seq_lens, 1),
        seq_lens_cpu=padded(fb.seq_lens_cpu, 1),
        out_cache_loc=padded(fb.out_cache_loc, 0),
    )
    backend.init_forward_metadata_out_graph(fb)
    backend.init_forward_metadata_in_graph(fb)
    extra = torch.randn(pad, *q.shape[1:])
    q = torch.cat([q, extra])
    k = torch.cat([k, torch.randn(k.shape[0], pad, *k.shape[2:])], dim=1)
    v = torch.cat([v, torch.randn(v.shape[0], pad, *v.shape[2:])], dim=1)
    return fb, q, k, v


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions ``start..`` over all of ``k``/``v`` (float32)."""
    n, s = q.shape[0], k.shape[0]
    kk = k.float().repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    vv = v.float().repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * SCALE
    allowed = torch.arange(s).view(1, s) <= (start + torch.arange(n)).view(n, 1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def run_schedule(w: World, check) -> None:
    """Two prompts prefilled together, decodes past the window, then a third request that
    reuses the first one's two cached pages from the tree."""
    a = list(range(1, 12))
    b = list(range(100, 106))
    w.admit("a", a + list(range(200, 210)))
    w.admit("b", b + list(range(300, 310)))
    check(w, [("a", 0, 11), ("b", 0, 6)], decode=False)
    for t in range(8):
        check(w, [("a", 11 + t, 1), ("b", 6 + t, 1)], decode=True)
    a_slots = w.req_pool.req_to_token[w.rows["a"], : 2 * PAGE].to(torch.int64)
    w.ref.finish(w.seqs.pop("a"))
    cached = w.admit("c", a[: 2 * PAGE] + list(range(400, 410)), shared_slots=a_slots)
    assert cached == 2 * PAGE
    check(w, [("c", cached, 5), ("b", 14, 1)], decode=False)


def assert_pool_equals_cache(w: World, batch) -> None:
    """Each request of ``batch`` holds in the pool (cold pages + ring) exactly what kvstrata's cache holds."""
    for name, L, n in batch:
        seq, row = w.seqs[name], w.rows[name]
        assert w.pool.rings.ring(row).start == seq.ring_start
        for layer in range(LAYERS):
            k, v = w.pool.read_request(layer, row, L + n)
            pages = torch.tensor(seq.page_ids[: seq.ring_start // PAGE], dtype=torch.long)
            k_ref, v_ref = w.ref.pool.read(layer, pages, torch.float32)
            ring = torch.tensor(w.ref.ring.rows(seq.slot, seq.ring_start, seq.length), dtype=torch.long)
            k_ref = torch.cat([k_ref.reshape(-1, KV_HEADS, HEAD_DIM), w.ref.ring.k[layer][ring].float()])
            v_ref = torch.cat([v_ref.reshape(-1, KV_HEADS, HEAD_DIM), w.ref.ring.v[layer][ring].float()])
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


KERNELS = ["torch", "triton"]  # triton: under TRITON_INTERPRET=1 without CUDA (see conftest)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int4"])
def test_pool_and_attention_equal_kvstrata_cache(codec, kernels):
    """Same kernels on both sides: SGLang's side equals kvstrata's own cache bit for bit."""
    w = World(codec, kernels)

    def check(w: World, batch, decode: bool) -> None:
        _, outs, refs = w.step(batch, decode)
        for out, ref in zip(outs, refs, strict=True):
            assert torch.equal(out, ref.reshape(out.shape))
        assert_pool_equals_cache(w, batch)

    run_schedule(w, check)
    assert w.pool.quantized_pages == w.ref.quantized_pages > 0


# bf16: only the bf16 rounding of the output (at most 2^-8 relative per element). fp8_e4m3 keeps
# 3 mantissa bits (at most 2^-4 relative per element) on the history outside the window.
@pytest.mark.parametrize(
    ("codec", "bound", "kernels"),
    [("bf16", 2**-8, "torch"), ("fp8_e4m3", 2**-4, "torch"), ("fp8_e4m3", 2**-4, "triton")],
)
def test_attention_matches_dense(codec, bound, kernels):
    w = World(codec, kernels)
    worst = []

    def check(w: World, batch, decode: bool) -> None:
        q, outs, _ = w.step(batch, decode)
        qb = q.to(torch.bfloat16)
        offset = 0
        for name, L, n in batch:
            toks = torch.tensor(w.tokens[name][: L + n])
            for layer, out in enumerate(outs):
                k = w.k_of[layer, toks].to(torch.bfloat16)
                v = w.v_of[layer, toks].to(torch.bfloat16)
                want = dense(qb[offset : offset + n], k, v, L)
                got = out[offset : offset + n].view(n, Q_HEADS, HEAD_DIM).float()
                worst.append(relative_rmse(got, want))
            offset += n

    run_schedule(w, check)
    print(f"{codec} {kernels}: worst relative RMSE of attention vs dense {max(worst):.5f}")
    assert max(worst) < bound
    assert w.pool.quantized_pages > 0


def test_refusals_are_clear():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend

    w = World("fp8_e4m3")
    with pytest.raises(NotImplementedError, match="only --attention-backend kvstrata"):
        w.pool.get_key_buffer(0)
    req_pool, bf16_pool, _ = make_pools(MHATokenToKVPool)
    with pytest.raises(
        ValueError, match="--radix-cache-backend kvstrata and a kvstrata codec .*=auto SGLang"
    ):
        KvstrataAttnBackend(SimpleNamespace(token_to_kv_pool=bf16_pool, req_to_token_pool=req_pool))
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    verify = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor([1]))
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY"):
        w.backend.init_forward_metadata(verify)
    row = alloc_row(w.req_pool)
    # A new request whose cached prefix ends mid-page: the page's first tokens are nowhere.
    with pytest.raises(ValueError, match="not page aligned"):
        w.pool.plan_step([row], [PAGE + 1], [1])


def test_kernel_choice(monkeypatch):
    from kvstrata.integrations.sglang.kernels import TorchStrataKernels, TritonStrataKernels, make_kernels

    monkeypatch.delenv("KVSTRATA_ATTENTION_KERNELS", raising=False)
    assert isinstance(make_kernels(device="cpu"), TorchStrataKernels)
    assert isinstance(make_kernels(device="cuda"), TritonStrataKernels)
    monkeypatch.setenv("KVSTRATA_ATTENTION_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(make_kernels(device="cpu"), TritonStrataKernels)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_kernels(device="cpu")
    with pytest.raises(ValueError, match="not registered"):
        make_kernels("cutlass")


def test_page_tables_read_every_row_in_one_gather():
    """`page_tables` (one gather for the whole batch) gives each row's first pages exactly as reading
    ``req_to_token`` row by row does; rows with no complete page get none."""
    from kvstrata.integrations.sglang.step import page_tables

    gen = torch.Generator().manual_seed(7)
    req_to_token = torch.randint(0, 1 << 20, (12, 40 * PAGE), dtype=torch.int32, generator=gen)
    rows = [5, 0, 11, 3, 7]
    full_pages = [3, 0, 40, 1, 0]
    tables = page_tables(rows, full_pages, req_to_token, PAGE)
    for row, full, ids in zip(rows, full_pages, tables, strict=True):
        slots = req_to_token[row, 0 : full * PAGE : PAGE].to(torch.long)
        assert ids == (slots // PAGE).tolist()
        assert len(ids) == full
    assert page_tables([1, 2], [0, 0], req_to_token, PAGE) == [[], []]
