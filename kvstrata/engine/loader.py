"""load_model: a path (GGUF file, or Hugging Face safetensors directory) or None -> LoadedModel.

None loads the embedded default model (SmolLM2-135M-Instruct, GGUF). A GGUF file is converted once into a
Hugging Face directory (dequantized float32 safetensors + config.json + tokenizer files) under the cache
directory, so later starts read safetensors and skip the GGUF parse and dequantization:

    $KVSTRATA_CACHE_DIR/models/<stem>-<hash>   or   ~/.cache/kvstrata/models/<stem>-<hash>

``<hash>`` covers the GGUF's resolved path, size and mtime and the converter version; delete the
directory (or all of ``models/``) to clear it.

``load_format="dummy"`` (SGLang's name) reads only ``config.json`` (and tokenizer files when present)
and draws random weights on the device, so a model of any supported geometry (Llama-3-8B for
benchmarks) runs with nothing downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvstrata.engine.config import ModelConfig
from kvstrata.engine.model import Transformer
from kvstrata.engine.tokenizer import thread_safe

log = logging.getLogger(__name__)
CONVERTER_VERSION = 1
SOURCE_FILE = "kvstrata-source.json"
LOAD_FORMATS = ("auto", "dummy")
# transformers' default initializer_range: random Llama weights with this spread give finite, varied
# logits through 32 layers in bfloat16.
DUMMY_INIT_STD = 0.02


@dataclasses.dataclass
class LoadedModel:
    net: Transformer
    config: ModelConfig
    tokenizer: Any  # transformers PreTrainedTokenizerFast with chat template; None if the directory has none
    name: str
    path: Path  # what was loaded: the GGUF file or the model directory
    vision: Any = None  # vision-language models: the image side (kvstrata.multimodal.VisionLanguage)

    def __post_init__(self) -> None:
        # Used by the engine thread, callers' threads and the server's event loop at once.
        self.tokenizer = thread_safe(self.tokenizer)


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """torch dtype, or "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16", "float16"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in named:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(named)}")
    return named[dtype]


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
) -> LoadedModel:
    from kvstrata import resources

    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use {' or '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        return load_dummy(path, dtype, device)
    alias = resources.model_alias_path(str(path)) if path is not None else None
    if path is None:
        source, name = resources.default_model_path(), resources.DEFAULT_MODEL_NAME
    elif alias is not None:
        source, name = alias, alias.stem
    else:
        source = Path(path).expanduser()
        name = source.stem if source.is_file() else source.name
    if not source.exists():
        raise FileNotFoundError(f"model path {source} does not exist")
    if source.is_dir() and not (source / "config.json").is_file():
        ggufs = sorted(source.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"{source} has no config.json and {len(ggufs)} .gguf files; pass one file")
        source = ggufs[0]
    model_dir = converted_dir(source) if source.suffix == ".gguf" else source
    if "vision_config" in json.loads((model_dir / "config.json").read_text()):
        # A vision-language directory (LLaVA, Idefics3): the one place the engine reaches up, lazily.
        from kvstrata.multimodal.loader import load_vlm

        return load_vlm(model_dir, name, dtype, device)
    config = read_config(model_dir)
    net = build_model(config, read_safetensors(model_dir), dtype, device)
    return LoadedModel(net=net, config=config, tokenizer=load_tokenizer(model_dir), name=name, path=source)


def load_dummy(
    path: str | Path | None, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> LoadedModel:
    """The model of ``path``'s config.json (a directory or the file itself) with random weights."""
    if path is None:
        raise ValueError("load_format='dummy' needs a model path: a directory with a config.json")
    source = Path(path).expanduser()
    model_dir = source.parent if source.is_file() and source.name == "config.json" else source
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"load_format='dummy': no config.json in {model_dir}")
    config = read_config(model_dir)
    net = dummy_model(config, dtype, device, seed)
    tokenizer = load_tokenizer(model_dir)
    return LoadedModel(net=net, config=config, tokenizer=tokenizer, name=model_dir.name, path=model_dir)


def dummy_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Transformer:
    """A ready Transformer with random weights allocated once, directly in ``dtype`` on ``device``:
    matrices and embeddings N(0, DUMMY_INIT_STD), norm weights 1, biases 0; the same seed, device
    and dtype give the same weights."""
    with torch.device("meta"):
        net = Transformer(config)
    inv_freq = net.inv_freq  # computed on the CPU in float32 even under the meta device
    net = net.to(dtype).to_empty(device=device)
    net.tie_weights()  # to_empty gives each use of a tied tensor its own storage
    net.inv_freq = inv_freq.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in net.named_parameters():  # a tied tensor is listed once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, DUMMY_INIT_STD, generator=gen)
    return net.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------- GGUF cache
def cache_root() -> Path:
    env = os.environ.get("KVSTRATA_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvstrata"


def converted_dir(gguf_path: Path) -> Path:
    """The cached Hugging Face directory of a GGUF file, converting it on first use."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    source = {
        "path": str(gguf_path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter": CONVERTER_VERSION,
    }
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf_path.stem}-{digest}"
    if (target / SOURCE_FILE).is_file():
        return target
    from kvstrata.engine.weights_gguf import convert_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        log.info("converting %s into %s (first start only)", gguf_path, target)
        convert_gguf(gguf_path, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; use its copy
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------- HF directory
def read_config(model_dir: Path, hf_config: dict[str, Any] | None = None) -> ModelConfig:
    """config.json (or ``hf_config``, e.g. a VLM's ``text_config``), with eos ids from
    generation_config.json added (instruct models often list several)."""
    config = ModelConfig.from_hf(hf_config if hf_config is not None else model_dir / "config.json")
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
        config = dataclasses.replace(
            config, eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
        )
    if config.sliding_window is not None and config.sliding_window < config.max_position_embeddings:
        log.warning("sliding_window=%d is ignored: attention is full causal", config.sliding_window)
    return config


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(model_dir / file)))
    return state


def load_tokenizer(model_dir: Path) -> Any:
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        log.warning("%s has no tokenizer files; the model takes token ids only", model_dir)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def internal_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> ours, fusing q/k/v into ``wqkv`` and gate/up into ``w13``."""
    hf = {k.removeprefix("model."): v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"checkpoint has no tensor {name!r}")
        return hf.pop(name)

    sd = {"embed.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
        sd["lm_head.weight"] = sd["embed.weight"]
    else:
        sd["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        sd[dst + "attn_norm.weight"] = take(src + "input_layernorm.weight")
        sd[dst + "mlp_norm.weight"] = take(src + "post_attention_layernorm.weight")
        attn = src + "self_attn."
        kinds = ["weight", "bias"] if config.attention_bias else ["weight"]
        for kind in kinds:
            parts = [take(f"{attn}{p}_proj.{kind}") for p in "qkv"]
            sd[f"{dst}attn.wqkv.{kind}"] = torch.cat(parts)
        for kind in ["weight", "bias"] if config.attention_out_bias else ["weight"]:
            sd[f"{dst}attn.wo.{kind}"] = take(f"{attn}o_proj.{kind}")
        if config.qk_norm:
            sd[dst + "attn.q_norm.weight"] = take(attn + "q_norm.weight")
            sd[dst + "attn.k_norm.weight"] = take(attn + "k_norm.weight")
        for kind in ["weight", "bias"] if config.mlp_bias else ["weight"]:
            gate, up = take(f"{src}mlp.gate_proj.{kind}"), take(f"{src}mlp.up_proj.{kind}")
            sd[f"{dst}mlp.w13.{kind}"] = torch.cat([gate, up])
            sd[f"{dst}mlp.w2.{kind}"] = take(f"{src}mlp.down_proj.{kind}")
    if hf:
        raise ValueError(f"checkpoint has {len(hf)} unexpected tensors, e.g. {sorted(hf)[:3]}")
    return sd


def build_model(
    config: ModelConfig, hf_state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> Transformer:
    """A ready (eval, no grad) Transformer from a Hugging Face-named state dict."""
    sd = internal_state_dict(hf_state, config)
    with torch.device("meta"):
        net = Transformer(config)
    cast = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    net.load_state_dict(cast, strict=True, assign=True)
    net.tie_weights()
    net.inv_freq = net.inv_freq.to(device)
    return net.eval().requires_grad_(False)
