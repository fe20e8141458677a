"""Piecewise CUDA graphs for decode steps (vLLM's approach): dense parts in graphs, attention eager.

A decode step launches a few dozen small kernels per layer from Python; at batch 1 the GPU waits on
the launches. The dense parts of the step are captured once per bucketed batch size and replayed:

    piece 0      embedding, RoPE cos/sin, layer 0 up to q/k/v (norm, QKV projection, q/k-norm, RoPE)
    piece i      layer i-1 after attention (output projection, residual, MLP) and layer i up to q/k/v
    piece L      layer L-1 after attention, the final norm and the LM head (float32 logits)

Between pieces, attention and the KV store run eagerly on the step's plan: they read page tables,
ring rows and flush completed pages, whose shapes change every step. Pieces exchange data through
static buffers (token ids, positions, residual stream, cos/sin, q/k/v, attention output, logits)
sized for the largest bucket; a batch is padded to its bucket (pad rows are computed and ignored:
every dense op is row-wise). All graphs share one memory pool, so their temporaries can share memory:
no graph reads a tensor another graph left in the pool (everything between them goes through the static
buffers), so their replay order does not matter. The whole-step graphs (`full_graph.py`) capture into
the same pool when they keep these pieces for steps over image or raised pages.

`DecodePieces` is the same split run eagerly, and `DecodeGraphs.use_pieces` runs it on the static
buffers in place of the replays: buffers, padding and buckets run on any device and are tested on CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from kvstrata.engine.config import ModelConfig
from kvstrata.engine.model import AttnFn, Transformer

log = logging.getLogger("kvstrata.engine")
FIRST_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8  # after 8: 16, 24, 32, ... as SGLang captures
ALLOCATOR_SLACK = 64 << 20  # the caching allocator's segment rounding (2 MiB blocks and up)
Buffers = tuple[Tensor, Tensor, Tensor, Tensor]  # residual stream x, q, k, v


def capture_sizes(max_bs: int) -> list[int]:
    """Bucketed batch sizes up to ``max_bs``: 1, 2, 4, 8, 16, 24, 32, ... and ``max_bs`` itself."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [s for s in (*FIRST_SIZES, *range(16, max_bs + 1, SIZE_STEP)) if s <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def graph_unsupported(net: Transformer) -> str | None:
    """Why this model's decode step cannot be captured, or None."""
    scaling = net.config.rope_scaling or {}
    if scaling.get("rope_type") == "dynamic":
        return "dynamic RoPE reads the largest position on the host every step"
    return None


def graph_memory_bytes(cfg: ModelConfig, max_bs: int, dtype: torch.dtype) -> int:
    """Upper estimate of what the graphs hold at ``max_bs`` rows, for the memory plan: the static
    buffers plus the shared pool, which keeps the temporaries of the largest piece (the LM head's
    logits in the model dtype and in float32, the MLP's gate/up and product, a few residual-sized
    and q/k/v-sized tensors)."""
    es = torch.empty((), dtype=dtype).element_size()
    qkv = (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim
    static = (
        16 + es * (cfg.hidden_size + 2 * cfg.head_dim + qkv + cfg.q_heads * cfg.head_dim) + 4 * cfg.vocab_size
    )
    pool = es * cfg.vocab_size + 4 * cfg.vocab_size + es * 4 * cfg.intermediate_size
    pool += 4 * 8 * cfg.hidden_size + es * 4 * qkv
    return max_bs * (static + pool) + ALLOCATOR_SLACK


def graphs_wanted(net: Transformer, disable: bool) -> bool:
    """Whether the engine captures decode graphs for ``net``: on CUDA unless disabled or unsupported."""
    if disable or net.device.type != "cuda":
        return False
    why = graph_unsupported(net)
    if why is not None:
        log.info("CUDA graphs off: %s", why)
    return why is None


class DecodePieces:
    """The decode forward cut at attention: ``first``, ``middle(i)`` for i in 1..L-1, ``last``."""

    def __init__(self, net: Transformer) -> None:
        self.net = net
        self.num_layers = len(net.layers)

    def first(
        self, ids: Tensor, positions: Tensor, out: Buffers | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """-> residual x, cos, sin, q, k, v of layer 0; x, q, k, v written into ``out`` if given."""
        x = self.net.embed(ids)
        cos, sin = self.net.rope(positions)
        x, q, k, v = self.net.layers[0].pre_attn(x, cos, sin, out=out)
        return x, cos, sin, q, k, v

    def middle(
        self, layer: int, x: Tensor, attn_out: Tensor, cos: Tensor, sin: Tensor, out: Buffers | None = None
    ) -> Buffers:
        """Layer ``layer - 1`` after attention, then layer ``layer`` up to attention: x, q, k, v (the
        residual add between them fused with the norm on CUDA), written into ``out`` if given."""
        x, mlp_out = self.net.layers[layer - 1].post_attn(x, attn_out)
        return self.net.layers[layer].pre_attn(x, cos, sin, delta=mlp_out, out=out)

    def last(self, x: Tensor, attn_out: Tensor) -> Tensor:
        return self.last_logits(x, attn_out).float()

    def last_logits(self, x: Tensor, attn_out: Tensor) -> Tensor:
        """`last` in the model dtype (the graphs' float32 buffer takes them in one converting copy)."""
        x, mlp_out = self.net.layers[-1].post_attn(x, attn_out)
        return self.net.lm_head(self.net.norm.add_forward(x, mlp_out)[1])

    def forward(self, ids: Tensor, positions: Tensor, attn: AttnFn) -> Tensor:
        """The pieces chained eagerly: float32 logits of every row, as ``net(ids, positions, attn)``."""
        x, cos, sin, q, k, v = self.first(ids, positions)
        for layer in range(1, self.num_layers):
            x, q, k, v = self.middle(layer, x, attn(layer - 1, q, k, v), cos, sin)
        return self.last(x, attn(self.num_layers - 1, q, k, v))


def release_warmup_blocks() -> None:
    """Hand the allocator's free cached blocks back to the driver after a capture (every stream's; those
    of the warm-up runs' temporaries on the capture's side stream, which no other stream reuses, among
    them). The graphs' own memory is in their pool, which this does not touch. The warm-up and the
    capture run on one side stream, so cuBLAS makes its workspace for it once, in the warm-up (kept
    alive by cuBLAS's per-stream map: the graphs hold its address), and none inside the graphs' pool."""
    torch.cuda.empty_cache()


class DecodeGraphs:
    """Captured pieces per bucketed batch size; `run` replays them around eager attention."""

    def __init__(self, net: Transformer, max_bs: int) -> None:
        why = graph_unsupported(net)
        if why is not None:
            raise ValueError(f"CUDA graphs: {why}")
        self.pieces = DecodePieces(net)
        self.sizes = capture_sizes(max_bs)
        cfg, dev, dt = net.config, net.device, net.dtype
        B, D = self.sizes[-1], cfg.head_dim
        with torch.inference_mode():
            self.inputs = torch.zeros((2, B), dtype=torch.long, device=dev)  # token ids, positions
            # two pinned staging buffers, used in turn: under overlap scheduling the host writes
            # step N+1's ids before it waits for step N, whose copy may still be reading the other
            self.host = torch.zeros((2, 2, B), dtype=torch.long, pin_memory=dev.type == "cuda")
            self.x = torch.zeros((B, cfg.hidden_size), dtype=dt, device=dev)
            self.cos = torch.zeros((B, 1, D), dtype=dt, device=dev)
            self.sin = torch.zeros((B, 1, D), dtype=dt, device=dev)
            self.q = torch.zeros((B, cfg.q_heads, D), dtype=dt, device=dev)
            self.k = torch.zeros((B, cfg.kv_heads, D), dtype=dt, device=dev)
            self.v = torch.zeros((B, cfg.kv_heads, D), dtype=dt, device=dev)
            self.attn_out = torch.zeros((B, cfg.q_heads, D), dtype=dt, device=dev)
            self.logits = torch.zeros((B, cfg.vocab_size), dtype=torch.float32, device=dev)
        self._host_np = self.host.numpy()
        self._turn = 0
        # Per bucket: what runs each piece (a captured graph's replay, or the piece itself).
        self.graphs: dict[int, list[Callable[[], None]]] = {}
        self.replayed_steps = 0

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int | None:
        """The smallest captured size >= n, or None (run eager)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    # --- the pieces on the static buffers -------------------------------------------------------------
    def _outs(self, bs: int) -> Buffers:
        """Where the pieces write the residual stream and q, k, v: the static buffers' first rows."""
        return self.x[:bs], self.q[:bs], self.k[:bs], self.v[:bs]

    def _first(self, bs: int) -> None:
        _, cos, sin, *_ = self.pieces.first(self.inputs[0, :bs], self.inputs[1, :bs], out=self._outs(bs))
        self.cos[:bs].copy_(cos)
        self.sin[:bs].copy_(sin)

    def _middle(self, layer: int, bs: int) -> None:
        # reads the residual stream from self.x and writes the next one there: post_attn's sum is a
        # new tensor, computed before pre_attn writes
        self.pieces.middle(
            layer, self.x[:bs], self.attn_out[:bs], self.cos[:bs], self.sin[:bs], out=self._outs(bs)
        )

    def _last(self, bs: int) -> None:
        self.logits[:bs].copy_(self.pieces.last_logits(self.x[:bs], self.attn_out[:bs]))

    def _piece_fns(self, bs: int) -> list[Callable[[], None]]:
        middles = [lambda layer=layer: self._middle(layer, bs) for layer in range(1, self.pieces.num_layers)]
        return [lambda: self._first(bs), *middles, lambda: self._last(bs)]

    # --- capture and replay ---------------------------------------------------------------------------
    def use_pieces(self) -> None:
        """Run the pieces eagerly on the static buffers instead of replaying graphs (any device)."""
        self.graphs = {bs: self._piece_fns(bs) for bs in self.sizes}

    @torch.inference_mode()
    def capture(self, pool: Any = None, stream: torch.cuda.Stream | None = None) -> None:
        """Capture every bucket, largest first (later, smaller graphs reuse the pool's blocks), into
        ``pool`` (a `torch.cuda.graph_pool_handle`; default a new one), warm-up and capture on
        ``stream`` (default a new side stream)."""
        if self.x.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        stream = torch.cuda.Stream() if stream is None else stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: cuBLAS handles and workspaces exist before capture
            for bs in (self.sizes[-1], self.sizes[0]):
                for _ in range(2):
                    for fn in self._piece_fns(bs):
                        fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for bs in reversed(self.sizes):
            replays = []
            for fn in self._piece_fns(bs):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    fn()
                replays.append(graph.replay)
            self.graphs[bs] = replays
        torch.cuda.synchronize()
        release_warmup_blocks()

    def load_inputs(
        self, ids: Sequence[int], positions: Sequence[int], fill: Callable[[Tensor], None] | None
    ) -> int:
        """Put a step's token ids and positions into the static input buffer; returns their count.
        ``fill`` writes the ids that are still on the device (overlap scheduling)."""
        n = len(ids)
        # Pinned staging, copied without a host sync; the sampler's read-back of step N (at the end
        # of step N, or after step N+1 is launched) orders this copy before step N+2 reuses the buffer.
        turn = self._turn
        self._turn ^= 1
        self._host_np[turn, 0, :n] = ids
        self._host_np[turn, 1, :n] = positions
        for row in range(2):
            self.inputs[row, :n].copy_(self.host[turn, row, :n], non_blocking=True)
        if fill is not None:
            fill(self.inputs[0, :n])
        return n

    def step(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        batch: Any,
        bind: Callable[[Any], AttnFn],
        fill: Callable[[Tensor], None] | None = None,
    ) -> Tensor | None:
        """One decode step over ``batch`` (the step's plan) with the attention ``bind(batch)`` makes:
        float32 logits ``[n, V]`` (see `run`), or None if the step must run eager (never here: the
        full graph's `FullDecodeGraphs.step` may)."""
        return self.run(ids, positions, bind(batch), fill, writes_out=True)

    def run(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        attn: AttnFn,
        fill: Callable[[Tensor], None] | None = None,
        writes_out: bool = False,
    ) -> Tensor:
        """One decode step of ``len(ids)`` <= max_bs sequences (one new token each): float32 logits
        ``[n, V]``, a view of the static buffer valid until the next step. ``fill`` writes the ids
        that are still on the device into the step's id buffer (overlap scheduling). ``writes_out``:
        ``attn`` takes ``out=``, the static attention output, and writes it (the cache backends of
        `kvstrata.engine.attention`), else its result is copied there."""
        n = len(ids)
        bs = self.bucket(n)
        if bs is None:
            raise ValueError(f"decode batch {n} exceeds the largest captured size {self.max_bs}")
        self.load_inputs(ids, positions, fill)
        pieces = self.graphs[bs]
        q, k, v, attn_out = self.q[:n], self.k[:n], self.v[:n], self.attn_out[:n]
        pieces[0]()
        for layer in range(self.pieces.num_layers):
            if writes_out:
                attn(layer, q, k, v, out=attn_out)  # type: ignore[call-arg]
            else:
                attn_out.copy_(attn(layer, q, k, v))
            pieces[layer + 1]()
        self.replayed_steps += 1
        return self.logits[:n]


def decode_graphs_for(net: Transformer, disable: bool, max_bs: int) -> DecodeGraphs | None:
    """Captured graphs for ``net``'s decode steps, or None: disabled, not on CUDA, or unsupported."""
    if not graphs_wanted(net, disable):
        return None
    start = time.perf_counter()
    graphs = DecodeGraphs(net, max_bs)
    graphs.capture()
    log.info(
        "captured decode CUDA graphs for batch sizes %s in %.1f s",
        graphs.sizes,
        time.perf_counter() - start,
    )
    return graphs
