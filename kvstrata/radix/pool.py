"""`ColdPool`: quantized history pages, one buffer per layer, K/V and codec part, page-major.

Page ids are shared by all layers: page ``p`` is row ``p`` of every buffer. Keys are stored with
per-channel scales over the page's tokens (KIVI), values with per-token scales. Only the codec
(`kvstrata.quant`) knows what the parts mean; the pool only allocates ``page_parts`` and copies.
A layer may store keys and values in different codecs (``"int4/fp4_e2m1"``: keys int4, values fp4),
which is how a per-layer precision plan treats keys and values separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.quant import get_codec
from kvstrata.quant.codec import Codec
from kvstrata.radix.allocator import IdAllocator

KEY_GRANULARITY = "channel"
VALUE_GRANULARITY = "token"
KV_SEPARATOR = "/"  # a layer codec "int4/fp4_e2m1" stores keys in int4 and values in fp4_e2m1


def split_layer_codec(name: str) -> tuple[str, str]:
    """(key codec, value codec) of a layer codec name: ``"fp8_e4m3"`` or ``"int4/fp4_e2m1"``."""
    k, sep, v = name.partition(KV_SEPARATOR)
    if sep and (not k or not v or KV_SEPARATOR in v):
        raise ValueError(f"layer codec {name!r}: expected KEY{KV_SEPARATOR}VALUE codec names")
    return (k, v) if sep else (name, name)


def layer_codec_name(k: str, v: str) -> str:
    """The layer codec name storing keys in ``k`` and values in ``v`` (one name when they agree)."""
    return k if k == v else f"{k}{KV_SEPARATOR}{v}"


def cold_page_bytes(codecs: list[str], page_size: int, heads: int, head_dim: int) -> int:
    """Exact bytes of one cold page summed over layers, K and V, scales included."""
    total = 0
    for name in codecs:
        k, v = split_layer_codec(name)
        total += get_codec(k).page_bytes(page_size, heads, head_dim, KEY_GRANULARITY)
        total += get_codec(v).page_bytes(page_size, heads, head_dim, VALUE_GRANULARITY)
    return total


def as_raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` seen as same-width integers: CPU ``index_copy_``/indexing lack the float8 dtypes."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def _finite_absmax(x: torch.Tensor) -> float:
    return float(x.abs().nan_to_num(nan=0.0, posinf=0.0).amax()) if x.numel() else 0.0


def _gather(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buf[index]`` for any index shape; ``index_select`` is ~5x faster than advanced indexing
    on CPU for page tables."""
    rows = as_raw(buf).index_select(0, index.reshape(-1))
    return rows.view(*index.shape, *buf.shape[1:]).view(buf.dtype)


@dataclass
class WriteCounts:
    """What one write counted: clipped and NaN/Inf elements (from the codec) and the largest
    finite magnitude written, per K and V."""

    overflow_k: int = 0
    overflow_v: int = 0
    nonfinite_k: int = 0
    nonfinite_v: int = 0
    absmax_k: float = 0.0
    absmax_v: float = 0.0

    def merge(self, other: WriteCounts) -> WriteCounts:
        """The counts of both writes (one step's text and image pages)."""
        return WriteCounts(
            self.overflow_k + other.overflow_k,
            self.overflow_v + other.overflow_v,
            self.nonfinite_k + other.nonfinite_k,
            self.nonfinite_v + other.nonfinite_v,
            max(self.absmax_k, other.absmax_k),
            max(self.absmax_v, other.absmax_v),
        )


class ColdPool:
    def __init__(
        self,
        codecs: list[str],
        num_pages: int,
        page_size: int,
        heads: int,
        head_dim: int,
        device: str | torch.device,
    ) -> None:
        self.page_size, self.head_dim = page_size, head_dim
        self.codec_names = list(codecs)
        pairs = [split_layer_codec(name) for name in codecs]
        self.k_codecs: list[Codec] = [get_codec(k) for k, _ in pairs]
        self.v_codecs: list[Codec] = [get_codec(v) for _, v in pairs]
        self.allocator = IdAllocator(num_pages, "cold pages")
        self.k: list[dict[str, torch.Tensor]] = []
        self.v: list[dict[str, torch.Tensor]] = []
        # Row ``num_pages`` of every buffer is the null page: never allocated, never written, all
        # zero bytes, which every codec decodes to finite zeros. Padded page tables point at it.
        self.null_page = num_pages
        for k_codec, v_codec in zip(self.k_codecs, self.v_codecs, strict=True):
            parts = ((self.k, k_codec, KEY_GRANULARITY), (self.v, v_codec, VALUE_GRANULARITY))
            for bufs, codec, gran in parts:
                spec = codec.page_parts(page_size, heads, head_dim, gran)
                bufs.append(
                    {
                        name: torch.zeros((num_pages + 1, *shape), dtype=dtype, device=device)
                        for name, (shape, dtype) in spec.items()
                    }
                )
        self.page_bytes = cold_page_bytes(codecs, page_size, heads, head_dim)

    @property
    def total_bytes(self) -> int:
        """Bytes of the ``num_pages`` allocatable pages in the buffers (the null page excluded)."""
        return sum(t[: self.null_page].nbytes for bufs in (*self.k, *self.v) for t in bufs.values())

    @property
    def padding_bytes(self) -> int:
        """Bytes of the null page."""
        return self.page_bytes

    def write(
        self,
        layer: int,
        page_ids: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        k_clip: torch.Tensor | None = None,
        v_clip: torch.Tensor | None = None,
    ) -> WriteCounts:
        """Quantize ``[n, page_size, H, D]`` pages of K and V into ``page_ids`` of ``layer``."""
        qk = self.k_codecs[layer].quantize(k_pages, granularity=KEY_GRANULARITY, static_absmax=k_clip)
        qv = self.v_codecs[layer].quantize(v_pages, granularity=VALUE_GRANULARITY, static_absmax=v_clip)
        for bufs, q in ((self.k[layer], qk), (self.v[layer], qv)):
            for name, part in q.parts.items():
                buf = bufs[name]
                as_raw(buf).index_copy_(0, page_ids, as_raw(part.to(buf.dtype)))
        return WriteCounts(
            int(qk.overflow),
            int(qv.overflow),
            int(qk.nonfinite),
            int(qv.nonfinite),
            _finite_absmax(k_pages),
            _finite_absmax(v_pages),
        )

    def read(
        self, layer: int, page_table: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of ``page_table`` (any shape ``S``): ``[*S, page_size, H, D]`` each."""
        k_parts = {name: _gather(buf, page_table) for name, buf in self.k[layer].items()}
        v_parts = {name: _gather(buf, page_table) for name, buf in self.v[layer].items()}
        k = self.k_codecs[layer].dequantize_parts(k_parts, KEY_GRANULARITY, self.head_dim, dtype)
        v = self.v_codecs[layer].dequantize_parts(v_parts, VALUE_GRANULARITY, self.head_dim, dtype)
        return k, v
