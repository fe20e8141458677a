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
) -> Path:
    """A small random Qwen2-style model (q/k/v biases) with planted key outliers, as safetensors.

    ``init_std`` is larger than the usual 0.02 so that attention is peaked rather than uniform and
    the KV cache's errors reach the logits. The tokenizer is a byte-level BPE trained on ``text``.
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
    model.load_state_dict(state)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: embedded model)")
    parser.add_argument("--tiny", action="store_true", help="a small random Qwen2-style model instead")
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    parser.add_argument("--channels", default=",".join(map(str, DEFAULT_CHANNELS)))
    args = parser.parse_args(argv)
    channels = tuple(int(c) for c in args.channels.split(","))
    if args.tiny:
        from kvstrata.resources import load_corpus_text

        out = build_tiny_outlier_model(args.out_dir, load_corpus_text(), channels=channels, scale=args.scale)
    else:
        out = plant_outliers_in_model(args.model, args.out_dir, channels, args.scale)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
