"""The memory plan: how many cold pages the KV pool gets, and a table of where the bytes go.

CUDA, with ``mem_fraction_static`` in SGLang's meaning (the share of *total* GPU memory for the static
part: weights and KV pools), measured after the weights are loaded:

    static_left = free_after_weights - total * (1 - mem_fraction_static)
    cold pool   = static_left - ring - sinks - workspace - cuda_graphs

Like SGLang this reads the driver's free memory, so memory held by other processes is never promised
to the pool. The ring (every running slot's BF16 window), the sink pages and the per-step workspace
are sized by ``max_running_requests`` and the chunk size, so they come off the top; the cold pool
takes the rest. ``max_total_tokens`` wins over the fraction. On CPU the pool keeps its fixed default
(16,384 tokens, or ``mem_fraction_static`` of MemAvailable) unless ``max_total_tokens`` is given.

Byte counts of the ring, sinks and cold pool are exact (null rows included): they equal what
`StratifiedKVCache` allocates. The workspace is an upper estimate of one step's activations (see
`step_workspace_bytes`); the engine does not preallocate it yet, so the plan holds it back.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kvstrata.engine.config import ModelConfig
from kvstrata.engine.options import EngineArgs, pool_pages
from kvstrata.radix.config import CacheConfig
from kvstrata.radix.pool import cold_page_bytes

log = logging.getLogger("kvstrata.engine")
DEFAULT_CUDA_MEM_FRACTION_STATIC = 0.85
GIB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int


def read_device_memory(device: torch.device) -> DeviceMemory:
    """The driver's reading, after handing cached blocks back (loading leaves conversion copies
    in torch's cache, which the driver counts as used)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=int(total), free=int(free))


def weight_bytes(net: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers, each storage counted once (tied embeddings)."""
    seen: dict[int, int] = {}
    for t in [*net.parameters(), *net.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def ring_bytes(cfg: CacheConfig) -> int:
    """`HotRing`: K and V, every layer, ``max_running`` slots of ``ring_tokens`` rows + the null row."""
    elem = torch.empty((), dtype=cfg.ring_dtype).element_size()
    return 2 * cfg.num_layers * (cfg.max_running * cfg.ring_tokens + 1) * cfg.kv_heads * cfg.head_dim * elem


def sink_bytes(cfg: CacheConfig) -> int:
    """`SinkStore`: K and V, every layer, ``sink_pages`` pages + the null slot (0 without sinks)."""
    if not cfg.sinks:
        return 0
    elem = torch.empty((), dtype=cfg.ring_dtype).element_size()
    pages = (cfg.sink_pages or 0) + 1
    return 2 * cfg.num_layers * pages * cfg.page_size * cfg.kv_heads * cfg.head_dim * elem


def step_workspace_bytes(
    model: ModelConfig, cache: CacheConfig, chunked_prefill_size: int, dtype: torch.dtype
) -> int:
    """Upper estimate of one step's live activations at its largest: a full prefill chunk next to
    every running decode (``T = chunked_prefill_size + max_running`` tokens).

    - hidden states: residual, normed input, attention output (3 x hidden), fused q/k/v, and the
      MLP's gate/up output plus its product (3 x intermediate), per token, in the compute dtype;
    - logits of every running sequence in float32 and the sampler's three same-sized temporaries
      (probabilities, a sorted copy, int64 sort indices counted as two float32 rows);
    - attention scores in float32 (and their softmax) of the chunk's queries over one block of
      history (``block_pages`` cold pages, a sink page, the ring) plus the chunk itself, with that
      block's keys and values dequantized in the compute dtype.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = chunked_prefill_size + cache.max_running
    qkv = (model.q_heads + 2 * model.kv_heads) * model.head_dim
    hidden = tokens * (3 * model.hidden_size + qkv + 3 * model.intermediate_size) * elem
    logits = cache.max_running * model.vocab_size * 4 * 5
    keys = cache.block_pages * cache.page_size + cache.page_size + cache.ring_tokens + chunked_prefill_size
    scores = 2 * model.q_heads * chunked_prefill_size * keys * 4
    history = 2 * keys * model.kv_heads * model.head_dim * elem
    return hidden + logits + scores + history


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    source: str  # what set the pool size: "max_total_tokens", "cpu default", "mem_fraction_static"
    cold_pages: int
    page_size: int
    cold_page_bytes: int
    weight_bytes: int
    ring_bytes: int
    sink_bytes: int
    workspace_bytes: int
    cuda_graph_bytes: int = 0
    total_bytes: int | None = None  # device memory (CUDA)
    free_bytes: int | None = None  # free after the weights (CUDA)
    mem_fraction_static: float | None = None

    @property
    def cold_tokens(self) -> int:
        return self.cold_pages * self.page_size

    @property
    def cold_bytes(self) -> int:
        """The pool's buffers: ``cold_pages`` pages and the null page."""
        return (self.cold_pages + 1) * self.cold_page_bytes

    @property
    def reserved_bytes(self) -> int | None:
        """Left outside the static part for transient allocations (``total * (1 - fraction)``)."""
        if self.total_bytes is None or self.mem_fraction_static is None:
            return None
        return int(self.total_bytes * (1.0 - self.mem_fraction_static))

    def rows(self) -> list[tuple[str, str, str]]:
        def gib(n: int) -> str:
            return f"{n / GIB:.3f} GiB"

        held = ", held back" if self.source == "mem_fraction_static" else ""
        rows = [
            ("weights", gib(self.weight_bytes), f"{self.weight_bytes:,} B"),
            ("cold pool", gib(self.cold_bytes), f"{self.cold_tokens:,} tokens ({self.cold_pages:,} pages)"),
            ("ring", gib(self.ring_bytes), f"{self.ring_bytes:,} B"),
            ("sinks", gib(self.sink_bytes), f"{self.sink_bytes:,} B"),
            ("workspace", gib(self.workspace_bytes), "estimate" + held),
            (
                "cuda graphs",
                gib(self.cuda_graph_bytes),
                "estimate" + held if self.cuda_graph_bytes else "not captured",
            ),
        ]
        if self.total_bytes is not None and self.reserved_bytes is not None:
            fraction = f"1 - mem_fraction_static ({self.mem_fraction_static})"
            rows.append(("reserved", gib(self.reserved_bytes), fraction))
            free = f"free after weights: {gib(self.free_bytes or 0)}"
            rows.append(("device total", gib(self.total_bytes), free))
        return rows

    def table(self) -> str:
        lines = [f"memory plan on {self.device} (pool size from {self.source})"]
        lines += [f"  {name:<13}{size:>14}  {detail}" for name, size, detail in self.rows()]
        return "\n".join(lines)


def plan_memory(
    args: EngineArgs,
    model: ModelConfig,
    cache: CacheConfig,
    weights: int,
    dtype: torch.dtype,
    device: torch.device,
    reading: DeviceMemory | None = None,
    cuda_graph_bytes: int = 0,
) -> MemoryPlan:
    """The cold pool size for ``cache`` (its ``num_pages`` is ignored). On CUDA ``reading`` is the
    device memory after the weights are loaded (read from the driver when None)."""
    page_bytes = cold_page_bytes(cache.layer_codecs, cache.page_size, cache.kv_heads, cache.head_dim)
    plan = MemoryPlan(
        device=str(device),
        source="max_total_tokens",
        cold_pages=0,
        page_size=cache.page_size,
        cold_page_bytes=page_bytes,
        weight_bytes=weights,
        ring_bytes=ring_bytes(cache),
        sink_bytes=sink_bytes(cache),
        workspace_bytes=step_workspace_bytes(model, cache, args.chunked_prefill_size, dtype),
        cuda_graph_bytes=cuda_graph_bytes,
    )
    if args.max_total_tokens is not None or device.type != "cuda":
        source = "max_total_tokens" if args.max_total_tokens is not None else "cpu default"
        if args.max_total_tokens is None and args.mem_fraction_static is not None:
            source = "mem_fraction_static of MemAvailable"
        return dataclasses.replace(plan, source=source, cold_pages=pool_pages(args, device, page_bytes))
    reading = reading or read_device_memory(device)
    fraction = args.mem_fraction_static or DEFAULT_CUDA_MEM_FRACTION_STATIC
    plan = dataclasses.replace(
        plan,
        source="mem_fraction_static",
        total_bytes=reading.total,
        free_bytes=reading.free,
        mem_fraction_static=fraction,
    )
    assert plan.reserved_bytes is not None
    static_left = reading.free - plan.reserved_bytes
    held = plan.ring_bytes + plan.sink_bytes + plan.workspace_bytes + plan.cuda_graph_bytes
    pages = (static_left - held) // page_bytes - 1  # the null page
    if pages < 1:
        raise ValueError(
            f"no memory left for the KV cache: {static_left / GIB:.2f} GiB free for static use "
            f"(free after weights {reading.free / GIB:.2f} GiB minus {1 - fraction:.2f} of "
            f"{reading.total / GIB:.2f} GiB) and ring + sinks + workspace need {held / GIB:.2f} GiB; "
            "raise --mem-fraction-static or lower --max-running-requests\n" + plan.table()
        )
    return dataclasses.replace(plan, cold_pages=int(pages))
