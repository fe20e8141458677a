"""Vision transformers of the CLIP / SigLIP family (the towers of LLaVA-1.5, SmolVLM and Idefics3).

One module for all three: patch embedding (a strided convolution), learned position embeddings, an
optional class token and pre-LayerNorm (CLIP), pre-norm encoder layers (MHA with biases, MLP with
``quick_gelu`` or ``gelu_pytorch_tanh``), and a post-LayerNorm. Parameter names follow transformers'
``vision_model.*`` so a checkpoint loads by stripping its prefix. ``hidden_states(pixels, n)`` runs
only the first ``n`` layers, which is all LLaVA's ``vision_feature_layer = -2`` needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class VisionConfig:
    kind: str  # "clip" (class token, pre-LayerNorm) or "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> VisionConfig:
        model_type = d.get("model_type", "clip_vision_model")
        kind = "clip" if model_type.startswith("clip") else "siglip"
        act = d.get("hidden_act", "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
        return cls(
            kind=kind,
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            image_size=d["image_size"],
            patch_size=d["patch_size"],
            num_channels=d.get("num_channels", 3),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-5 if kind == "clip" else 1e-6)),
            hidden_act=act,
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        return self.patches_per_side**2 + (1 if self.kind == "clip" else 0)


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, D, cfg.patch_size, stride=cfg.patch_size, bias=cfg.kind != "clip"
        )
        self.position_embedding = nn.Embedding(cfg.num_positions, D)
        self.class_embedding = nn.Parameter(torch.zeros(D)) if cfg.kind == "clip" else None

    def forward(self, pixels: Tensor) -> Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat((cls, x), dim=1)
        return x + self.position_embedding.weight[None, : x.shape[1]]


class SelfAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(B, T, self.heads, D // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        D, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(D, eps=eps)
        self.self_attn = SelfAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(D, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(D, cfg.intermediate_size)
        self.mlp.fc2 = nn.Linear(cfg.intermediate_size, D)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.embeddings = Embeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(D, eps=cfg.layer_norm_eps) if cfg.kind == "clip" else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)

    def hidden_states(self, pixels: Tensor, num_layers: int) -> Tensor:
        """The input of layer ``num_layers`` (transformers' ``hidden_states[num_layers]``): [B, T, D]."""
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers[:num_layers]:
            x = layer(x)
        return x

    def forward(self, pixels: Tensor) -> Tensor:
        """``last_hidden_state``: every layer, then the post-LayerNorm."""
        return self.post_layernorm(self.hidden_states(pixels, self.cfg.num_layers))
