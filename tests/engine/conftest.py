"""Session fixtures: the default model (float32, CPU) and its Hugging Face reference, each loaded once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models.py
# The test machine's 2 cores are shared by several test runs: with 2 threads each, OpenMP barriers
# make small matmuls ~20x slower than with 1 (measured: [8, 576] x [576, 3072] 50 ms vs 2.5 ms).
torch.set_num_threads(int(os.environ.get("KVSTRATA_TEST_THREADS", "1")))


def hf_reference_from_gguf(path: Path) -> torch.nn.Module:
    """A transformers model holding a GGUF's weights, converted by transformers' own GGUF code.

    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` needs ``accelerate`` (not a dependency),
    so we call the function it uses, ``load_gguf_checkpoint``: transformers' own dequantization and q/k
    un-permutation, independent of ``kvstrata.engine.weights_gguf``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False, assign=True)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys, result
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # buffers were on meta
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def default_model():
    """``load_model(None)`` in float32 on CPU (converted once into the user cache dir, then reused)."""
    from kvstrata.engine.loader import load_model

    return load_model(None, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' LlamaForCausalLM on the default GGUF's weights (float32, CPU)."""
    from kvstrata.resources import default_model_path

    return hf_reference_from_gguf(default_model_path())


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def tiny_path(request, tmp_path_factory):
    """A tiny random model of each architecture the CUDA graph tests run, saved as an HF directory."""
    import tiny_models

    hf = tiny_models.hf_model(request.param)
    return tiny_models.save_hf(hf, tmp_path_factory.mktemp(request.param))
