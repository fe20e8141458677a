"""`StratifiedKVCache`: admission, steps, prefix sharing and accounting over pool, ring and tree.

Ownership: every allocated cold page is held either by exactly one tree node or privately by
exactly one running sequence. A sequence's ``page_ids`` start with tree pages (locked through its
handle) followed by private pages; inserting into the tree hands private pages over, and frees
the ones the tree already had (the sequence then reads the tree's copy). Pages are written once,
in the step that completes them, before they can reach the tree.

Image pages (``cfg.image_codec``): a completed page holding an image token is allocated from a second
`ColdPool`, ``image_pool``, in the vision codec. Its pages take the ids ``image_base + i`` (``i`` its
row in ``image_pool``; ``image_base`` is past the text pool's null page), so the tree, sequences,
sinks and checksums keep one id space and every id says which pool holds it.

Raised pages (``cfg.raised_codecs``): a third `ColdPool`, ``raised_pool``, stores text pages in wider
codecs. Its pages take the ids ``raised_base + i`` (``raised_base`` is past the text pool's null page;
the image ids then start after the raised range). While `set_raised` is on (the drift monitor's fallback),
new text pages are allocated from it; off, from the text pool. A page keeps the pool and codec it was
written in (shared prefixes too); nothing is re-encoded. A raised page is a text page in every other
respect: the tree counts it with the text pages, and the two pools are one capacity for text pages
(allocation takes the preferred pool first and spills into the other before anything is evicted).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from collections.abc import Sequence as Seq

import torch

from kvstrata.radix import attention
from kvstrata.radix.config import CacheConfig
from kvstrata.radix.errors import OutOfPages, OutOfSlots, PinBudgetExceeded
from kvstrata.radix.page_table import SlotPageTable
from kvstrata.radix.pins import PinTable
from kvstrata.radix.plan import NullRows, StepBatch, build_step
from kvstrata.radix.pool import ColdPool, cold_page_bytes
from kvstrata.radix.ring import HotRing
from kvstrata.radix.sequence import PrefixMatch, Sequence
from kvstrata.radix.sinks import SinkStore
from kvstrata.radix.stats import CacheStats
from kvstrata.radix.tree import RadixTree, TreeNode


class StratifiedKVCache:
    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        P, H, D = cfg.page_size, cfg.kv_heads, cfg.head_dim
        num_pages = cfg.num_pages
        if num_pages is None:
            assert cfg.cold_budget_bytes is not None
            num_pages = cfg.cold_budget_bytes // cold_page_bytes(cfg.layer_codecs, P, H, D)
        self.device = torch.device(cfg.device)
        self.pool = ColdPool(cfg.layer_codecs, num_pages, P, H, D, self.device)
        self.raised_base = num_pages + 1
        self.raised_pool: ColdPool | None = None
        if cfg.raised_codecs is not None:
            self.raised_pool = ColdPool(cfg.raised_codecs, cfg.raised_pages, P, H, D, self.device)
        self.raised = False  # new text pages go to the raised pool (`set_raised`)
        self.image_base = self.raised_base + (cfg.raised_pages if self.raised_pool is not None else 0)
        self.image_pool: ColdPool | None = None
        if cfg.image_codec is not None:
            codecs = [cfg.image_codec] * cfg.num_layers
            self.image_pool = ColdPool(codecs, cfg.image_pages, P, H, D, self.device)
        self.ring = HotRing(
            cfg.num_layers, cfg.max_running, cfg.ring_tokens, H, D, cfg.ring_dtype, self.device
        )
        self.sinks = (
            SinkStore(cfg.num_layers, cfg.sink_pages or 0, P, H, D, cfg.ring_dtype, self.device)
            if cfg.sinks
            else None
        )
        self.nulls = NullRows(
            page=self.pool.null_page,
            sink=self.sinks.null_slot if self.sinks is not None else 0,
            ring_row=self.ring.null_row,
            image_page=self.image_pool.null_page if self.image_pool is not None else 0,
            raised_page=self.raised_pool.null_page if self.raised_pool is not None else 0,
        )
        self.tree = RadixTree(P, self.image_base if self.image_pool is not None else None)
        self.recent_window = cfg.recent_window
        self.pin_budget_bytes = (
            cfg.pin_budget_bytes
            if cfg.pin_budget_bytes is not None
            else num_pages * self.pool.page_bytes // 4
        )
        self.pins = PinTable(self)  # named pins with TTL over `pin` / `unpin`
        self.clips = self._load_clips(cfg)
        self._rotate = None
        if cfg.rotation:
            from kvstrata.quant.rotation import hadamard_rotate

            self._rotate = hadamard_rotate
        self.running: dict[int, Sequence] = {}
        self._next_id = 0
        # On CUDA each slot's page ids stay on the device, so a step sends only what changed (steps whose
        # sequences hold only text-pool pages: the host splits image and raised pages by pool). On the
        # CPU the gather costs what the list build costs: the plan is built from the lists.
        self.page_tables = (
            SlotPageTable(self.ring.slots.total, self.pool.null_page, self.device)
            if self.device.type == "cuda"
            else None
        )
        self.written = bytearray(self.image_base + (cfg.image_pages if self.image_pool is not None else 0))
        # Checksums of tree pages recorded by check_invariants (page immutability); freeing forgets.
        self.page_checksums: dict[int, int] = {}
        self.quantized_pages = self.evicted_pages = self.matched_tokens = self.missed_tokens = 0
        L = cfg.num_layers
        self._overflow = {"k": [0] * L, "v": [0] * L}
        self._nonfinite = {"k": [0] * L, "v": [0] * L}
        self._absmax = {"k": [0.0] * L, "v": [0.0] * L}
        # The Triton encoder's counts stay on the device, [layer, (absmax, NaN/Inf), (K, V)], until
        # one of the three properties below is read: a step waits for nothing to account for them.
        self._device_counts: torch.Tensor | None = None
        self._pending_counts: list[tuple[int, torch.Tensor]] = []  # (layer, encoder rows) of this step
        self._device_counts_dirty = False

    @property
    def overflow(self) -> dict[str, list[int]]:
        """Elements clipped by static scales, per kind and layer."""
        return self._overflow

    @property
    def nonfinite(self) -> dict[str, list[int]]:
        """NaN/Inf elements met while quantizing, per kind and layer."""
        self._fold_device_counts()
        return self._nonfinite

    @property
    def absmax(self) -> dict[str, list[float]]:
        """Largest finite magnitude quantized so far, per kind and layer."""
        self._fold_device_counts()
        return self._absmax

    def _add_device_counts(self, layer: int, stats: torch.Tensor) -> None:
        """Keep one layer's encoder rows (`page_quantize.quantize_pages`); the step's last layer reduces
        the step's layers at once (`_reduce_device_counts`), as does a read of the counts."""
        pending = self._pending_counts
        if pending and pending[-1][1].shape != stats.shape:  # a step that did not reach its last layer
            self._reduce_device_counts()
        self._pending_counts.append((layer, stats))
        self._device_counts_dirty = True
        if layer == self.cfg.num_layers - 1:
            self._reduce_device_counts()

    def _reduce_device_counts(self) -> None:
        """Accumulate the kept rows into the ``[layer, (absmax, NaN/Inf), (K, V)]`` device counts, in
        float64 so that NaN/Inf counts stay exact: a few operations a step, not a few a layer."""
        from kvstrata.radix.kernels.page_quantize import reduce_counts

        pending, self._pending_counts = self._pending_counts, []
        if not pending:
            return
        counts = reduce_counts(torch.stack([stats for _, stats in pending])).double()
        if self._device_counts is None:
            shape = (self.cfg.num_layers, 2, 2)
            self._device_counts = torch.zeros(shape, dtype=torch.float64, device=counts.device)
        acc, layers = self._device_counts, [layer for layer, _ in pending]
        if layers == list(range(layers[0], layers[0] + len(layers))):  # the usual case: a run of layers
            runs = [(acc[layers[0] : layers[0] + len(layers)], counts)]
        else:
            runs = [(acc[layer], counts[i]) for i, layer in enumerate(layers)]
        for rows, got in runs:
            torch.maximum(rows[..., 0, :], got[..., 0, :], out=rows[..., 0, :])
            rows[..., 1, :].add_(got[..., 1, :])

    def _fold_device_counts(self) -> None:
        """Move the device counts into the host totals (one read back) and zero them."""
        self._reduce_device_counts()
        if not self._device_counts_dirty or self._device_counts is None:
            return
        for layer, ((absmax_k, absmax_v), (bad_k, bad_v)) in enumerate(self._device_counts.tolist()):
            for kind, top, bad in (("k", absmax_k, bad_k), ("v", absmax_v, bad_v)):
                self._absmax[kind][layer] = max(self._absmax[kind][layer], top)
                self._nonfinite[kind][layer] += int(bad)
        self._device_counts.zero_()
        self._device_counts_dirty = False

    @staticmethod
    def _load_clips(cfg: CacheConfig) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        if cfg.scales is None:
            return [(None, None)] * cfg.num_layers
        if cfg.rotation:
            # Calibration observes unrotated K/V; its clips would not bound rotated values.
            raise ValueError("static KV scales (a calibration file) cannot be combined with rotation")
        cfg.scales.check_geometry(cfg.num_layers, cfg.kv_heads, cfg.head_dim)
        return [
            (cfg.scales.clip(layer, "k").to(cfg.device), cfg.scales.clip(layer, "v").to(cfg.device))
            for layer in range(cfg.num_layers)
        ]

    # ---- capacity -------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    @property
    def num_pages(self) -> int:
        """Text page capacity: the text pool and the raised pool."""
        return sum(p.allocator.total for p in self._text_pools())

    @property
    def num_free_pages(self) -> int:
        return sum(p.allocator.num_free for p in self._text_pools())

    def _text_pools(self) -> list[ColdPool]:
        """The pools text pages live in: the text pool, then the raised pool when there is one."""
        return [self.pool] if self.raised_pool is None else [self.pool, self.raised_pool]

    @property
    def num_evictable_pages(self) -> int:
        return self.tree.evictable_pages - self.tree.evictable_image_pages

    def is_image_page(self, page: int) -> bool:
        return self.image_pool is not None and page >= self.image_base

    def is_raised_page(self, page: int) -> bool:
        return self.raised_pool is not None and self.raised_base <= page < self.image_base

    def pool_of(self, page: int) -> tuple[ColdPool, int, str]:
        """(pool, row in it, tier name) of a page id: "cold" (text pool), "raised" or "image"."""
        if self.is_image_page(page):
            assert self.image_pool is not None
            return self.image_pool, page - self.image_base, "image"
        if self.is_raised_page(page):
            assert self.raised_pool is not None
            return self.raised_pool, page - self.raised_base, "raised"
        return self.pool, page, "cold"

    def pages_bytes(self, pages: int, image: int = 0) -> int:
        """Exact cold bytes of ``pages`` pages of which ``image`` are image pages (no raised pages)."""
        image_bytes = self.image_pool.page_bytes if self.image_pool is not None else 0
        return (pages - image) * self.pool.page_bytes + image * image_bytes

    def page_ids_bytes(self, pages: Seq[int]) -> int:
        """Exact cold bytes of the pages ``pages``, each in its own pool's page bytes."""
        return sum(self.pool_of(p)[0].page_bytes for p in pages)

    @property
    def pinned_bytes(self) -> int:
        if self.raised_pool is None:
            return self.pages_bytes(self.tree.pinned_pages, self.tree.pinned_image_pages)
        return self.page_ids_bytes([p for n in self.tree.nodes() if n.pin_ref > 0 for p in n.pages])

    def page_is_free(self, page: int) -> bool:
        pool, row, _ = self.pool_of(page)
        return pool.allocator.is_free(row)

    def _image_page_flags(self, seq: Sequence, n_pages: int) -> list[bool]:
        """Which of the next ``n_pages`` pages of ``seq`` hold an image token (all False without
        an image pool)."""
        first, P = len(seq.page_ids), self.page_size
        if self.image_pool is None:
            return [False] * n_pages
        floor = self.cfg.image_token_from
        assert floor is not None
        return [max(seq.token_ids[j * P : (j + 1) * P]) >= floor for j in range(first, first + n_pages)]

    def _alloc_pages(self, flags: list[bool]) -> list[int]:
        """Page ids for pages flagged image (image pool) or text (the pool), in order."""
        if not flags:  # most sequences of a decode step
            return []
        n_image = sum(flags)
        image: list[int] = []
        if n_image:
            assert self.image_pool is not None
            image = [self.image_base + i for i in self.image_pool.allocator.alloc(n_image)]
        text = self._alloc_text(len(flags) - n_image)
        image.reverse()
        text.reverse()
        return [image.pop() if f else text.pop() for f in flags]

    def _alloc_text(self, n: int) -> list[int]:
        """``n`` text page ids: from the raised pool while raised (else the text pool) first, the rest
        from the other pool. The caller made room (`_make_room`) in both together."""
        if self.raised_pool is None:
            return self.pool.allocator.alloc(n)
        raised_free = self.raised_pool.allocator.num_free
        n_raised = min(n, raised_free) if self.raised else max(0, n - self.pool.allocator.num_free)
        text = self.pool.allocator.alloc(n - n_raised)
        raised = [self.raised_base + i for i in self.raised_pool.allocator.alloc(n_raised)]
        return raised + text if self.raised else text + raised  # the preferred pool's pages first

    def set_raised(self, on: bool) -> None:
        """Precision fallback hook: new text pages go to the raised pool (wider codecs) while ``on``;
        pages already written keep their pool and codec."""
        if on and self.raised_pool is None:
            raise ValueError("set_raised: this cache has no raised pool (CacheConfig.raised_codecs)")
        self.raised = on

    @property
    def num_free_slots(self) -> int:
        return self.ring.slots.num_free

    def pages_for_step(self, seq: Sequence, n_new: int) -> int:
        """Cold pages `begin_step` would take for ``n_new`` more tokens of ``seq``."""
        return (seq.length + n_new) // self.page_size - len(seq.page_ids)

    # ---- prefix lookups and pins ----------------------------------------------------------------
    def match_prefix(self, token_ids: Seq[int], extra_key: Hashable = None) -> PrefixMatch:
        """Longest cached page-aligned prefix of ``token_ids`` (all of them may match)."""
        m = self.tree.match_prefix(token_ids, extra_key)
        return PrefixMatch(m.pages, m.node, len(m.pages) * self.page_size)

    def pin(self, handle: TreeNode | None) -> None:
        """Pin the prefix ending at ``handle``: it is never evicted until `unpin`.

        Raises `PinBudgetExceeded` (nothing changes) when its not yet pinned pages would take the
        pinned bytes past ``pin_budget_bytes``.
        """
        if handle is None:
            raise ValueError("pin: empty handle (the prefix matched no page)")
        if handle.evicted:
            raise ValueError("pin: the handle's prefix was evicted")
        if self.raised_pool is None:
            extra = self.pages_bytes(*self.tree.unpinned_pages_on_path(handle))
        else:
            extra = self.page_ids_bytes([p for n in handle.path() if n.pin_ref == 0 for p in n.pages])
        pinned = self.pinned_bytes
        if pinned + extra > self.pin_budget_bytes:
            raise PinBudgetExceeded(
                f"pinning {extra} more bytes would make {pinned + extra} pinned bytes, over the pin "
                f"budget of {self.pin_budget_bytes} bytes ({pinned} pinned now)"
            )
        self.tree.pin(handle)

    def unpin(self, handle: TreeNode | None) -> None:
        if handle is None:
            raise ValueError("unpin: empty handle")
        self.tree.unpin(handle)

    # ---- request lifecycle ----------------------------------------------------------------------
    def admit(self, token_ids: list[int], extra_key: Hashable = None) -> Sequence:
        """Match the longest cached prefix (page aligned, never the last token), lock it and take a
        ring slot. Raises `OutOfSlots` with nothing changed when every slot is taken. The match is
        counted in the hit statistics at the sequence's first step, so an admission that is rolled
        back before it runs counts nothing."""
        if not token_ids:
            raise ValueError("admit: empty token_ids")
        if self.ring.slots.num_free == 0:
            raise OutOfSlots(f"all {self.ring.slots.total} ring slots are held by running sequences")
        P = self.page_size
        match = self.tree.match_prefix(token_ids[: (len(token_ids) - 1) // P * P], extra_key)
        slot = self.ring.slots.alloc(1)[0]
        self.tree.lock(match.node)
        cached = len(match.pages) * P
        seq = Sequence(
            seq_id=self._next_id,
            token_ids=token_ids,
            extra_key=extra_key,
            slot=slot,
            cached_tokens=cached,
            length=cached,
            ring_start=cached,
            page_ids=list(match.pages),
            tree_pages=len(match.pages),
            handle=match.node,
        )
        self._next_id += 1
        self.running[seq.seq_id] = seq
        return seq

    def begin_step(self, seqs: list[Sequence], n_new: list[int]) -> StepBatch:
        """Reserve cold pages (and sink pages) for the pages these tokens complete, evicting
        unlocked tree leaves if needed, and plan the step. `OutOfPages` changes nothing."""
        self._check_step_args(seqs, n_new)
        P = self.page_size
        need = [self.pages_for_step(s, n) for s, n in zip(seqs, n_new, strict=True)]
        flags = [self._image_page_flags(s, k) for s, k in zip(seqs, need, strict=True)]
        need_image = sum(sum(f) for f in flags)
        need_sinks = 0
        if self.sinks is not None:
            need_sinks = sum(1 for s, k in zip(seqs, need, strict=True) if k > 0 and not s.page_ids)
        self._make_room(sum(need) - need_image, need_sinks, need_image)
        new_pages: list[list[int]] = []
        try:
            for seq, page_flags in zip(seqs, flags, strict=True):
                pages = self._alloc_pages(page_flags)
                if self.sinks is not None and pages and not seq.page_ids:
                    self.sinks.bind(pages[:1])
                seq.page_ids.extend(pages)
                seq.in_step = True
                new_pages.append(pages)
            return build_step(
                seqs,
                n_new,
                new_pages,
                page_size=P,
                ring_capacity=self.ring.capacity,
                window=self.recent_window,
                sink_of=self.sinks.of_page if self.sinks is not None else None,
                nulls=self.nulls,
                device=self.device,
                image_base=self.image_base if self.image_pool is not None else None,
                tables=self.page_tables,
                raised_base=self.raised_base if self.raised_pool is not None else None,
                raised_end=self.image_base,
            )
        except BaseException:
            # Planning failed (e.g. out of device memory while building the index tensors): no
            # step is open, so nothing may stay attached to the sequences.
            self._detach(seqs[: len(new_pages)], new_pages)
            if self.page_tables is not None:
                self.page_tables.forget(seqs)
            raise

    def _detach(self, seqs: list[Sequence], new_pages: list[list[int]]) -> None:
        """Take this step's pages back from ``seqs`` and free them; the sequences leave the step."""
        for seq, pages in zip(seqs, new_pages, strict=True):
            if pages:
                del seq.page_ids[-len(pages) :]
                if self.page_tables is not None:  # the next step may append other pages at these entries
                    self.page_tables.invalidate(seq, len(seq.page_ids))
            self._free_pages(pages)
            seq.in_step = False

    def _check_step_args(self, seqs: list[Sequence], n_new: list[int]) -> None:
        if len(seqs) != len(n_new) or not seqs:
            raise ValueError(f"begin_step: {len(seqs)} sequences, {len(n_new)} token counts")
        if len({s.seq_id for s in seqs}) != len(seqs):
            raise ValueError("begin_step: a sequence appears twice")
        for seq, n in zip(seqs, n_new, strict=True):
            if seq.finished or self.running.get(seq.seq_id) is not seq:
                raise ValueError(f"begin_step: sequence {seq.seq_id} is not running")
            if seq.in_step:
                raise ValueError(f"begin_step: sequence {seq.seq_id} is already in an open step")
            if seq.ring_clobbered:
                raise ValueError(
                    f"begin_step: sequence {seq.seq_id} lost recent-window rows to a cancelled step; "
                    "finish it and admit its tokens again"
                )
            if n < 1 or seq.length + n > len(seq.token_ids):
                raise ValueError(
                    f"begin_step: sequence {seq.seq_id} has {len(seq.token_ids)} token ids, "
                    f"{seq.length} cached, asked for {n} new"
                )

    def _make_room(self, pages: int, sink_pages: int, image_pages: int = 0) -> None:
        """Free enough text, image and sink pages (evicting LRU leaves) or raise `OutOfPages`
        with nothing changed."""
        t = self.tree
        free = self.num_free_pages
        text_evictable = t.evictable_pages - t.evictable_image_pages
        if pages > free + text_evictable:
            text_tree = t.total_pages - t.image_pages
            raise OutOfPages(
                f"need {pages} cold pages: {free} free, {text_evictable} evictable, "
                f"{text_tree - text_evictable} locked or pinned in the tree, "
                f"{self.num_pages - free - text_tree} held by running sequences"
            )
        image_free = self.image_pool.allocator.num_free if self.image_pool is not None else 0
        if image_pages > image_free + t.evictable_image_pages:
            raise OutOfPages(
                f"need {image_pages} image pages: {image_free} free, {t.evictable_image_pages} evictable, "
                f"{t.image_pages - t.evictable_image_pages} locked or pinned in the tree"
            )
        if self.sinks is not None and sink_pages > self.sinks.allocator.num_free:
            sink_free = self.sinks.allocator.num_free
            evictable = self.tree.evictable_first_nodes
            if sink_pages > sink_free + evictable:
                raise OutOfPages(
                    f"need {sink_pages} sink pages: {sink_free} free, {evictable} evictable "
                    f"of {self.sinks.allocator.total}"
                )
        if pages > free:
            self._free_pages(t.evict(pages - free, lambda n: len(n.pages) - n.image), evicted=True)
        if self.image_pool is not None and image_pages > self.image_pool.allocator.num_free:
            short = image_pages - self.image_pool.allocator.num_free
            self._free_pages(t.evict(short, lambda n: n.image), evicted=True)
        if self.sinks is not None and sink_pages > self.sinks.allocator.num_free:
            short = sink_pages - self.sinks.allocator.num_free
            self._free_pages(self.tree.evict(short, self.sink_weight), evicted=True)

    def sink_weight(self, node: TreeNode) -> int:
        """1 when evicting ``node`` frees a sink page: it starts at position 0 and its page has one."""
        assert self.sinks is not None
        return int(node.parent is not None and node.parent.is_root and node.pages[0] in self.sinks.of_page)

    def attention(
        self,
        layer: int,
        batch: StepBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        kernels: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of the new tokens over cold pages + sinks + ring + themselves; then
        stores k/v (ring, and completed pages quantized once). Returns ``[T, Hq, D]``.

        ``kernels``: the Triton kernels of `kvstrata.radix.kernels` instead of the torch reference.
        ``out``: a contiguous ``[T, Hq, D]`` tensor of q's dtype that receives the result and is
        returned (the kernels write it directly)."""
        if batch.closed:
            raise ValueError("attention: the step has ended")
        if layer in batch.layers_done:
            raise ValueError(f"attention: layer {layer} was already run in this step")
        if not 0 <= layer < self.cfg.num_layers:
            raise ValueError(f"attention: layer {layer} out of range 0..{self.cfg.num_layers - 1}")
        T, H, D = batch.num_tokens, self.cfg.kv_heads, self.cfg.head_dim
        if k.shape != (T, H, D) or v.shape != (T, H, D) or q.shape[0] != T or q.shape[1] % H:
            raise ValueError(
                f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                f"{T} tokens, {H} kv heads, head_dim {D}"
            )
        if out is not None and (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous()):
            raise ValueError(
                f"attention: out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}"
            )
        if self._rotate is not None:
            q, k, v = self._rotate(q), self._rotate(k), self._rotate(v)
        if kernels:
            from kvstrata.radix.kernels import attend as kernel_attend

            into = out if self._rotate is None else None
            got = kernel_attend.attend(
                layer, batch, q, k, v, scale, self.pool, self.ring, self.sinks, self.image_pool,
                raised_pool=self.raised_pool, out=into,
            )  # fmt: skip
        else:
            got = attention.attend(
                layer,
                batch,
                q,
                k,
                v,
                scale,
                self.pool,
                self.ring,
                self.sinks,
                self.cfg.block_pages,
                self.image_pool,
                self.raised_pool,
            )
        if kernels and all(c is None for c in self.clips[layer]):
            from kvstrata.radix.kernels import page_quantize

            device_counts = page_quantize.store_async(
                layer, batch, k, v, self.pool, self.ring, self.sinks, self.image_pool, self.raised_pool
            )
            if device_counts is not None:
                self._add_device_counts(layer, device_counts)
        else:
            counts = attention.store(
                layer,
                batch,
                k,
                v,
                self.pool,
                self.ring,
                self.sinks,
                self.clips[layer],
                self.image_pool,
                self.raised_pool,
            )
            for kind in ("k", "v"):
                self._overflow[kind][layer] += getattr(counts, f"overflow_{kind}")
                self._nonfinite[kind][layer] += getattr(counts, f"nonfinite_{kind}")
                top = max(self._absmax[kind][layer], getattr(counts, f"absmax_{kind}"))
                self._absmax[kind][layer] = top
        batch.layers_done.add(layer)
        if self._rotate is not None:
            got = self._rotate(got)  # V was rotated; the normalised transform is its own inverse
        if out is None:
            return got.to(q.dtype)
        if got is not out:
            out.copy_(got)
        return out

    def prepare_graph_capture(self) -> None:
        """Before a CUDA graph captures `attention` calls (the full decode graph): the encoder's pending
        counts reduced and their device accumulator allocated outside the graph's memory pool, so the
        graph's reduction accumulates into the tensor the count properties read."""
        self._reduce_device_counts()
        if self._device_counts is None:
            shape = (self.cfg.num_layers, 2, 2)
            self._device_counts = torch.zeros(shape, dtype=torch.float64, device=self.device)

    def graph_step_ran(self, batch: StepBatch) -> None:
        """``batch``'s attention and stores ran for every layer inside a replayed graph (on a static copy
        of its plan): its layers are done, and the graph added the encoder's counts on the device."""
        if batch.closed:
            raise ValueError("graph_step_ran: the step has ended")
        batch.layers_done.update(range(self.cfg.num_layers))
        self._device_counts_dirty = True

    def end_step(self, batch: StepBatch, drop: Collection[int] = ()) -> None:
        """Commit the step: lengths += n_new; the ring keeps [ring_start, length).

        ``drop``: indices of sequences whose part of the step is abandoned instead, as `cancel_step`
        abandons a whole step (overlap scheduling: they finished on a token sampled by the step
        before, so this step's token of theirs is discarded and they end as if it had not run)."""
        if batch.closed:
            raise ValueError("end_step: the step has already ended")
        missing = set(range(self.cfg.num_layers)) - batch.layers_done
        if missing:
            raise ValueError(f"end_step: attention was not run for layers {sorted(missing)}")
        dropped = set(drop)
        if dropped:
            self._abandon(batch, sorted(dropped))
        for i, (seq, n, start, pages) in enumerate(
            zip(batch.seqs, batch.n_new, batch.new_ring_start, batch.new_pages, strict=True)
        ):
            if i in dropped:
                continue
            if seq.length == seq.cached_tokens:  # its first step: the admission really used its match
                self.matched_tokens += seq.cached_tokens
                self.missed_tokens += len(seq.token_ids) - seq.cached_tokens
            seq.length += n
            seq.ring_start = start
            seq.in_step = False
            for p in pages:
                self.written[p] = 1
            self.quantized_pages += len(pages)
        batch.closed = True

    def cancel_step(self, batch: StepBatch) -> None:
        """Abandon a step (e.g. the forward pass failed): give back its pages, lengths unchanged.

        Layers that already ran stored the new tokens in the ring. A chunk longer than the ring's
        free rows overwrites rows of positions the sequence still reads: such a sequence is marked
        ``ring_clobbered`` and `begin_step` refuses it from then on (finish it; a new admission
        recomputes). A decode step never overwrites a live row."""
        if batch.closed:
            raise ValueError("cancel_step: the step has already ended")
        self._abandon(batch, range(len(batch.seqs)))
        batch.closed = True

    def _abandon(self, batch: StepBatch, which: Seq[int]) -> None:
        """Give back the step's pages of the sequences at ``which``; their lengths stay."""
        R = self.ring.capacity
        for i in which:
            seq, n, new_start = batch.seqs[i], batch.n_new[i], batch.new_ring_start[i]
            # Rows of positions [first, last] were written; they alias [first - R, last - R].
            first, last = max(seq.length, new_start), seq.length + n - 1
            live = range(seq.ring_start, seq.length)
            if batch.layers_done and first <= last and first - R < live.stop and last - R >= live.start:
                seq.ring_clobbered = True
        self._detach([batch.seqs[i] for i in which], [batch.new_pages[i] for i in which])

    def cache_prefix(self, seq: Sequence) -> None:
        """Insert the sequence's full pages into the tree now (it keeps running)."""
        self._check_idle(seq, "cache_prefix")
        n_full = seq.length // self.page_size
        if n_full <= seq.tree_pages:
            return
        P = self.page_size
        res = self.tree.insert(seq.token_ids[: n_full * P], seq.page_ids[:n_full], seq.extra_key)
        if self.page_tables is not None:  # pages after the tree's may become the tree's copies
            self.page_tables.invalidate(seq, seq.tree_pages)
        self._free_pages(seq.page_ids[seq.tree_pages : res.present])
        seq.page_ids[:n_full] = res.pages
        self.tree.lock(res.node)
        self.tree.unlock(seq.handle)
        seq.handle, seq.tree_pages = res.node, n_full

    def finish(self, seq: Sequence, insert: bool = True) -> None:
        """Insert full pages into the tree (optional), unlock, free private pages, release slot."""
        self._check_idle(seq, "finish")
        if insert:
            self.cache_prefix(seq)
        self.tree.unlock(seq.handle)
        self._free_pages(seq.private_pages)
        self.ring.slots.free([seq.slot])
        seq.page_ids, seq.tree_pages, seq.handle = [], 0, None
        seq.finished = True
        del self.running[seq.seq_id]

    def _check_idle(self, seq: Sequence, what: str) -> None:
        if seq.finished or self.running.get(seq.seq_id) is not seq:
            raise ValueError(f"{what}: sequence {seq.seq_id} is not running")
        if seq.in_step:
            raise ValueError(f"{what}: sequence {seq.seq_id} is in an open step; end it first")

    def _free_pages(self, pages: list[int], evicted: bool = False) -> None:
        if not pages:
            return
        if self.image_pool is None and self.raised_pool is None:
            self.pool.allocator.free(pages)
        else:
            rows: dict[str, tuple[ColdPool, list[int]]] = {}
            for p in pages:
                pool, row, name = self.pool_of(p)
                rows.setdefault(name, (pool, []))[1].append(row)
            for pool, ids in rows.values():
                pool.allocator.free(ids)
        if self.sinks is not None:
            self.sinks.release(pages)
        for p in pages:
            self.written[p] = 0
            self.page_checksums.pop(p, None)
        if evicted:
            self.evicted_pages += len(pages)

    # ---- maintenance ----------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Evict at least ``num_pages`` pages of unlocked, unpinned leaves (LRU) if there are;
        returns how many pages were freed."""
        freed = self.tree.evict(num_pages)
        self._free_pages(freed, evicted=True)
        return len(freed)

    def reset(self) -> None:
        """Empty the tree (pins included). Only when no sequence is running."""
        if self.running:
            raise RuntimeError(f"reset: {len(self.running)} sequences are still running")
        self._free_pages(self.tree.reset())
        self.pins.clear()

    def set_recent_window(self, window: int) -> None:
        """Precision fallback hook: the BF16 window for the steps that follow (no allocation)."""
        P, top = self.page_size, self.cfg.max_recent_window
        assert top is not None
        if window < 0 or window % P or window > top:
            raise ValueError(f"recent window {window} must be a multiple of {P} in [0, {top}]")
        self.recent_window = window

    def check_invariants(self) -> None:
        from kvstrata.radix.invariants import check_invariants

        check_invariants(self)

    def stats(self) -> CacheStats:
        from kvstrata.radix.snapshot import snapshot

        return snapshot(self)
