"""Connectors from vision features to the language model's embedding space.

LLaVA-1.5: a two-layer MLP (``multi_modal_projector.linear_1``, activation, ``linear_2``) on each
patch feature. Idefics3 / SmolVLM: pixel shuffle (``scale_factor``² neighbouring patches folded into
one token, shrinking the token count by that factor) and one bias-free linear layer
(``connector.modality_projection.proj``).
"""

from __future__ import annotations

from torch import Tensor, nn

from kvstrata.multimodal.vision import ACTIVATIONS


class LlavaProjector(nn.Module):
    def __init__(self, vision_dim: int, text_dim: int, act: str, bias: bool = True) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported projector activation {act!r}")
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, features: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


def pixel_shuffle(x: Tensor, scale: int) -> Tensor:
    """[B, S, D] patch features on a square grid -> [B, S / scale², D * scale²] (Idefics3's order)."""
    B, S, D = x.shape
    side = int(S**0.5)
    if side * side != S or side % scale:
        raise ValueError(f"pixel shuffle needs a square grid divisible by {scale}, got {S} patches")
    x = x.view(B, side, side // scale, D * scale).permute(0, 2, 1, 3)
    x = x.reshape(B, side // scale, side // scale, D * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(B, S // (scale * scale), D * scale * scale)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_dim: int, text_dim: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision_dim * scale * scale, text_dim, bias=False)

    def forward(self, features: Tensor) -> Tensor:
        return self.modality_projection.proj(pixel_shuffle(features, self.scale))
