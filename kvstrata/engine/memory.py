"""The memory plan: how many cold pages the KV pool gets, and a table of where the bytes go.

CUDA, with ``mem_fraction_static`` in SGLang's meaning (the share of *total* GPU memory for the static
part: weights and KV pools), measured after the weights are loaded:

    static_left = free_after_weights - total * (1 - mem_fraction_static)
    cold pool   = static_left - ring - sinks - workspace - cuda_graphs

Like SGLang this reads the driver's free memory, so memory held by other processes is never promised
to the pool. The ring (every running slot's BF16 window), the sink pages and the per-step workspace
are sized by ``max_running_requests`` and the chunk size, so they come off the top; the cold pool
takes the rest. The workspace depends on the attention backend: the torch reference materializes
scores and a dequantized block of history, the Triton kernels neither. ``max_total_tokens`` wins
over the fraction. On CPU the pool keeps its fixed default (16,384 tokens, or
``mem_fraction_static`` of MemAvailable) unless ``max_total_tokens`` is given.

A vision model with image pages in a codec of their own (``--vision-kv-dtype``) gets an image pool
(`ImagePoolNeed`): the pin budget in image pages plus the image spans of the running requests. On CUDA
it comes out of the same static bytes, so the cold pool shrinks by its bytes (the default pin budget is
a quarter of the cold pool's bytes: the largest cold pool whose image pool still fits is taken); with
``max_total_tokens`` or on CPU the cold pool keeps its size and the image pool is added to it.

With the drift monitor's precision raise on, a raised pool (text pages in wider codecs, written while the
fallback is raised) takes ``drift_raise_share`` of the cold pool's bytes out of it (`with_raised_pool`):
the two together never hold more bytes than the cold pool alone would have.

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
from kvstrata.radix.ring import PADDING_ROWS

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
    """`HotRing`: K and V, every layer, ``max_running`` slots of ``ring_tokens`` rows + the null and
    scratch rows."""
    elem = torch.empty((), dtype=cfg.ring_dtype).element_size()
    rows = cfg.max_running * cfg.ring_tokens + PADDING_ROWS
    return 2 * cfg.num_layers * rows * cfg.kv_heads * cfg.head_dim * elem


def sink_bytes(cfg: CacheConfig) -> int:
    """`SinkStore`: K and V, every layer, ``sink_pages`` pages + the null slot (0 without sinks)."""
    if not cfg.sinks:
        return 0
    elem = torch.empty((), dtype=cfg.ring_dtype).element_size()
    pages = (cfg.sink_pages or 0) + 1
    return 2 * cfg.num_layers * pages * cfg.page_size * cfg.kv_heads * cfg.head_dim * elem


def step_workspace_bytes(
    model: ModelConfig,
    cache: CacheConfig,
    chunked_prefill_size: int,
    dtype: torch.dtype,
    attention_kernels: bool = False,
    cold_passes: int = 1,
) -> int:
    """Upper estimate of one step's live activations at its largest: a full prefill chunk next to
    every running decode (``T = chunked_prefill_size + max_running`` tokens).

    - hidden states: residual, normed input, attention output (3 x hidden), fused q/k/v, and the
      MLP's gate/up output plus its product (3 x intermediate), per token, in the compute dtype;
    - logits of every running sequence in float32 and the sampler's three same-sized temporaries
      (probabilities, a sorted copy, int64 sort indices counted as two float32 rows);
    - attention, torch reference backend: scores in float32 (and their softmax) of the chunk's
      queries over one block of history (``block_pages`` cold pages, a sink page, the ring) plus
      the chunk itself, with that block's keys and values dequantized in the compute dtype;
    - attention, Triton kernels (``attention_kernels``): no scores; the split-KV partials of
      ``cold_passes`` kernel passes a layer (`split_partial_bytes`), and the coded history an extend
      pass dequantizes first, at most `attend.EXTEND_DEQUANT`'s ``dequant_bytes`` (decode reads codes
      in registers); these live inside a layer's attention, the logits after the last layer, so the
      larger of the two counts. (With the reference's term an 8,192-token chunk held back 18.6 GiB
      that the kernels never use.)
    """
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = chunked_prefill_size + cache.max_running
    qkv = (model.q_heads + 2 * model.kv_heads) * model.head_dim
    hidden = tokens * (3 * model.hidden_size + qkv + 3 * model.intermediate_size) * elem
    logits = cache.max_running * model.vocab_size * 4 * 5
    if attention_kernels:
        from kvstrata.radix.kernels.attend import EXTEND_DEQUANT

        # Partials and dequantized history live inside a layer's attention, logits and the sampler's
        # temporaries after the last layer: the step's peak holds the larger of the two.
        partials = split_partial_bytes(model, cache.max_running, chunked_prefill_size, cold_passes)
        return hidden + max(logits, partials + EXTEND_DEQUANT["dequant_bytes"])
    keys = cache.block_pages * cache.page_size + cache.page_size + cache.ring_tokens + chunked_prefill_size
    scores = 2 * model.q_heads * chunked_prefill_size * keys * 4
    history = 2 * keys * model.kv_heads * model.head_dim * elem
    return hidden + logits + scores + history


def split_target_programs() -> int:
    """The largest ``programs`` target of the Triton decode launches (`kvstrata.radix.kernels.attend`):
    the most programs a split-KV decode launch runs."""
    from kvstrata.radix.kernels.attend import DECODE_LAUNCH, FP8_WIDE_DECODE, INT8_DECODE, OTHER_4BIT_DECODE

    launches = (*DECODE_LAUNCH.values(), OTHER_4BIT_DECODE, FP8_WIDE_DECODE, INT8_DECODE)
    return max(launch["programs"] for launch in launches)


def split_partial_bytes(
    model: ModelConfig, max_running: int, chunked_prefill_size: int, cold_passes: int = 1
) -> int:
    """Upper bound of the Triton kernels' split partials in one layer's attention: a float32 output
    row and log-sum-exp per (row, query head, split) of each of the layer's ``cold_passes`` kernel
    passes (the text pool's, then the image pool's and the raised pool's where the engine has them).

    A decode launch runs ``B * kv_heads`` programs per split and splits only while that stays within
    its ``programs`` target (`split_target_programs`), so ``rows * splits < B + target / kv_heads``.
    An extend launch does not split, but with more than one pass every pass writes partials for all of
    its rows (up to a prefill chunk), and the merge concatenates the passes' partials: one more copy."""
    decode_rows = max_running + -(-split_target_programs() // model.kv_heads)
    rows = decode_rows
    if cold_passes > 1:
        rows = 2 * cold_passes * max(decode_rows, chunked_prefill_size)
    return rows * model.q_heads * (model.head_dim + 1) * 4


@dataclass(frozen=True)
class ImagePoolNeed:
    """What the image pool needs: the bytes of one image page (every layer, the vision codec), the pin
    budget in bytes (None: a quarter of the cold pool's bytes, as the cache's default) and the pages the
    image spans of running requests may take outside the budget."""

    page_bytes: int
    pin_budget_bytes: int | None
    span_pages: int

    def pages(self, cold_pages: int, cold_page_bytes: int) -> int:
        """Image pages next to a cold pool of ``cold_pages`` pages: the pin budget in image pages (at
        least one) plus the running requests' spans."""
        budget = self.pin_budget_bytes
        if budget is None:
            budget = cold_pages * cold_page_bytes // 4
        return max(1, budget // self.page_bytes) + self.span_pages

    def bytes(self, cold_pages: int, cold_page_bytes: int) -> int:
        """The image pool's buffers (its null page included) next to ``cold_pages`` cold pages."""
        return (self.pages(cold_pages, cold_page_bytes) + 1) * self.page_bytes


def image_pool_need(
    args: EngineArgs, cache: CacheConfig, image_page_bytes: int, max_image_tokens: int
) -> ImagePoolNeed:
    """The image pool of ``cache``'s pin budget (None: a quarter of the cold pool) and one image span
    of ``max_image_tokens`` (and the two pages it may straddle) per running request."""
    span_pages = max_image_tokens // args.page_size + 2
    return ImagePoolNeed(image_page_bytes, cache.pin_budget_bytes, args.max_running_requests * span_pages)


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
    image_pages: int = 0  # the image pool (0: none)
    image_page_bytes: int = 0
    raised_pages: int = 0  # the raised pool (0: none)
    raised_page_bytes: int = 0
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
    def image_bytes(self) -> int:
        """The image pool's buffers: ``image_pages`` pages and the null page (0 without one)."""
        return (self.image_pages + 1) * self.image_page_bytes if self.image_pages else 0

    @property
    def raised_bytes(self) -> int:
        """The raised pool's buffers: ``raised_pages`` pages and the null page (0 without one)."""
        return (self.raised_pages + 1) * self.raised_page_bytes if self.raised_pages else 0

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
            *(
                [
                    (
                        "image pool",
                        gib(self.image_bytes),
                        f"{self.image_pages * self.page_size:,} tokens ({self.image_pages:,} pages)",
                    )
                ]
                if self.image_pages
                else []
            ),
            *(
                [
                    (
                        "raised pool",
                        gib(self.raised_bytes),
                        f"{self.raised_pages * self.page_size:,} tokens ({self.raised_pages:,} pages)",
                    )
                ]
                if self.raised_pages
                else []
            ),
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
    image: ImagePoolNeed | None = None,
    attention_kernels: bool = False,
    cold_passes: int = 1,
) -> MemoryPlan:
    """The cold pool size for ``cache`` (its ``num_pages`` is ignored), and the image pool's when
    ``image`` is given. On CUDA ``reading`` is the device memory after the weights are loaded (read
    from the driver when None). ``attention_kernels``: attention runs the Triton kernels, whose
    workspace is far smaller than the torch reference's (`step_workspace_bytes`), in ``cold_passes``
    kernel passes a layer (2 or 3 with an image pool or a raised pool, `split_partial_bytes`)."""
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
        workspace_bytes=step_workspace_bytes(
            model, cache, args.chunked_prefill_size, dtype, attention_kernels, cold_passes
        ),
        cuda_graph_bytes=cuda_graph_bytes,
    )
    if args.max_total_tokens is not None or device.type != "cuda":
        source = "max_total_tokens" if args.max_total_tokens is not None else "cpu default"
        if args.max_total_tokens is None and args.mem_fraction_static is not None:
            source = "mem_fraction_static of MemAvailable"
        pages = pool_pages(args, device, page_bytes)
        return _with_image_pool(dataclasses.replace(plan, source=source, cold_pages=pages), image)
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
    pages = _cold_pages_that_fit(static_left - held, page_bytes, image)
    if pages < 1:
        raise ValueError(
            f"no memory left for the KV cache: {static_left / GIB:.2f} GiB free for static use "
            f"(free after weights {reading.free / GIB:.2f} GiB minus {1 - fraction:.2f} of "
            f"{reading.total / GIB:.2f} GiB) and ring + sinks + workspace need {held / GIB:.2f} GiB; "
            "raise --mem-fraction-static or lower --max-running-requests\n" + plan.table()
        )
    return _with_image_pool(dataclasses.replace(plan, cold_pages=int(pages)), image)


def _cold_pages_that_fit(free: int, page_bytes: int, image: ImagePoolNeed | None) -> int:
    """The most cold pages whose buffers (null page included), with the image pool that goes with
    them, fit in ``free`` bytes (0 or less when none does). The image pool grows with the cold pool
    (the default pin budget), so the answer is found by bisection."""
    if image is None:
        return free // page_bytes - 1  # the null page
    lo, hi = 0, max(0, free // page_bytes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (mid + 1) * page_bytes + image.bytes(mid, page_bytes) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _with_image_pool(plan: MemoryPlan, image: ImagePoolNeed | None) -> MemoryPlan:
    if image is None:
        return plan
    pages = image.pages(plan.cold_pages, plan.cold_page_bytes)
    return dataclasses.replace(plan, image_pages=pages, image_page_bytes=image.page_bytes)


def with_raised_pool(plan: MemoryPlan, raised_page_bytes: int, share: float) -> MemoryPlan:
    """``plan`` with ``share`` of its cold pool's bytes moved to a raised pool of pages of
    ``raised_page_bytes`` (its null page included); unchanged when that holds no raised page or would
    leave no cold page."""
    pages = int(share * plan.cold_pages * plan.cold_page_bytes) // raised_page_bytes
    taken = -(-(pages + 1) * raised_page_bytes // plan.cold_page_bytes)  # cold pages whose bytes it takes
    if pages < 1 or plan.cold_pages - taken < 1:
        return plan
    return dataclasses.replace(
        plan, cold_pages=plan.cold_pages - taken, raised_pages=pages, raised_page_bytes=raised_page_bytes
    )
