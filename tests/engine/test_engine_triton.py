"""The "triton" attention backend in the engine: greedy output equals the torch backend's token for
token (float32, kv_cache_dtype "auto", history read from cold pages, chunked prefill).

Everywhere: a tiny random Llama-3 checkpoint (interpreted on CPU: the default model's 30 layers take
about 15 minutes under the interpreter). On CUDA also the default model over 32 tokens, and fp8 history
on a bfloat16 model agreeing with the torch backend as fp8 agrees with unquantized history."""

from __future__ import annotations

import os

import pytest
import tiny_models
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvstrata.engine.attention import get_backend, resolve_backend  # noqa: E402
from kvstrata.engine.engine import Engine  # noqa: E402
from kvstrata.engine.loader import load_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [
    "The history of the Roman Empire",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. In plants, this process",
]
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


def _generate(model, backend: str, prompts, new: int = 32, **kwargs) -> list[list[int]]:
    engine = Engine(model=model, attention_backend=backend, max_total_tokens=4096, **kwargs)
    try:
        assert engine.get_server_info()["attention_backend"] == backend
        params = dict(GREEDY, max_new_tokens=new)
        out = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        stats = engine.check_invariants()
        assert stats.running == 0
        return out
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    path = tiny_models.save_hf(tiny_models.hf_model("llama3"), tmp_path_factory.mktemp("llama3"))
    return load_model(path, dtype=torch.float32, device=DEVICE)


def test_backend_auto_and_errors():
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash", type("C", (), {"device": torch.device("cpu")})(), 1.0)


@pytest.mark.parametrize("codec", ["auto", "int4"])
def test_triton_greedy_equals_torch_tiny(tiny_f32, codec):
    """Window 16, 20-token chunks, 16 new tokens (decode crosses a page boundary): prefill chunks and
    decode read cold pages (fp32 or int4). Kept short: interpreted, each step runs every kernel."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (9, 37, 70)]
    opts = dict(kv_cache_dtype=codec, recent_window=16, page_size=16, chunked_prefill_size=20)
    ref = _generate(tiny_f32, "torch", prompts, new=16, **opts)
    got = _generate(tiny_f32, "triton", prompts, new=16, **opts)
    assert got == ref


@pytest.mark.skipif(DEVICE == "cpu", reason="the default model: CUDA (about 15 minutes interpreted)")
def test_triton_greedy_equals_torch_default_model():
    """32 tokens, window 32 and 24-token chunks: prefill chunks and decode read cold pages."""
    model = load_model(None, dtype=torch.float32, device=DEVICE)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    opts = dict(kv_cache_dtype="auto", recent_window=32, page_size=16, chunked_prefill_size=24)
    ref = _generate(model, "torch", prompts, **opts)
    got = _generate(model, "triton", prompts, **opts)
    assert got == ref


@pytest.mark.skipif(DEVICE == "cpu", reason="bfloat16 engine with fp8 history: CUDA (too slow interpreted)")
def test_triton_fp8_agrees_with_torch():
    from kvstrata.resources import load_corpus_text

    model = load_model(None, dtype=torch.bfloat16, device=DEVICE)
    tok = model.tokenizer
    paragraphs = [p for p in load_corpus_text().split("\n\n") if len(p) > 600][:8]
    prompts = [tok.encode(p)[:160] for p in paragraphs]
    ref = _generate(model, "torch", prompts, kv_cache_dtype="fp8_e4m3", recent_window=128)
    got = _generate(model, "triton", prompts, kv_cache_dtype="fp8_e4m3", recent_window=128)
    agree = [
        next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
        for r, g in zip(ref, got, strict=True)
    ]
    print(f"\ntriton vs torch, fp8_e4m3 bfloat16: agreeing {agree}")
    assert sum(n >= 16 for n in agree) / len(agree) >= 0.75
