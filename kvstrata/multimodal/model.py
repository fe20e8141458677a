"""A vision-language model's image side: tower + connector, preprocessing, and placeholder expansion.

Two families, read from a Hugging Face ``config.json``:

- ``llava`` (``LlavaForConditionalGeneration``): CLIP or SigLIP tower, hidden states of
  ``vision_feature_layer`` (CLS dropped with the ``default`` strategy), MLP projector. One
  ``<image>`` token in the prompt becomes ``tokens_per_image`` placeholder tokens.
- ``idefics3`` (``Idefics3ForConditionalGeneration``, SmolVLM): SigLIP tower (post-LayerNorm),
  pixel-shuffle connector. One ``<image>`` token becomes
  ``<fake_token_around_image><global-img>`` + placeholders + ``<fake_token_around_image>``
  (the processor's layout with image splitting off: one global image per picture).

The language model itself is the engine's Llama-family `Transformer`; features replace the
embeddings of the placeholder positions (see `kvstrata.multimodal.inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from kvstrata.multimodal.connectors import Idefics3Connector, LlavaProjector
from kvstrata.multimodal.vision import VisionConfig, VisionTransformer

FAMILIES = {"LlavaForConditionalGeneration": "llava", "Idefics3ForConditionalGeneration": "idefics3"}
MODEL_TYPES = {"llava": "llava", "idefics3": "idefics3", "smolvlm": "idefics3"}


@dataclass(frozen=True)
class VLMConfig:
    family: str  # "llava" | "idefics3"
    image_token_id: int
    vision: VisionConfig
    feature_layers: tuple[int, ...] = (-2,)  # llava: which hidden states (concatenated)
    select_strategy: str = "default"  # llava: "default" drops the CLS token, "full" keeps all
    projector_act: str = "gelu"
    projector_bias: bool = True
    scale_factor: int = 2  # idefics3 pixel shuffle

    @staticmethod
    def family_of(d: dict[str, Any]) -> str | None:
        for arch in d.get("architectures") or []:
            if arch in FAMILIES:
                return FAMILIES[arch]
        return MODEL_TYPES.get(d.get("model_type", ""))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> VLMConfig:
        family = cls.family_of(d)
        if family is None:
            raise ValueError(f"not a supported vision-language config: {d.get('architectures')}")
        vision = VisionConfig.from_hf(d["vision_config"])
        if family == "llava":
            layers = d.get("vision_feature_layer", -2)
            return cls(
                family=family,
                image_token_id=int(d.get("image_token_index", d.get("image_token_id", 32000))),
                vision=vision,
                feature_layers=tuple(layers) if isinstance(layers, list) else (int(layers),),
                select_strategy=d.get("vision_feature_select_strategy", "default"),
                projector_act=d.get("projector_hidden_act", "gelu"),
                projector_bias=bool(d.get("multimodal_projector_bias", True)),
            )
        return cls(
            family=family,
            image_token_id=int(d.get("image_token_id", 128257)),
            vision=vision,
            scale_factor=int(d.get("scale_factor", 2)),
        )

    @property
    def tokens_per_image(self) -> int:
        patches = self.vision.patches_per_side**2
        if self.family == "idefics3":
            return patches // self.scale_factor**2
        return patches + (1 if self.select_strategy == "full" and self.vision.kind == "clip" else 0)


class VisionEncoder(nn.Module):
    """Pixels [B, 3, H, W] -> features [B, tokens_per_image, text_hidden]."""

    def __init__(self, cfg: VLMConfig, text_hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        v = cfg.vision
        self.vision_model = VisionTransformer(v)
        if cfg.family == "llava":
            width = v.hidden_size * len(cfg.feature_layers)
            self.projector: nn.Module = LlavaProjector(
                width, text_hidden, cfg.projector_act, cfg.projector_bias
            )
        else:
            self.projector = Idefics3Connector(v.hidden_size, text_hidden, cfg.scale_factor)

    def forward(self, pixels: Tensor) -> Tensor:
        tower = self.vision_model
        if self.cfg.family == "idefics3":
            return self.projector(tower(pixels))
        n = tower.cfg.num_layers
        depths = [i if i >= 0 else n + 1 + i for i in self.cfg.feature_layers]
        deepest = tower.hidden_states(pixels, max(depths)) if len(set(depths)) == 1 else None
        states = [deepest if deepest is not None else tower.hidden_states(pixels, d) for d in depths]
        if self.cfg.select_strategy == "default" and tower.cfg.kind == "clip":
            states = [s[:, 1:] for s in states]
        return self.projector(torch.cat(states, dim=-1))


def split_state_dict(hf: dict[str, Tensor], family: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A VLM checkpoint -> (language model tensors named as a ``*ForCausalLM``, encoder tensors named as
    `VisionEncoder`). Reads both transformers 4 (``language_model.model.*``) and 5
    (``model.language_model.*``) layouts."""
    lm: dict[str, Tensor] = {}
    enc: dict[str, Tensor] = {}
    text_prefixes = ("language_model.model.", "language_model.", "text_model.")
    for name, tensor in hf.items():
        key = name.removeprefix("model.") if not name.startswith("model.layers.") else name
        if key.startswith("language_model.lm_head."):
            lm[key.removeprefix("language_model.")] = tensor
        elif key.startswith("lm_head."):
            lm[key] = tensor
        elif key.startswith(text_prefixes):
            prefix = next(p for p in text_prefixes if key.startswith(p))
            lm["model." + key.removeprefix(prefix)] = tensor
        elif key.startswith(("vision_tower.", "vision_model.")):
            sub = key.removeprefix("vision_tower.").removeprefix("vision_model.")
            if sub.startswith("head."):  # SigLIP's pooling head: VLMs use the patch features
                continue
            enc["vision_model." + sub] = tensor
        elif key.startswith("multi_modal_projector."):
            enc["projector." + key.removeprefix("multi_modal_projector.")] = tensor
        elif key.startswith("connector."):
            enc["projector." + key.removeprefix("connector.")] = tensor
        else:
            raise ValueError(f"unexpected tensor {name!r} in a {family} checkpoint")
    return lm, enc
