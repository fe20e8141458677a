"""Tiny random Llama-family checkpoints written at test time (Hugging Face safetensors and GGUF).

Weights are re-drawn with a larger spread than transformers' init (std 0.02 would make every logit ~0 and
the comparisons meaningless), biases and norm weights included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)


def hf_model(kind: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random transformers model: kind = "llama3" (llama3 RoPE), "qwen2" (qkv bias), "qwen3" (q/k norm)."""
    import transformers

    if kind == "llama3":
        cfg = transformers.LlamaConfig(
            **TINY,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=[2, 3],
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=True, eos_token_id=2)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(
            **{**TINY, "num_attention_heads": 8}, head_dim=32, rope_theta=1e6, tie_word_embeddings=False
        )
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def save_hf(model: torch.nn.Module, out_dir: Path, shard: bool = False) -> Path:
    """``save_pretrained`` as safetensors; ``shard`` splits into several files with an index json."""
    model.save_pretrained(str(out_dir), max_shard_size="100KB" if shard else "10GB")
    return out_dir


# ------------------------------------------------------------------------------------------------ GGUF
def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (rows -> interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model: torch.nn.Module, path: Path, quantize_names: tuple[str, ...] = ()) -> dict:
    """Write a Llama ``model`` as a llama.cpp-style GGUF (q/k permuted) with a small byte-level BPE
    tokenizer and chat template. Tensors whose GGUF name contains one of ``quantize_names`` are stored
    as Q8_0. Returns the Hugging Face state dict of the weights as stored (Q8_0 round trip applied, q/k in
    Hugging Face row order), so a reference model loaded with it sees exactly what the file holds."""
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = model.config
    vocab = _byte_tokens() + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    vocab += [f"<extra_{i}>" for i in range(cfg.vocab_size - len(vocab))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([1] * 258 + [3, 3] + [1] * (len(vocab) - 260))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names["lm_head.weight"] = "output.weight"
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    stored = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names[hf_name]
        data = tensor.float().numpy()
        file_data = data
        if name.endswith("attn_q.weight"):
            file_data = permute(data, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            file_data = permute(data, cfg.num_key_value_heads)
        if any(q in name for q in quantize_names):
            # Q8_0 blocks run along a row, so quantizing commutes with the row permutation
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, quantize(file_data, qtype), raw_dtype=qtype)
            data = dequantize(quantize(data, qtype), qtype)
        else:
            w.add_tensor(name, file_data)
        stored[hf_name] = torch.from_numpy(np.array(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 5 to 59 random ids of the tiny models' vocabulary (4 to 299)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 60, (n,), generator=g).tolist()
    return [torch.randint(4, 300, (length,), generator=g).tolist() for length in lengths]
