"""``python -m kvstrata.multimodal.assemble --out DIR``: a LLaVA-style Hugging Face directory from the
embedded SmolLM2-135M-Instruct language model plus a small randomly initialised SigLIP tower and MLP
projector.

No trained vision-language model is available offline, so its answers about images are meaningless;
everything around them is real: image loading, the tower, placeholder spans keyed by the image hash,
shared and pinned image pages, ``cached_tokens``. The directory is an ordinary ``llava`` checkpoint
(transformers 4 tensor names, as ``llava-hf`` publishes them), so transformers loads it too, and a real
checkpoint (``llava-hf/llava-1.5-7b-hf``, ``HuggingFaceTB/SmolVLM-256M-Instruct``) is served the same
way with ``kvstrata serve --model DIR``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 224,
    "patch_size": 28,  # 8 x 8 = 64 image tokens
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": False,  # SigLIP's pooling head: VLMs use the patch features
}
PREPROCESSOR = {
    "image_processor_type": "SiglipImageProcessor",
    "do_resize": True,
    "size": {"height": 224, "width": 224},
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def assemble(out: Path, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from kvstrata import resources
    from kvstrata.engine.loader import converted_dir
    from kvstrata.multimodal.model import VisionEncoder, VLMConfig

    lm_dir = converted_dir(resources.default_model_path())
    text = json.loads((lm_dir / "config.json").read_text())
    text.pop("architectures", None)
    text.pop("name_or_path", None)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(str(lm_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text["vocab_size"] = max(text["vocab_size"], image_token_id + 1)
    tokenizer.save_pretrained(str(out))

    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": image_token_id,
        "image_seq_length": (VISION_CONFIG["image_size"] // VISION_CONFIG["patch_size"]) ** 2,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "full",
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": VISION_CONFIG,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    eos = text.get("eos_token_id")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 1}) + "\n")

    state = {}
    g = torch.Generator().manual_seed(seed)
    for name, tensor in load_file(str(lm_dir / "model.safetensors")).items():
        if name == "model.embed_tokens.weight" and tensor.shape[0] < text["vocab_size"]:
            extra = torch.randn(text["vocab_size"] - tensor.shape[0], tensor.shape[1], generator=g) * 0.02
            tensor = torch.cat([tensor, extra.to(tensor.dtype)])
        state["language_model." + name] = tensor.contiguous()
    torch.manual_seed(seed)
    encoder = VisionEncoder(VLMConfig.from_hf(config), text["hidden_size"])
    for name, tensor in encoder.state_dict().items():
        prefix = "vision_tower." if name.startswith("vision_model.") else "multi_modal_projector."
        state[prefix + name.removeprefix("projector.")] = tensor.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    template = lm_dir / "chat_template.jinja"
    if template.is_file() and not (out / "chat_template.jinja").is_file():
        shutil.copy(template, out / "chat_template.jinja")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvstrata.multimodal.assemble", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tower and projector")
    args = parser.parse_args(argv)
    path = assemble(args.out, args.seed)
    print(f"wrote a LLaVA-style model to {path}; serve it with: kvstrata serve --model {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
