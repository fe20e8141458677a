"""Greedy decoding through the plugin, driven as SGLang drives a model, where identity is well defined.

A float32 model with the default model's attention geometry (9 query heads over 3 KV heads of 64;
random weights, two layers) runs every forward batch through ``--attention-backend kvstrata`` over the
stratified pool (codec ``fp32``; SGLang's float32 KV dtype gives a float32 ring): two prompts prefilled
together and decoded together past the recent window, so history is read back from cold pages, then
a request that reuses the first one's cached pages in a mixed batch; with the torch kernels and the
Triton ones (interpreted on CPU). Its greedy tokens must equal greedy decoding with dense causal
attention over the whole sequence, token for token, and its logits stay within float32 rounding of
the dense ones. (On the GPU, with BF16 logits, SGLang's own greedy output changes with batching:
see docs/sglang.md.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.engine.tiny_models import randomize_
from tests.integrations.sglang.conftest import PAGE, alloc_row, make_pools, require_interpreted_triton

WINDOW = 2 * PAGE
NEW = 12


def tiny_default_geometry():
    from kvstrata.engine.config import ModelConfig
    from kvstrata.engine.loader import dummy_model

    config = ModelConfig(
        architecture="LlamaForCausalLM",
        num_layers=2,
        hidden_size=96,
        intermediate_size=128,
        q_heads=9,
        kv_heads=3,
        head_dim=64,
        vocab_size=300,
        rope_theta=100000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    net = dummy_model(config, torch.float32, torch.device("cpu"))
    randomize_(net, seed=5)  # a wider spread than the loader's init: logits far from ties
    return net


class PluginServer:
    """SGLang's side: ``ReqToTokenPool`` rows, paged slots, the stratified pool and the backend."""

    def __init__(self, net, codec: str, kernels: str = "torch") -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend
        from kvstrata.integrations.sglang.kernels import make_kernels
        from kvstrata.integrations.sglang.options import PluginOptions
        from kvstrata.integrations.sglang.pool import pool_class

        if kernels == "triton":
            require_interpreted_triton()
        cfg = net.config
        self.net = net
        options = PluginOptions(codec=codec, recent_window=WINDOW)
        self.req_pool, self.pool, self.allocator = make_pools(
            pool_class(options), layers=cfg.num_layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
            dtype=torch.float32,
        )  # fmt: skip
        runner = SimpleNamespace(token_to_kv_pool=self.pool, req_to_token_pool=self.req_pool)
        self.backend = KvstrataAttnBackend(runner, make_kernels(kernels))
        self.layers = [
            RadixAttention(cfg.q_heads, cfg.head_dim, cfg.attn_scale, cfg.kv_heads, i)
            for i in range(cfg.num_layers)
        ]
        self.rows: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}

    def admit(self, name: str, prompt: list[int], shared_slots: torch.Tensor | None = None) -> None:
        """A row and slots for the prompt and its new tokens; a cached prefix reuses ``shared_slots``."""
        row = alloc_row(self.req_pool)
        cached = 0 if shared_slots is None else shared_slots.numel()
        new = self.allocator.alloc(-(-(len(prompt) + 2 * NEW - cached) // PAGE) * PAGE)
        slots = new if shared_slots is None else torch.cat([shared_slots, new])
        self.req_pool.write((row, slice(0, slots.numel())), slots.to(torch.int32))
        self.rows[name], self.tokens[name], self.logits[name] = row, list(prompt), []

    def forward(self, batch: list[tuple[str, int, int]], decode: bool) -> None:
        """One forward batch of (request, cached length, new tokens); appends each request's greedy token."""
        from kvstrata.integrations.sglang.warmup import forward_batch

        ids, positions, locs = [], [], []
        for name, cached, n in batch:
            ids += self.tokens[name][cached : cached + n]
            positions += range(cached, cached + n)
            locs.append(self.req_pool.req_to_token[self.rows[name], cached : cached + n].to(torch.int64))
        rows = [self.rows[name] for name, _, _ in batch]
        prefix, extend = [cached for _, cached, _ in batch], [n for _, _, n in batch]
        names = [name for name, _, _ in batch]
        fb = forward_batch(rows, prefix, extend, torch.cat(locs), decode, rids=names)
        self.backend.init_forward_metadata(fb)
        attend = self.backend.forward_decode if decode else self.backend.forward_extend

        def attn(layer_idx: int, q, k, v):
            return attend(q.reshape(q.shape[0], -1), k, v, self.layers[layer_idx], fb).view(q.shape)

        last = torch.tensor([n for _, _, n in batch]).cumsum(0) - 1
        logits = self.net(torch.tensor(ids), torch.tensor(positions), attn, logits_at=last)
        for (name, _, _), row in zip(batch, logits, strict=True):
            self.tokens[name].append(int(row.argmax()))
            self.logits[name].append(row)


def dense_greedy(net, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens with dense causal attention over the whole sequence, and the logits that chose them."""
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(net.dense_forward(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :], net.dense_forward(torch.tensor([seq]))[0, len(prompt) - 1 : -1]


@pytest.mark.parametrize("kernels", ["torch", "triton"])  # triton: interpreted on CPU (see conftest)
def test_greedy_equals_dense_float32(kernels):
    net = tiny_default_geometry()
    a, b = [5, 17, 230, 42, 9, 77, 3, 150, 61, 8, 299], [100, 101, 7, 250, 33, 64]
    c = a[: 2 * PAGE] + [12, 13, 14, 15, 16]
    s = PluginServer(net, "fp32", kernels)
    with torch.no_grad():
        s.admit("a", a)
        s.admit("b", b)
        s.forward([("a", 0, len(a)), ("b", 0, len(b))], decode=False)
        for _ in range(NEW - 1):
            s.forward([(r, len(s.tokens[r]) - 1, 1) for r in ("a", "b")], decode=True)
        # c's first two pages are a's, cold by now (a is past the window): the tree hands them over
        a_slots = s.req_pool.req_to_token[s.rows["a"], : 2 * PAGE].to(torch.int64)
        s.admit("c", c, shared_slots=a_slots)
        s.forward([("c", 2 * PAGE, len(c) - 2 * PAGE), ("b", len(s.tokens["b"]) - 1, 1)], decode=False)
        for _ in range(NEW - 1):
            s.forward([(r, len(s.tokens[r]) - 1, 1) for r in ("c", "b")], decode=True)
        prompts = {"a": a, "b": b, "c": c}
        want = {name: dense_greedy(net, p, len(s.tokens[name]) - len(p)) for name, p in prompts.items()}
    assert s.pool.quantized_pages > 0
    for name, prompt in prompts.items():
        tokens, logits = want[name]
        assert s.tokens[name][len(prompt) :] == tokens, name
        # float32 all the way: a BF16 ring or BF16 pages would move the logits by far more
        err = (torch.stack(s.logits[name]) - logits).abs().max().item()
        assert err < 1e-4, (name, err)
    assert len(set(s.tokens["a"][len(a) :])) > 1  # not one token repeated: the comparison has teeth
