"""Load-time precision plan: a short sensitivity pass that keeps fragile layers at a wider codec.

Some models break one codec in a few layers only: on Qwen2.5-Coder-0.5B fp4_e2m1 history costs +11%
perplexity while int4 and fp8 cost < 0.3% (docs/eval.md). So when the history codec is one name for
every layer, the engine runs this pass once per model and codec (the plan is cached on disk):

1. **Screen** (cheap, every layer, keys and values separately): one unquantized forward over the first
   ``tokens`` tokens of the embedded corpus captures each layer's q, k, v. Each layer's keys (then values)
   go through the real cold pool (`ColdPool.write`/`read`, the codec's own page layout and scales) and
   the layer's attention is recomputed with them, history fully quantized except the sink page (window
   0: the strongest signal for a short pass). The score is the relative error of the attention output.
2. **Plans**: entries (layer, K or V) are raised to the wider codec in score order while the plan's
   cold bytes per token stay within ``uniform + extra_bytes x BF16``; candidates raise the top 0, 1, 2,
   4, ... entries up to that limit.
3. **Verify** (through the real cache path, `StratifiedKVCache` in teacher forcing, page-sized chunks,
   window 0 and sinks): the uniform codec runs first against the unquantized cache; when its mean
   KL(reference || plan) is within ``kl_budget`` nothing is raised (one short pass on benign models).
   Otherwise the other candidates run in lockstep, and the plan kept is the one raising the fewest
   entries within the budget, or, when none is, the one with the lowest KL.

**Key centering** (candidates of step 3 when the uniform codec fails, zero bytes per token): every
layer's keys minus a fixed per-(head, channel) vector, the mean of the captured keys after RoPE. A
shift shared by all keys of a query leaves softmax, hence attention, exactly unchanged, but real keys
carry large per-channel offsets (Qwen2.5's k_proj bias, hundreds of times a channel's spread on the
lowest-frequency RoPE channels, which RoPE barely rotates) that a float grid with per-channel absmax
scales spends its coarse top steps on. Centered candidates (uniform, then raising entries of a screen
of the centered keys) run beside the uncentered ones; at equal raised entries a centered one is
preferred. The engine applies the chosen centers in the model (`Transformer.set_key_centers`), so
every key it stores, ring and sink page included, is centered.

The chosen plan is logged, reported by `/v1/cache` and the ``kvstrata:kv_layer_codec`` metric, and can
be written (``--kv-plan-out plan.json``) and served again (``--kv-cache-dtype plan.json``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvstrata.radix.pool import ColdPool, cold_page_bytes, layer_codec_name, split_layer_codec

log = logging.getLogger("kvstrata.kvplan")
PLAN_VERSION = 2
# The codec a failing part is raised to, per history codec. Keys get an affine (min/max per channel)
# codec: what breaks float grids on real keys is a large per-channel offset (Qwen2.5's k_proj bias, up
# to ~470x the channel's spread), whose variation a float grid's coarse top steps lose at any scale.
WIDER_K = {
    "fp4_e2m1": "int4",
    "int4": "int8_asym",
    "fp8_e5m2": "int8_asym",
    "fp8_e4m3": "int8_asym",
    "int8": "int8_asym",
    "int8_asym": "bf16",
}
WIDER_V = {
    "fp4_e2m1": "fp8_e4m3",
    "int4": "int8",
    "fp8_e5m2": "fp8_e4m3",
    "fp8_e4m3": "int8",
    "int8": "bf16",
    "int8_asym": "bf16",
}
WIDER = {"k": WIDER_K, "v": WIDER_V}


# KL budget of the verification run (window 0, sinks, 256 tokens) by the codec's bits per element.
# Measured there: fp4 0.018 (SmolLM2) vs 0.346 (Qwen2.5-Coder-0.5B), fp8_e4m3 0.0013 vs 0.0056,
# int4 0.0026 vs 0.0012: the budgets pass the benign model with ~2x margin and catch the outlier one.
KL_BUDGET = {4: 0.03, 8: 0.003}


@dataclass(frozen=True)
class PlanSettings:
    tokens: int = 256  # corpus tokens of the pass
    extra_bytes: float = 0.038  # cold bytes per token a plan may add, share of BF16 (fp4: <= 0.32x)
    kl_budget: float | None = None  # mean KL (nats/token) a plan must stay within; None: KL_BUDGET by width


@dataclass(frozen=True)
class EntryScore:
    layer: int
    kind: str  # "k" or "v"
    error: float  # relative error of the layer's attention output with this part quantized

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "kind": self.kind, "error": round(self.error, 6)}


def plan_codecs(codec: str, num_layers: int, raised: Sequence[EntryScore]) -> list[str]:
    """Layer codec names: ``codec`` everywhere, ``WIDER[kind][codec]`` for the raised entries."""
    k, v = [codec] * num_layers, [codec] * num_layers
    for e in raised:
        (k if e.kind == "k" else v)[e.layer] = WIDER[e.kind][codec]
    return [layer_codec_name(a, b) for a, b in zip(k, v, strict=True)]


@torch.inference_mode()
def capture_qkv(net: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer, (q, k, v) of an unquantized forward over ``ids`` (what the cache would store)."""
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    dense = net.dense_attn_for([ids.shape[0]])

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out.append((q, k, v))
        return dense(layer, q, k, v)

    net(ids, torch.arange(ids.shape[0], device=ids.device), attn=attn)
    return out


def key_centers(
    captured: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], page_size: int
) -> torch.Tensor:
    """[L, Hkv, D] float32: per layer, the mean key after RoPE over the captured tokens past the sink page
    (all of them when there is no more than one page)."""
    return torch.stack([(k[page_size:] if len(k) > page_size else k).float().mean(0) for _, k, _ in captured])


def centered_capture(
    captured: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], centers: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [(q, k.float() - centers[i].to(k.device), v) for i, (q, k, v) in enumerate(captured)]


def centers_of(doc: dict[str, Any] | None) -> torch.Tensor | None:
    """A plan document's key centers [L, Hkv, D] (None when it has none)."""
    if not doc or doc.get("key_centers") is None:
        return None
    return torch.tensor(doc["key_centers"], dtype=torch.float32)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    q, k, v = (t.float().transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    return out[0]


def _roundtrip(codec: str, k: torch.Tensor, v: torch.Tensor, page_size: int) -> tuple[torch.Tensor, ...]:
    """K and V after a write into and a read from a cold pool of ``codec`` (whole pages only)."""
    pages = k.shape[0] // page_size
    heads, dim = k.shape[1:]
    pool = ColdPool([codec], pages, page_size, heads, dim, k.device)
    ids = torch.arange(pages, device=k.device)
    shape = (pages, page_size, heads, dim)
    n = pages * page_size
    pool.write(0, ids, k[:n].reshape(shape), v[:n].reshape(shape))
    kq, vq = pool.read(0, ids, torch.float32)
    return kq.reshape(n, heads, dim), vq.reshape(n, heads, dim)


@torch.inference_mode()
def screen(
    captured: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    codec: str,
    page_size: int,
    scale: float,
    sinks: bool,
) -> list[EntryScore]:
    """Every (layer, kind) entry's attention-output error with only that part in ``codec``, worst first."""
    out = []
    for layer, (q, k, v) in enumerate(captured):
        n = (k.shape[0] // page_size) * page_size
        q, k, v = q[:n].float(), k[:n].float(), v[:n].float()
        kq, vq = _roundtrip(codec, k, v, page_size)
        if sinks:  # the sink page stays in the ring dtype
            kq[:page_size], vq[:page_size] = k[:page_size], v[:page_size]
        ref = _attend(q, k, v, scale)
        norm = ref.norm().clamp_min(1e-30)
        for kind, (kk, vv) in (("k", (kq, v)), ("v", (k, vq))):
            err = float((_attend(q, kk, vv, scale) - ref).norm() / norm)
            out.append(EntryScore(layer, kind, err))
    return sorted(out, key=lambda e: e.error, reverse=True)


def candidate_plans(
    codec: str,
    ranking: Sequence[EntryScore],
    num_layers: int,
    max_bytes: float,
    page_bytes: Any,
) -> list[int]:
    """How many top entries each candidate raises: 0, 1, 2, 4, ... and the most that fit ``max_bytes``."""
    most = 0
    for j in range(1, len(ranking) + 1):
        if page_bytes(plan_codecs(codec, num_layers, ranking[:j])) > max_bytes:
            break
        most = j
    counts = [0]
    j = 1
    while j < most:
        counts.append(j)
        j *= 2
    if most:
        counts.append(most)
    return counts


@torch.inference_mode()
def verify(
    net: Any,
    ids: list[int],
    plans: Sequence[list[str]],
    cache_geometry: dict[str, Any],
    scale: float,
    centers: Sequence[torch.Tensor | None] | None = None,
) -> list[float]:
    """Mean KL(reference || plan) per plan, teacher forcing through `StratifiedKVCache` in lockstep.

    Window 0 with sinks; each page-sized chunk sees every older page from the cold pool, as in decode.
    ``centers[i]`` [L, Hkv, D] (or None) is subtracted from plan i's keys before they enter its cache.
    """
    from kvstrata.radix import CacheConfig, StratifiedKVCache

    page = cache_geometry["page_size"]
    n = (len(ids) // page) * page
    layers = cache_geometry["num_layers"]
    configs = [(["fp32"] * layers, torch.float32, False), *((p, torch.bfloat16, True) for p in plans)]
    shifts = [None, *(centers if centers is not None else [None] * len(plans))]
    shifts = [None if c is None else c.to(device=net.device, dtype=net.dtype) for c in shifts]
    caches, seqs = [], []
    for codecs, ring, sinks in configs:
        cache = StratifiedKVCache(
            CacheConfig(
                **cache_geometry,
                recent_window=0,
                layer_codecs=codecs,
                ring_dtype=ring,
                num_pages=n // page + 2,
                max_running=1,
                sinks=sinks,
                device=net.device,
            )
        )
        caches.append(cache)
        seqs.append(cache.admit(list(ids[:n])))
    tokens = torch.tensor(ids[:n], device=net.device)
    kl = torch.zeros(len(plans), dtype=torch.float64)
    scored = 0
    for start in range(0, n, page):
        chunk = tokens[start : start + page]
        batches = [c.begin_step([s], [page]) for c, s in zip(caches, seqs, strict=True)]

        def attn(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batches: list[Any] = batches
        ) -> torch.Tensor:
            outs = []
            for i, (c, b) in enumerate(zip(caches, batches, strict=True)):
                qi, ki, vi = (t[i * page : (i + 1) * page] for t in (q, k, v))
                if shifts[i] is not None:
                    ki = ki - shifts[i][layer]
                outs.append(c.attention(layer, b, qi, ki, vi, scale))
            return torch.cat(outs)

        pos = torch.arange(start, start + page, device=net.device)
        logits = net(chunk.repeat(len(caches)), pos.repeat(len(caches)), attn=attn)
        for c, b in zip(caches, batches, strict=True):
            c.end_step(b)
        logp = torch.log_softmax(logits.float().view(len(caches), page, -1), dim=-1)
        ref = logp[0]
        kl += (ref.exp()[None] * (ref[None] - logp[1:])).sum(-1).sum(-1).double().cpu()
        scored += page
    for c, s in zip(caches, seqs, strict=True):
        c.finish(s, insert=False)
    return (kl / scored).tolist()


def choose(kls: Sequence[float], counts: Sequence[int], budget: float) -> int:
    """Index of the candidate kept: fewest raised entries within ``budget``, else the lowest KL."""
    for i, kl in enumerate(kls):
        if kl <= budget:
            return i
    return min(range(len(kls)), key=lambda i: (kls[i], counts[i]))


@dataclass(frozen=True)
class Candidate:
    raised: tuple[EntryScore, ...]
    centered: bool
    codecs: list[str]


def build_plan(
    net: Any,
    ids: list[int],
    codec: str,
    geometry: dict[str, Any],
    scale: float,
    sinks: bool,
    settings: PlanSettings,
) -> dict[str, Any]:
    """Run the pass over ``ids`` and return the plan document (``layer_codecs`` + what chose it)."""
    layers, page = geometry["num_layers"], geometry["page_size"]
    heads, dim = geometry["kv_heads"], geometry["head_dim"]

    def page_bytes(codecs: list[str]) -> float:
        return cold_page_bytes(codecs, page, heads, dim) / page

    bf16 = page_bytes(["bf16"] * layers)
    uniform = page_bytes([codec] * layers)
    max_bytes = uniform + settings.extra_bytes * bf16
    tokens = torch.tensor(ids, device=net.device)
    captured = capture_qkv(net, tokens)
    ranking = screen(captured, codec, page, scale, sinks)
    budget = settings.kl_budget
    if budget is None:
        budget = KL_BUDGET.get(codec_bits(codec, page, heads, dim), min(KL_BUDGET.values()))
    cands = [Candidate((), False, [codec] * layers)]
    kls = verify(net, ids, [cands[0].codecs], geometry, scale)  # the uniform codec first: most models pass
    centers, centered_ranking = None, None
    if kls[0] > budget:
        centers = key_centers(captured, page)
        centered_ranking = screen(centered_capture(captured, centers), codec, page, scale, sinks)
        plain = candidate_plans(codec, ranking, layers, max_bytes, page_bytes)
        shifted = candidate_plans(codec, centered_ranking, layers, max_bytes, page_bytes)
        more = [(j, True, centered_ranking) for j in shifted] + [(j, False, ranking) for j in plain[1:]]
        more.sort(key=lambda c: (c[0], not c[1]))  # fewest raised entries first, centered before plain
        cands += [Candidate(tuple(r[:j]), c, plan_codecs(codec, layers, r[:j])) for j, c, r in more]
        kls += verify(
            net,
            ids,
            [c.codecs for c in cands[1:]],
            geometry,
            scale,
            [centers if c.centered else None for c in cands[1:]],
        )
    best = cands[choose(kls, [len(c.raised) for c in cands], budget)]
    doc = {
        "layer_codecs": best.codecs,
        "codec": codec,
        "wider_codec": {"k": WIDER_K[codec], "v": WIDER_V[codec]},
        "raised": [e.to_json() for e in best.raised],
        "keys_centered": best.centered,
        "bytes_per_token": page_bytes(best.codecs),
        "bf16_bytes_per_token": bf16,
        "ratio_to_bf16": page_bytes(best.codecs) / bf16,
        "page_size": page,
        "tokens": len(ids),
        "kl_budget": budget,
        "candidates": [
            {
                "raised_entries": len(c.raised),
                "centered": c.centered,
                "kl": round(kl, 6),
                "bytes_per_token": page_bytes(c.codecs),
            }
            for c, kl in zip(cands, kls, strict=True)
        ],
        "screen": [e.to_json() for e in ranking],
        "version": PLAN_VERSION,
    }
    if centered_ranking is not None:
        doc["screen_centered"] = [e.to_json() for e in centered_ranking]
    if best.centered and centers is not None:
        doc["key_centers"] = [[[round(x, 5) for x in head] for head in layer] for layer in centers.tolist()]
    return doc


def raised_layers(codecs: Sequence[str], codec: str) -> list[dict[str, Any]]:
    """The (layer, kind, codec) entries of a plan that differ from ``codec``."""
    out = []
    for layer, name in enumerate(codecs):
        for kind, part in zip("kv", split_layer_codec(name), strict=True):
            if part != codec:
                out.append({"layer": layer, "kind": kind, "codec": part})
    return out


def codec_bits(codec: str, page_size: int, heads: int, head_dim: int) -> int:
    """Bits per element of a codec's codes (scales excluded): 4 for fp4/int4, 8 for fp8/int8, 16 for bf16."""
    from kvstrata.quant import get_codec

    parts = get_codec(codec).page_parts(page_size, heads, head_dim, "token")
    shape, dtype = parts["codes"] if "codes" in parts else next(iter(parts.values()))
    elements = page_size * heads * head_dim
    return round(8 * math.prod(shape) * dtype.itemsize / elements)


def plan_summary(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """What `/v1/cache` shows of a load-time plan (the screen and candidates stay in the plan file)."""
    if doc is None:
        return None
    keys = (
        "codec",
        "wider_codec",
        "raised",
        "keys_centered",
        "bytes_per_token",
        "ratio_to_bf16",
        "kl_budget",
        "candidates",
    )
    return {k: doc[k] for k in keys if k in doc}


def plan_cache_path(root: Path, model_key: str, codec: str, sinks: bool, settings: PlanSettings) -> Path:
    key = json.dumps([PLAN_VERSION, model_key, codec, sinks, settings.__dict__], sort_keys=True)
    return root / "plans" / f"{codec}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def resolve_plan(args: Any, model: Any, codecs: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """The engine's layer codecs after the load-time pass, and the plan document (None: no pass).

    The pass runs when ``args.kv_plan == "auto"``, one quantized codec covers every layer, no plan file
    was given and rotation is off; its result is cached under the engine's cache root, per model file,
    codec and settings. A missing corpus package or tokenizer skips it with a warning.
    """
    codec = codecs[0]
    if (
        args.kv_plan == "off"
        or args.layer_plan is not None
        or args.rotation
        or len(set(codecs)) > 1
        or codec not in WIDER_K
    ):
        return codecs, None
    from kvstrata.engine.loader import cache_root

    settings = PlanSettings(args.kv_plan_tokens, args.kv_plan_extra_bytes, args.kv_plan_kl_budget)
    stat = Path(model.path).stat()
    model_key = f"{Path(model.path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{model.net.dtype}"
    cached = plan_cache_path(cache_root(), model_key, codec, bool(args.sinks), settings)
    doc = _read_cached(cached, len(codecs))
    if doc is None:
        ids = corpus_ids(model, settings.tokens)
        if ids is None:
            return codecs, None
        cfg = model.config
        geometry = {
            "num_layers": cfg.num_layers,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "page_size": args.page_size,
        }
        doc = build_plan(model.net, ids, codec, geometry, cfg.attn_scale, bool(args.sinks), settings)
        doc["model"] = model.name
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(doc, indent=1) + "\n")
    raised = raised_layers(doc["layer_codecs"], codec)
    log.info(
        "kv plan for %s: raised %s%s (%.1f B/token, %.3fx BF16; verify KL by raised entries %s)",
        codec,
        ", ".join(f"layer {r['layer']} {r['kind'].upper()} -> {r['codec']}" for r in raised) or "none",
        "; keys centered" if doc.get("keys_centered") else "",
        doc["bytes_per_token"],
        doc["ratio_to_bf16"],
        ", ".join(
            f"{c['raised_entries']}{'c' * bool(c.get('centered'))}:{c['kl']:.2e}" for c in doc["candidates"]
        ),
    )
    if args.kv_plan_out:
        out = {**doc, "recent_window": args.recent_window, "rotation": False, "sinks": bool(args.sinks)}
        Path(args.kv_plan_out).write_text(json.dumps(out, indent=1) + "\n")
    return list(doc["layer_codecs"]), doc


def raise_codecs(codecs: Sequence[str], choice: str) -> list[str] | None:
    """The raised pool's layer codecs for the drift fallback's precision raise: ``choice`` "auto" widens
    each layer's K and V one step (`WIDER_K`, `WIDER_V`; a part with no wider step keeps its codec),
    a codec name is used for every layer, "off" gives None. None too when nothing would be wider."""
    if choice == "off":
        return None
    if choice != "auto":
        return [choice] * len(codecs)
    out = []
    for name in codecs:
        k, v = split_layer_codec(name)
        out.append(layer_codec_name(WIDER_K.get(k, k), WIDER_V.get(v, v)))
    return out if out != list(codecs) else None


def plan_key_centers(args: Any, doc: dict[str, Any] | None) -> torch.Tensor | None:
    """The key centers the engine applies: the load-time plan's, or those of a plan file it serves."""
    if doc is None and isinstance(args.layer_plan, (str, Path)):
        from kvstrata.engine.defaults import read_plan_file

        doc = read_plan_file(args.layer_plan)
    return centers_of(doc)


def _read_cached(path: Path, num_layers: int) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    ok = isinstance(doc, dict) and len(doc.get("layer_codecs", [])) == num_layers
    return doc if ok else None


def corpus_ids(model: Any, tokens: int) -> list[int] | None:
    from kvstrata.engine.calibrate import corpus_tokens
    from kvstrata.resources import ResourceNotInstalled, load_corpus_text

    if model.tokenizer is None:
        log.warning("kv plan pass skipped: %s has no tokenizer to read the corpus", model.name)
        return None
    try:
        text = load_corpus_text()
    except (ResourceNotInstalled, ValueError) as exc:
        log.warning("kv plan pass skipped: %s", exc)
        return None
    return corpus_tokens(model.tokenizer, text, tokens)
