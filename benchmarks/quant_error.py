"""Round-trip relative RMSE of every codec on synthetic and real K/V, as a markdown table.

Real K/V: the default model (SmolLM2-135M-Instruct GGUF) run with transformers over the first
Wikipedia summaries of the default corpus; forward hooks on every layer's ``k_proj``/``v_proj``
capture keys and values, and keys get RoPE applied (the cache stores post-RoPE keys). Errors on
real data are relative RMSE per layer, averaged over layers (layers differ in magnitude by orders).

    .venv/bin/python benchmarks/quant_error.py            # full table (needs the model package)
    .venv/bin/python benchmarks/quant_error.py --no-model # synthetic columns only
    .venv/bin/python benchmarks/quant_error.py --codecs int4,fp4_e2m1  # some codecs only
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from kvstrata.quant import get_codec, list_codecs, relative_rmse, synthetic
from kvstrata.quant.rotation import hadamard_rotate

PAGE = 16
HEADS, HEAD_DIM = 8, 128  # bytes-per-token column geometry


def round_trip(name: str, x: torch.Tensor, granularity: str, rotate: bool = False) -> torch.Tensor:
    """Quantize and decode ``x`` ``[T, H, D]``; channel granularity works on 16-token pages."""
    codec = get_codec(name)
    data = hadamard_rotate(x) if rotate else x
    if granularity == "channel":
        data = data.unflatten(0, (-1, PAGE))
    y = codec.dequantize(codec.quantize(data, granularity)).reshape(x.shape)
    return hadamard_rotate(y) if rotate else y


def capture_kv(texts: int, max_tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
    """Per layer, keys (post-RoPE) and values ``[tokens, kv_heads, head_dim]`` over ``texts`` texts."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvstrata.resources import default_model_path, load_corpus_text

    path = default_model_path()
    # from_pretrained(gguf_file=...) insists on `accelerate`; building from the config does not.
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    keys: list[list[torch.Tensor]] = [[] for _ in range(config.num_hidden_layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(config.num_hidden_layers)]
    positions: dict[str, torch.Tensor] = {}

    def hook(store: list[torch.Tensor], rope: bool):
        def fn(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            x = out[0].view(-1, kv_heads, head_dim)  # batch of one: [T, H, D]
            if rope:
                cos, sin = model.model.rotary_emb(out, positions["ids"])
                k = x.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
                x = apply_rotary_pos_emb(k, k, cos, sin)[1][0].transpose(0, 1)
            store.append(x.detach().clone())

        return fn

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_proj.register_forward_hook(hook(keys[i], rope=True))
        layer.self_attn.v_proj.register_forward_hook(hook(values[i], rope=False))
    paragraphs = [p for p in load_corpus_text().split("\n\n") if len(p) > 1500][:texts]
    with torch.no_grad():
        for text in paragraphs:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
            ids = ids[:, : ids.shape[1] // PAGE * PAGE]
            positions["ids"] = torch.arange(ids.shape[1]).unsqueeze(0)
            model(ids)
    tokens = sum(k.shape[0] for k in keys[0])
    source = f"{path.name}, {len(paragraphs)} texts, {tokens} tokens, {len(keys)} layers"
    return [torch.cat(k) for k in keys], [torch.cat(v) for v in values], source


def layer_mean_error(
    name: str, per_layer: list[torch.Tensor], granularity: str, rotate: bool = False
) -> float:
    errs = [relative_rmse(x, round_trip(name, x, granularity, rotate)) for x in per_layer]
    return sum(errs) / len(errs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=4, help="Wikipedia summaries to run (default 4)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per text (default 256)")
    parser.add_argument("--no-model", action="store_true", help="skip the real K/V columns")
    parser.add_argument("--codecs", default=None, help="comma-separated codecs (default: every codec)")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    gauss = synthetic.gaussian_kv(0, 1024, 4, 128)
    heavy, outliers = synthetic.heavy_tailed_kv(0, 1024, 4, 128)
    real = None if args.no_model else capture_kv(args.texts, args.max_tokens)

    header = ["codec", "B/token", "Gauss tok", "Gauss ch", "t3 tok", "t3 ch", "t3 bulk tok", "t3 bulk ch"]
    if real:
        header += ["K tok", "**K ch**", "K tok+H", "**V tok**", "V ch"]
    rows = []
    for name in args.codecs.split(",") if args.codecs else list_codecs():
        row = [f"`{name}`", str(get_codec(name).bytes_per_token(HEADS, HEAD_DIM))]
        for granularity in ("token", "channel"):
            row.append(f"{relative_rmse(gauss, round_trip(name, gauss, granularity)):.4f}")
        heavy_y = {g: round_trip(name, heavy, g) for g in ("token", "channel")}
        row += [f"{relative_rmse(heavy, heavy_y[g]):.4f}" for g in ("token", "channel")]
        row += [f"{relative_rmse(heavy[~outliers], heavy_y[g][~outliers]):.4f}" for g in ("token", "channel")]
        if real:
            keys, values, _ = real
            row += [
                f"{layer_mean_error(name, keys, 'token'):.4f}",
                f"**{layer_mean_error(name, keys, 'channel'):.4f}**",
                f"{layer_mean_error(name, keys, 'token', rotate=True):.4f}",
                f"**{layer_mean_error(name, values, 'token'):.4f}**",
                f"{layer_mean_error(name, values, 'channel'):.4f}",
            ]
        rows.append(row)

    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print(f"B/token: exact stored bytes per token at {HEADS} heads x head_dim {HEAD_DIM}, token granularity.")
    print("Gauss: N(0,1) x per-token magnitude log-uniform over 16x, 1024 tokens x 4 heads x 128.")
    print("t3: Student-t df=3 plus two +-50 outliers per token-head; bulk = error on the non-outliers.")
    print(f"ch: per-channel scales over {PAGE}-token pages (keys in the cache); tok: per-token (values).")
    if real:
        print(f"K/V: {real[2]}; K post-RoPE; mean over layers of per-layer relative RMSE.")
        print("K tok+H: Hadamard-rotated keys, per-token scales, error after rotating back.")
        print("Bold: the granularity the cache uses (keys per channel, values per token).")
    print(
        f"\nMade by: {' '.join(shlex.quote(a) for a in [sys.executable.split('/work/main/')[-1], *sys.argv])}"
    )
    print(f"({time.perf_counter() - start:.0f} s, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
