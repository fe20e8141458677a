"""GGUF -> Hugging Face model directory (config.json, model.safetensors, tokenizer files).

Tensors are dequantized to float32 with the ``gguf`` package. llama.cpp's converter permutes the rows of
``attn_q``/``attn_k`` of ``llama`` models (interleaved-pair RoPE); we undo it so that the half-split
("rotate_half") RoPE of transformers and of ``model.py`` applies. Qwen2/Qwen3 GGUFs are not permuted.
The tokenizer and chat template come from the GGUF metadata through transformers' GGUF support.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.engine.config import ModelConfig

PERMUTED_ARCHS = ("llama",)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    blk, layer, rest = gguf_name.split(".", 2)
    if blk != "blk" or rest not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows (head, pair, 2) -> (head, 2, pair), per head."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, Hugging Face-named float32 state dict, metadata) of a GGUF file."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = ModelConfig.from_gguf(meta, {t.name for t in reader.tensors})
    permute = meta["general.architecture"] in PERMUTED_ARCHS
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # np.array copies: the data of F32 tensors is a read-only view of the memory-mapped file
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if permute and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute(w, config.q_heads)
        elif permute and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute(w, config.kv_heads)
        state[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return config, state, meta


def convert_gguf(path: Path, out_dir: Path) -> ModelConfig:
    """Write ``out_dir`` as a Hugging Face model directory holding the dequantized GGUF."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    config, state, meta = read_gguf(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    hf_config = config.to_hf()
    hf_config["name_or_path"] = str(meta.get("general.name") or path.stem)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out_dir))
    return config
