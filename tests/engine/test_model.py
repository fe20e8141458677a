"""The model against transformers: default model (GGUF) and tiny random Llama-3 / Qwen2 / Qwen3 checkpoints.

Error measure throughout: max |ours - transformers| / max |transformers| over all compared logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
import torch

from kvstrata.engine.config import ModelConfig
from kvstrata.engine.loader import load_model
from kvstrata.engine.model import causal_attention
from kvstrata.engine.rope import rope_inv_freq

TOL = 1e-4
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin, and the largest city of Japan is",
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
    "        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return",
]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


class ListCache:
    """The simplest possible cache behind the callback: per (sequence, layer), a growing K/V list."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.seqs: list[int] = []
        self.lens: list[int] = []

    def step(self, seqs: list[int], lens: list[int]):
        self.seqs, self.lens = seqs, lens
        return self.attn

    def attn(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for seq, qi, ki, vi in zip(
            self.seqs, q.split(self.lens), k.split(self.lens), v.split(self.lens), strict=True
        ):
            old_k, old_v = self.kv.get((seq, layer), (ki[:0], vi[:0]))
            kk, vv = torch.cat([old_k, ki]), torch.cat([old_v, vi])
            self.kv[(seq, layer)] = (kk, vv)
            # causal with an offset: query i sees keys [0, len(old) + i]
            n, m = qi.shape[0], kk.shape[0]
            mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
            group = qi.shape[1] // kk.shape[1]
            scores = torch.einsum("qhd,khd->hqk", qi, kk.repeat_interleave(group, 1)) * qi.shape[-1] ** -0.5
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, vv.repeat_interleave(group, 1)))
        return torch.cat(outs)


# ------------------------------------------------------------------------------------- default model
@pytest.fixture(scope="module")
def prompt_ids(default_model) -> list[torch.Tensor]:
    tok = default_model.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False)
    return [torch.tensor(tok.encode(t)) for t in [chat, PROMPTS[1]]]


def test_default_model_geometry(default_model):
    c = default_model.config
    assert (c.num_layers, c.hidden_size, c.q_heads, c.kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings) == (49152, 1536, True)
    assert (c.rope_theta, c.rope_scaling, c.bos_token_id, c.eos_token_ids) == (100000.0, None, 1, (2,))
    assert default_model.name == "SmolLM2-135M-Instruct"
    net = default_model.net
    assert net.lm_head.weight is net.embed.weight
    assert sum(p.numel() for p in net.parameters()) == 134_515_008


def test_default_prefill_matches_transformers(default_model, hf_default_model, prompt_ids):
    for ids in prompt_ids:
        ours = default_model.net.dense_forward(ids[None])[0]
        ref = hf_logits(hf_default_model, ids)
        assert ours.dtype == torch.float32 and ours.shape == (len(ids), 49152)
        assert rel_err(ours, ref) < TOL
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_default_varlen_callback_matches_transformers(default_model, hf_default_model, prompt_ids):
    net, (a, b) = default_model.net, prompt_ids
    assert len(a) != len(b)
    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))])
    ours = net(ids, positions, attn=net.dense_attn_for([len(a), len(b)]))
    ref = torch.cat([hf_logits(hf_default_model, a), hf_logits(hf_default_model, b)])
    assert rel_err(ours, ref) < TOL
    last = torch.tensor([len(a) - 1, len(a) + len(b) - 1])
    picked = net(ids, positions, attn=net.dense_attn_for([len(a), len(b)]), logits_at=last)
    assert picked.shape == (2, 49152)
    assert rel_err(picked, ref[last]) < TOL


def test_default_decode_through_callback_matches_dense(default_model, prompt_ids):
    """Prefill two sequences of different lengths together, then decode both token by token."""
    net, cache = default_model.net, ListCache()
    seqs = [ids[:30] for ids in prompt_ids]
    seqs[1] = seqs[1][:17]
    full = [ids[:40] for ids in prompt_ids]
    full[1] = full[1][:27]
    logits = net(
        torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs]), cache.step([0, 1], [30, 17])
    )
    got = [[logits[29]], [logits[46]]]
    for step in range(10):
        ids = torch.stack([full[0][30 + step], full[1][17 + step]])
        logits = net(ids, torch.tensor([30 + step, 17 + step]), cache.step([0, 1], [1, 1]))
        got[0].append(logits[0])
        got[1].append(logits[1])
    for i, (f, start) in enumerate(zip(full, [29, 16], strict=True)):
        dense = net.dense_forward(f[None])[0][start : start + 11]
        assert rel_err(torch.stack(got[i]), dense) < TOL


def test_dense_forward_batch_equals_single(default_model, prompt_ids):
    net = default_model.net
    ids = torch.stack([prompt_ids[0][:20], prompt_ids[1][:20]])
    both = net.dense_forward(ids)
    one = net.dense_forward(ids[1:])
    assert rel_err(both[1], one[0]) < 1e-6


# ------------------------------------------------------------------------------------- tiny checkpoints
@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    hf = tiny_models.hf_model(request.param)
    out = tiny_models.save_hf(hf, tmp_path_factory.mktemp(request.param), shard=request.param == "qwen3")
    return request.param, hf, out


def test_tiny_checkpoint_matches_transformers(tiny):
    kind, hf, path = tiny
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    expected = {
        "llama3": ("LlamaForCausalLM", False, False, False, (2, 3)),
        "qwen2": ("Qwen2ForCausalLM", False, True, True, (2,)),
        "qwen3": ("Qwen3ForCausalLM", True, False, False, ()),
    }[kind]
    assert (cfg.architecture, cfg.qk_norm, cfg.attention_bias, cfg.tie_word_embeddings) == expected[:4]
    assert cfg.eos_token_ids == expected[4]
    if kind == "llama3":
        assert cfg.rope_scaling["rope_type"] == "llama3"
    if kind == "qwen3":
        assert (cfg.q_heads, cfg.kv_heads, cfg.head_dim) == (8, 2, 32)
        assert len(list(path.glob("*.safetensors"))) > 1  # sharded, read through the index
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 300, (150,), generator=g), torch.randint(0, 300, (61,), generator=g)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    assert rel_err(model.net.dense_forward(a[None])[0], ref_a) < TOL
    varlen = model.net(
        torch.cat([a, b]),
        torch.cat([torch.arange(150), torch.arange(61)]),
        model.net.dense_attn_for([150, 61]),
    )
    assert rel_err(varlen, torch.cat([ref_a, ref_b])) < TOL


def test_tiny_bfloat16_is_close(tiny):
    _, hf, path = tiny
    ids = torch.randint(0, 300, (1, 50), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, ids[0])
    bf16 = load_model(path, dtype="bfloat16").net
    assert bf16.dtype == torch.bfloat16
    out = bf16.dense_forward(ids)[0]
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 0.05


def test_qk_norm_and_bias_are_used(tmp_path: Path):
    """Changing a q_norm weight / q bias in the checkpoint changes our logits as much as transformers'."""
    for kind, param in [("qwen3", "q_norm"), ("qwen2", "wqkv")]:
        hf = tiny_models.hf_model(kind)
        model = load_model(tiny_models.save_hf(hf, tmp_path / kind))
        ids = torch.arange(20)
        before = model.net.dense_forward(ids[None])[0]
        with torch.no_grad():
            if param == "q_norm":
                model.net.layers[0].attn.q_norm.weight.mul_(3.0)
                hf.model.layers[0].self_attn.q_norm.weight.mul_(3.0)
            else:
                model.net.layers[0].attn.wqkv.bias[:64].add_(1.0)
                hf.model.layers[0].self_attn.q_proj.bias.add_(1.0)
        after = model.net.dense_forward(ids[None])[0]
        assert (after - before).abs().max() > 0.1
        assert rel_err(after, hf_logits(hf, ids)) < TOL


# ------------------------------------------------------------------------------------- pieces
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
)
def test_rope_inv_freq_matches_transformers(scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(scaling) if scaling else None,
    )
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    ours, factor = rope_inv_freq(cfg, seq_len=200000)
    if scaling is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
        ref_factor = 1.0
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu", seq_len=200000)
    assert ours.shape == (64,)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)
    if scaling:
        plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
        assert not torch.allclose(ours, plain)  # the scaling did something


def test_causal_attention_gqa_groups_are_consecutive():
    q = torch.randn(5, 4, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out = causal_attention(q, k, v)
    ref = causal_attention(q[:, 2:3], k[:, 1:2], v[:, 1:2])  # query head 2 reads kv head 2 // 2 = 1
    assert torch.allclose(out[:, 2:3], ref, atol=1e-6)
    assert torch.allclose(out[0], v[0].repeat_interleave(2, 0), atol=1e-6)  # first token sees itself only


def test_dense_attn_for_rejects_wrong_lengths(tiny):
    _, _, path = tiny
    net = load_model(path).net
    with pytest.raises(ValueError, match="got 10 tokens"):
        net(torch.arange(10), torch.arange(10), net.dense_attn_for([4, 5]))


@pytest.mark.parametrize("in_features, bias", [(48, True), (1536, False)])
def test_small_row_linear_equals_f_linear_for_every_row_count(in_features: int, bias: bool):
    """`Linear` computes 1-8 rows as W @ x^T (one row padded to two): same values as F.linear."""
    from kvstrata.engine.model import Linear

    lin = Linear(in_features, 40, bias=bias)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in range(1, 11):
            x = torch.randn(rows, in_features, generator=g)
            got = lin(x)
            assert got.shape == (rows, 40) and got.is_contiguous()
            ref = torch.nn.functional.linear(
                x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double()
            )
            assert rel_err(got, ref.float()) < 1e-6
