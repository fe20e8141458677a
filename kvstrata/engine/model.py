"""One Llama-family transformer: Llama 2/3, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm), SmolLM2.

The model never sees a KV cache. Each layer hands its queries, keys and values (after q/k-norm and RoPE)
to an attention callback ``attn(layer_idx, q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D]) -> [T, Hq, D]``;
the stratified cache supplies that callback, stores k/v and attends over each sequence's history.
Inputs are a flattened varlen batch: ``input_ids[T]`` and ``positions[T]`` of all sequences concatenated.

``dense_forward`` is the reference path (plain causal SDPA, no cache) and ``dense_attn_for`` runs
sequences through the callback interface with plain causal attention.

Numerics follow transformers' modeling_llama/qwen2/qwen3 step for step (RMSNorm in float32, cos/sin in
float32 cast to the compute dtype), so float32 logits agree with it to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvstrata.engine import fused
from kvstrata.engine.config import ModelConfig
from kvstrata.engine.rope import rope_inv_freq

AttnFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class Linear(nn.Linear):
    """`nn.Linear` that computes a few float32 rows on CPU as ``(W @ x^T)^T``, one row padded to two.

    Decode steps multiply 1-8 rows by every weight. For those shapes MKL's ``x @ W^T`` (what
    ``F.linear`` runs) falls far below memory bandwidth on the AMD EPYC we test on, while the same
    product written ``W @ x^T`` with at least two columns takes its fast small-N GEMM path: the whole
    SmolLM2-135M decode forward without attention drops from ~54 ms to ~37 ms per token at one row,
    and the 49,152 x 576 LM head from 9.9 ms to 5.8 ms (1 row) and 19.2 ms to 14.5 ms (8 rows).
    Results equal ``F.linear`` up to float32 summation order. Other devices, dtypes and larger
    batches use ``F.linear``; so do more than ``small_rows`` rows. The crossover, measured per weight
    shape (30 weights each, ``F.linear`` vs this): ``W @ x^T`` wins up to 5-6 rows when the input is
    narrow (576 features: 28.3 vs 20.4 ms at 5 rows for gate/up), only up to 2 rows for the down
    projection's 1,536 features (11.1 vs 13.2 ms at 3 rows), and up to 8 rows for the LM head.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, small_rows: int | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.small_rows = small_rows if small_rows is not None else (6 if in_features <= 1024 else 2)
        self.split_k = 1  # on CUDA, >1 runs 2-D inputs as `split_k_linear` with that many chunks

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        if self.split_k > 1 and x.is_cuda and x.dim() == 2:
            y = split_k_linear(x, self.weight, self.split_k)
            return y if self.bias is None else y + self.bias
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or rows > self.small_rows:
            return F.linear(x, self.weight, self.bias)
        cols = torch.cat((x, x)) if rows == 1 else x
        y = torch.mm(self.weight, cols.t())[:, :rows].t().contiguous()
        return y if self.bias is None else y + self.bias


def split_k_chunk(n_in: int, splits: int) -> int:
    """The input features of each of `split_k_linear`'s ``splits`` chunks; a ValueError if they do not
    divide evenly."""
    if n_in % splits:
        raise ValueError(f"{n_in} input features do not split into {splits} chunks")
    return n_in // splits


def split_k_linear(x: Tensor, w: Tensor, splits: int) -> Tensor:
    """``F.linear(x, w)`` as ``splits`` products over consecutive chunks of the input features, run as one
    strided batched product (no copies) into float32 partials, then summed and cast to ``x``'s dtype.

    At the 8B geometry cuBLAS runs a decode step's down product (256 rows, 14,336 inputs, 4,096
    outputs) as one wave of 128 output tiles, each with a long inner loop; splitting the inputs gives
    it ``splits`` times the tiles. Measured on an H100 it is slower, not faster (docs/engine.md,
    "Split-K by hand"), so `Linear.split_k` stays 1 in the engine. On CUDA the partials come straight
    from the product's float32 accumulator (``out_dtype``); elsewhere the inputs are taken to float32
    first (the tests' path)."""
    rows, n_in = x.shape
    k = split_k_chunk(n_in, splits)
    xs = x.view(rows, splits, k).transpose(0, 1)  # [S, rows, k]
    ws = w.view(w.shape[0], splits, k).transpose(0, 1).transpose(1, 2)  # [S, k, out]
    partials = torch.bmm(xs, ws, out_dtype=torch.float32) if x.is_cuda else torch.bmm(xs.float(), ws.float())
    return partials.sum(0).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if fused.applies(x) and x.dim() == 2 and self.weight.dtype == x.dtype:
            return fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # same values as below, fewer ops
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: Tensor, delta: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The residual add and the norm of its result: ``(x + delta, self(x + delta))``, one kernel on
        CUDA (`fused.add_rms_norm`); the sum is written into ``out`` if given."""
        if fused.applies(x) and x.dim() == 2 and self.weight.dtype == x.dtype:
            return fused.add_rms_norm(x, delta, self.weight, self.eps, out)
        total = x + delta if out is None else torch.add(x, delta, out=out)
        return total, self(total)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D]; cos/sin [T, 1, D]. Half-split ("rotate_half", NeoX) layout, as in transformers."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.q_heads, self.kv_heads, self.head_dim = cfg.q_heads, cfg.kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.splits = [q_dim + kv_dim, kv_dim]  # q and k side by side: RoPE runs on both at once
        self.wqkv = Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.wo = Linear(q_dim, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # [Hkv, D] subtracted from every key after RoPE (a load-time plan's key centering): softmax ignores
        # a shift shared by all keys of a query, so attention is unchanged while the cache stores keys
        # without their large per-channel offsets.
        self.key_center: Tensor | None = None

    def project(
        self, x: Tensor, cos: Tensor, sin: Tensor, out: tuple[Tensor, Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q [T, Hq, D], k, v [T, Hkv, D] after q/k-norm and RoPE, written into ``out`` if given (the
        CUDA graphs' static buffers). On CUDA RoPE and the split are one kernel (`fused.rope_qkv`)."""
        T, hq = x.shape[0], self.q_heads
        qk, v = self.wqkv(x).split(self.splits, dim=-1)
        qk = qk.view(T, hq + self.kv_heads, self.head_dim)
        v = v.view(T, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)
        if fused.applies(qk) and cos.dtype == qk.dtype:
            q, k, v = fused.rope_qkv(qk, v, cos, sin, hq, out)
            if self.key_center is not None:
                k.sub_(self.key_center)  # k is the kernel's output: a new tensor or the caller's buffer
            return q, k, v
        qk = apply_rope(qk, cos, sin)
        k = qk[:, hq:] if self.key_center is None else qk[:, hq:] - self.key_center
        if out is None:
            return qk[:, :hq], k, v
        for dst, src in zip(out, (qk[:, :hq], k, v), strict=True):
            dst.copy_(src)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # gate, up
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)  # down

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.w13(x)
        if fused.applies(gate_up) and gate_up.dim() == 2:
            return self.w2(fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    # A layer as two halves around attention, for `Transformer.forward` and the CUDA graphs' pieces
    # (cuda_graph.py): the residual add of a layer's MLP output is the next layer's first kernel.
    def pre_attn(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        delta: Tensor | None = None,
        out: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer up to attention: the residual stream and q, k, v. ``delta`` (the previous layer's
        MLP output, see `post_attn`) is added to ``x`` first, in one kernel with the norm on CUDA;
        ``out`` (residual, q, k, v) are buffers to write into."""
        x_out, qkv_out = (None, None) if out is None else (out[0], out[1:])
        if delta is not None:
            x, h = self.attn_norm.add_forward(x, delta, out=x_out)
        else:
            if x_out is not None:
                x = x_out.copy_(x)
            h = self.attn_norm(x)
        return (x, *self.attn.project(h, cos, sin, out=qkv_out))  # type: ignore[arg-type]

    def post_attn(self, x: Tensor, attn_out: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` [T, hidden] plus the output projection of ``attn_out`` [T, Hq, D], and the MLP's
        output on it, not yet added: the layer's output is their sum (the next `pre_attn`'s ``delta``)."""
        x, h = self.mlp_norm.add_forward(x, self.attn.wo(attn_out.reshape(x.shape[0], -1)))
        return x, self.mlp(h)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, small_rows=8)
        inv_freq, self.rope_factor = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq.to(device="cpu"), persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def set_key_centers(self, centers: Tensor | None) -> None:
        """Subtract ``centers[layer]`` [L, Hkv, D] from each layer's keys after RoPE (None: stop)."""
        cfg = self.config
        if centers is not None and tuple(centers.shape) != (cfg.num_layers, cfg.kv_heads, cfg.head_dim):
            raise ValueError(
                f"key centers of shape {tuple(centers.shape)} do not fit this model "
                f"({cfg.num_layers} layers, {cfg.kv_heads} KV heads of {cfg.head_dim})"
            )
        for i, layer in enumerate(self.layers):
            c = None if centers is None else centers[i].to(device=self.device, dtype=self.dtype)
            layer.attn.key_center = c

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, head_dim] in the compute dtype, computed in float32 as transformers does."""
        inv_freq = self.inv_freq.float()  # stays float32 even after a careless net.to(bfloat16)
        scaling = self.config.rope_scaling or {}
        if scaling.get("rope_type") == "dynamic":
            seq_len = int(positions.max()) + 1
            if seq_len > self.config.max_position_embeddings:
                inv_freq = rope_inv_freq(self.config, seq_len)[0].to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos() * self.rope_factor, emb.sin() * self.rope_factor
        return cos.to(self.dtype), sin.to(self.dtype)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttnFn,
        logits_at: Tensor | None = None,
        embeds: Tensor | None = None,
    ) -> Tensor:
        """input_ids, positions [T] (a flattened varlen batch) -> float32 logits [len(logits_at) or T, V].

        ``embeds`` [T, hidden] replaces the token embeddings (image features spliced in by the caller).
        """
        x = self.embed(input_ids) if embeds is None else embeds
        cos, sin = self.rope(positions)
        # Each layer's MLP output is added to the residual stream by the next norm's kernel (as in the
        # CUDA graphs' pieces): the same sums, one pass over the stream fewer a layer.
        delta: Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, q, k, v = layer.pre_attn(x, cos, sin, delta)
            x, delta = layer.post_attn(x, attn(i, q, k, v))
        if logits_at is not None:
            x = x[logits_at]
            delta = None if delta is None else delta[logits_at]
        h = self.norm(x) if delta is None else self.norm.add_forward(x, delta)[1]
        return self.lm_head(h).float()

    # ------------------------------------------------------------------ reference paths, no cache
    @staticmethod
    def dense_attn_for(seq_lens: Sequence[int]) -> AttnFn:
        """Callback with plain causal attention over each of the concatenated sequences of ``seq_lens``.

        Each sequence attends to its own tokens only, as if it were prefilled from position 0.
        """
        lens = [int(n) for n in seq_lens]

        def attn(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if sum(lens) != q.shape[0]:
                raise ValueError(f"dense_attn_for({lens}) got {q.shape[0]} tokens")
            outs = [
                causal_attention(qi, ki, vi)
                for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens), strict=True)
            ]
            return torch.cat(outs) if len(outs) > 1 else outs[0]

        return attn

    def dense_forward(self, input_ids: Tensor, logits_from: int = 0) -> Tensor:
        """input_ids [B, T] -> float32 logits [B, T - logits_from, vocab] of positions logits_from..T-1;
        positions 0..T-1, causal SDPA, no cache. ``logits_from`` keeps the logits (vocab-wide, float32)
        of a long prompt from being computed when only its tail is scored."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).repeat(B)

        def attn(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            def heads_first(t: Tensor) -> Tensor:
                return t.view(B, T, *t.shape[1:]).transpose(1, 2)

            out = F.scaled_dot_product_attention(
                heads_first(q), heads_first(k), heads_first(v), is_causal=True, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(B * T, *q.shape[1:])

        at = None
        if logits_from:
            at = (
                torch.arange(B, device=input_ids.device).view(B, 1) * T
                + torch.arange(logits_from, T, device=input_ids.device)
            ).view(-1)
        return self(input_ids.reshape(-1), positions, attn, logits_at=at).view(B, T - logits_from, -1)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Plain causal attention of one sequence: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    # 4-D inputs: with 3-D ones the CPU backend falls back to the (3.7x slower) math kernel
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)
