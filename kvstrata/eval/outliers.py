"""Models with planted outlier key channels, to test KV quantization where keys are hard.

Some families (Qwen2 for one) carry a few key channels tens of times larger than the rest. Per-token
key scales then spend their range on those channels and crush the others at 4 bits; per-channel
scales do not. ``plant_key_outliers`` reproduces that on any Llama-family checkpoint *without
changing the model's function*: it multiplies chosen key channels by ``scale`` (both halves of each
RoPE pair, so RoPE commutes with it) and divides the matching query channels of every query head of
the group by ``scale``, so every q·k logit is unchanged in exact arithmetic. The unquantized
perplexity stays the same; only the K cache's statistics change. Any drift is the quantizer's.

``python -m kvstrata.eval.outliers OUT_DIR`` writes such a copy of the default model (or of
``--model DIR``, or ``--tiny`` for a small random Qwen2 with its own small tokenizer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

DEFAULT_CHANNELS = (3, 17)  # channel indices within the first half of head_dim; each with its RoPE pair
DEFAULT_SCALE = 30.0


def outlier_channels(head_dim: int, channels: tuple[int, ...]) -> list[int]:
    half = head_dim // 2
    out = []
    for c in channels:
        c %= half
        out += [c, c + half]
    return sorted(set(out))


@torch.no_grad()
def plant_key_outliers(
    state: dict[str, torch.Tensor],
    num_layers: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    channels: tuple[int, ...] = DEFAULT_CHANNELS,
    scale: float = DEFAULT_SCALE,
    layers: list[int] | None = None,
) -> None:
    """Scale key channels up and the matching query channels down, in place (HF weight names)."""
    group = q_heads // kv_heads
    chans = torch.tensor(outlier_channels(head_dim, channels))
    for layer in range(num_layers) if layers is None else layers:
        prefix = f"model.layers.{layer}.self_attn."
        for kv in range(kv_heads):
            k_rows = kv * head_dim + chans
            for name in ("k_proj.weight", "k_proj.bias"):
                if prefix + name in state:
                    state[prefix + name][k_rows] *= scale
            for h in range(kv * group, (kv + 1) * group):
                q_rows = h * head_dim + chans
                for name in ("q_proj.weight", "q_proj.bias"):
                    if prefix + name in state:
                        state[prefix + name][q_rows] /= scale


def low_frequency_channels(head_dim: int, pairs: int) -> list[int]:
    """The channels of the ``pairs`` lowest-frequency RoPE pairs (last of each half), with partners."""
    half = head_dim // 2
    return sorted(c for i in range(pairs) for c in (half - 1 - i, head_dim - 1 - i))


@torch.no_grad()
def plant_key_offsets(
    state: dict[str, torch.Tensor],
    layers: list[int],
    kv_heads: int,
    head_dim: int,
    offset: float,
    pairs: int = 2,
) -> None:
    """Add ``offset`` to the key bias of the lowest-frequency RoPE channels of ``layers``, in place.

    This is what Qwen2.5 checkpoints carry (docs/eval.md): k_proj biases of 100-200 on channels
    29-31 and 61-63 of layers 0, 1 and 8, hundreds of times the keys' variation there. A constant key
    offset shifts every logit of a query by the same amount (softmax ignores it) as long as RoPE does
    not rotate it: at the lowest frequencies (rope_theta 1e6: ~1e-5 rad per position) it barely does,
    so the model's function is kept to within that rotation. Per-channel absmax scales then spend a
    4-bit float grid's coarse top steps on the offset: fp4 E2M1's top step is a third of the range,
    so the channel's variation is lost, while int4's min/max affine grid keeps it.
    """
    chans = torch.tensor(low_frequency_channels(head_dim, pairs))
    for layer in layers:
        bias = state[f"model.layers.{layer}.self_attn.k_proj.bias"]
        for kv in range(kv_heads):
            bias[kv * head_dim + chans] += offset


def _train_tokenizer(text: str, vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def build_tiny_outlier_model(
    out_dir: str | Path,
    text: str,
    *,
    num_layers: int = 4,
    hidden: int = 128,
    q_heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 512,
    init_std: float = 0.08,
    channels: tuple[int, ...] = DEFAULT_CHANNELS,
    scale: float = DEFAULT_SCALE,
    seed: int = 0,
    key_offset: float = 0.0,
    offset_layers: tuple[int, ...] = (0,),
    rope_theta: float = 10000.0,
) -> Path:
    """A small random Qwen2-style model (q/k/v biases) with planted key outliers, as safetensors.

    ``init_std`` is larger than the usual 0.02 so that attention is peaked rather than uniform and
    the KV cache's errors reach the logits. The tokenizer is a byte-level BPE trained on ``text``.
    ``key_offset`` plants Qwen2.5's real outlier, a large key bias on the lowest-frequency RoPE channels of
    ``offset_layers`` (`plant_key_offsets`; use it with ``rope_theta`` 1e6, Qwen2.5's).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(text[:200_000], vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        rope_theta=rope_theta,
        initializer_range=init_std,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:  # Qwen2 biases start at zero; give keys a realistic offset
            layer.self_attn.k_proj.bias.normal_(0.0, 0.5)
            layer.self_attn.q_proj.bias.normal_(0.0, 0.5)
    state = model.state_dict()
    plant_key_outliers(state, num_layers, q_heads, kv_heads, hidden // q_heads, channels, scale)
    if key_offset:
        plant_key_offsets(state, list(offset_layers), kv_heads, hidden // q_heads, key_offset)
    model.load_state_dict(state)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def capture_kv(model: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (K, V) ``[T, H, D]`` the cache would store for ``ids`` (post-RoPE keys)."""
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    dense = model.net.dense_attn_for([ids.shape[0]])

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        captured.append((k.float().cpu(), v.float().cpu()))
        return dense(layer, q, k, v)

    with torch.inference_mode():
        model.net(ids.to(model.net.device), torch.arange(ids.shape[0], device=model.net.device), attn=attn)
    return captured


def channel_statistics(x: torch.Tensor, skip: int = 1) -> dict[str, Any]:
    """Outlier statistics of one layer's keys or values ``[T, H, D]``, first ``skip`` tokens left out.

    ``channel_ratio``: the largest channel's absmax over the median channel's (per head, max over
    heads); ``offset_ratio``: the largest |mean| / std of a channel (a large constant offset is what
    coarse 4-bit grids lose); ``sink_ratio``: the first token's absmax over the rest's.
    """
    body = x[skip:]
    absmax = body.abs().amax(dim=0)  # [H, D]
    ratio = absmax.amax(-1) / absmax.median(-1).values.clamp_min(1e-12)
    offset = (body.mean(0).abs() / body.std(0).clamp_min(1e-12)).amax()
    top = absmax.amax(0).topk(min(4, absmax.shape[-1])).indices.tolist()
    return {
        "channel_ratio": round(float(ratio.amax()), 2),
        "top_channels": top,
        "absmax": round(float(absmax.amax()), 2),
        "offset_ratio": round(float(offset), 2),
        "sink_ratio": round(float(x[:skip].abs().amax() / body.abs().amax().clamp_min(1e-12)), 2),
    }


def kv_statistics(model: Any, ids: torch.Tensor) -> list[dict[str, Any]]:
    """``channel_statistics`` of keys and values, per layer."""
    return [
        {"layer": i, "k": channel_statistics(k), "v": channel_statistics(v)}
        for i, (k, v) in enumerate(capture_kv(model, ids))
    ]


def hf_directory(src: str | Path | None) -> Path:
    """A Hugging Face directory for ``src``: itself, or the engine's converted copy of a GGUF."""
    from kvstrata.engine.loader import converted_dir
    from kvstrata.resources import default_model_path

    path = Path(src) if src is not None else default_model_path()
    return converted_dir(path) if path.suffix == ".gguf" else path


def plant_outliers_in_model(
    src: str | Path | None,
    out_dir: str | Path,
    channels: tuple[int, ...] = DEFAULT_CHANNELS,
    scale: float = DEFAULT_SCALE,
) -> Path:
    """Copy a checkpoint (HF directory, GGUF file, or None = the default model) with planted outliers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = hf_directory(src)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    state = model.state_dict()
    plant_key_outliers(
        state,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        head_dim,
        channels,
        scale,
    )
    model.load_state_dict(state)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def print_statistics(model_path: str | None, tokens: int, out: str) -> int:
    """Write (JSON to ``out``) and print the per-layer K/V statistics of a model over corpus tokens."""
    import json

    from kvstrata.engine.loader import load_model
    from kvstrata.eval.corpus import read_corpus, tokenize_windows

    model = load_model(model_path)
    ids = torch.tensor(tokenize_windows(read_corpus(None), model.tokenizer, tokens, tokens)[0])
    stats = kv_statistics(model, ids)
    doc = {"model": model.name, "tokens": tokens, "layers": stats}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    print("layer | K channel max/median | K top channels | K |mean|/std | K sink | V max/median | V sink")
    for row in stats:
        k, v = row["k"], row["v"]
        print(
            f"{row['layer']} | {k['channel_ratio']} | {k['top_channels']} | {k['offset_ratio']} | "
            f"{k['sink_ratio']} | {v['channel_ratio']} | {v['sink_ratio']}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: embedded model)")
    parser.add_argument("--tiny", action="store_true", help="a small random Qwen2-style model instead")
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    parser.add_argument("--channels", default=",".join(map(str, DEFAULT_CHANNELS)))
    parser.add_argument("--stats", type=int, default=0, help="print K/V statistics over N corpus tokens")
    args = parser.parse_args(argv)
    channels = tuple(int(c) for c in args.channels.split(","))
    if args.stats:
        return print_statistics(args.model, args.stats, args.out_dir)
    if args.tiny:
        from kvstrata.resources import load_corpus_text

        out = build_tiny_outlier_model(args.out_dir, load_corpus_text(), channels=channels, scale=args.scale)
    else:
        out = plant_outliers_in_model(args.model, args.out_dir, channels, args.scale)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
