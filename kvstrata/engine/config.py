"""ModelConfig: the geometry and numerics of one Llama-family checkpoint.

Built from a Hugging Face ``config.json`` (``from_hf``) or from GGUF metadata (``from_gguf``), and written
back as a Hugging Face ``config.json`` (``to_hf``) so that a converted GGUF is an ordinary model directory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvstrata import geometry

# Hugging Face architecture name -> (model_type, qkv bias, q/k RMSNorm)
ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}
MODEL_TYPES = {model_type: arch for arch, (model_type, _, _) in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3"|"yarn"|"dynamic", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama with attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama with attention_bias=True)
    mlp_bias: bool = False
    sliding_window: int | None = None  # recorded only; attention here is always full causal
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads={self.q_heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture][0]

    @property
    def group_size(self) -> int:
        """Consecutive query heads per KV head (query head h reads KV head h // group_size)."""
        return self.q_heads // self.kv_heads

    @property
    def attn_scale(self) -> float:
        """Softmax scale the attention callback must use: head_dim ** -0.5."""
        return self.head_dim**-0.5

    # ---------------------------------------------------------------- Hugging Face config.json
    @classmethod
    def from_hf(cls, source: dict[str, Any] | str | Path) -> ModelConfig:
        """From a ``config.json`` dict, file, or model directory (transformers 4.x or 5.x layout)."""
        if isinstance(source, (str, Path)):
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            d = json.loads(path.read_text())
        else:
            d = dict(source)
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            arch = MODEL_TYPES.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported model: architectures={archs} model_type={d.get('model_type')!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        _, qkv_bias, qk_norm = ARCHITECTURES[arch]
        # transformers 5 keeps RoPE in `rope_parameters` (theta included); 4.x in rope_theta + rope_scaling
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        if d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        rope_scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}
        if rope_type in ("llama3", "yarn"):
            rope_scaling.setdefault(
                "original_max_position_embeddings",
                d.get("original_max_position_embeddings") or d["max_position_embeddings"],
            )
        geo = geometry.from_hf(d)
        bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        uses_window = d.get("use_sliding_window", arch == "MistralForCausalLM")
        return cls(
            architecture=arch,
            num_layers=geo.layers,
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            q_heads=geo.q_heads,
            kv_heads=geo.kv_heads,
            head_dim=geo.head_dim,
            vocab_size=d["vocab_size"],
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            attention_bias=qkv_bias or bias,
            attention_out_bias=bias and not qkv_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=d.get("sliding_window") if uses_window else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that both ``from_hf`` and transformers (4.x and 5.x) read back."""
        rope = dict(self.rope_scaling or {"rope_type": "default"})
        eos = list(self.eos_token_ids)
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.q_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "rope_parameters": {**rope, "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type != "qwen2":  # Qwen2's q/k/v bias is implied by its architecture
            d["attention_bias"] = self.attention_out_bias
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = True
        return d

    # ---------------------------------------------------------------- GGUF metadata
    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """From GGUF key/value metadata (``weights_gguf.read_metadata``) and the file's tensor names."""
        arch = meta["general.architecture"]
        hf_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        if arch not in hf_arch:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(hf_arch)}")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        if "rope_freqs.weight" in tensor_names:
            raise ValueError("GGUF files with a rope_freqs tensor (llama3 RoPE factors) are not supported")
        hidden = key("embedding_length")
        geo = geometry.from_gguf(meta)
        head_dim = geo.head_dim
        if key("rope.dimension_count", head_dim) != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        rope_scaling = None
        scaling_type = key("rope.scaling.type", "none")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif scaling_type == "yarn":
            rope_scaling = {
                "rope_type": "yarn",
                "factor": float(key("rope.scaling.factor")),
                "original_max_position_embeddings": key("rope.scaling.original_context_length"),
            }
        elif scaling_type != "none":
            raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
        tokens = meta.get("tokenizer.ggml.tokens") or []
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
        architecture = hf_arch[arch]
        _, qkv_bias, qk_norm = ARCHITECTURES[architecture]
        return cls(
            architecture=architecture,
            num_layers=geo.layers,
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            q_heads=geo.q_heads,
            kv_heads=geo.kv_heads,
            head_dim=head_dim,
            vocab_size=key("vocab_size") or len(tokens),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            qk_norm=qk_norm,
            attention_bias=qkv_bias or "blk.0.attn_q.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        )
