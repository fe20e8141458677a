"""`load_format="dummy"`: a model from config.json alone, random weights, no checkpoint read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvstrata.engine.config import ModelConfig
from kvstrata.engine.loader import DUMMY_INIT_STD, load_dummy, load_model
from kvstrata.engine.model import Transformer
from kvstrata.engine.options import EngineArgs
from kvstrata.server.config import ServerConfig, add_flags

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# meta-llama/Meta-Llama-3-8B config.json (geometry fields)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def _config_dir(tmp_path: Path, **overrides: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights_are_drawn_in_the_dtype_with_the_documented_spread(tmp_path: Path, dtype) -> None:
    loaded = load_model(_config_dir(tmp_path), dtype=dtype, load_format="dummy")
    net = loaded.net
    assert loaded.tokenizer is None and loaded.name == tmp_path.name
    assert all(p.dtype == dtype and p.device.type == "cpu" for p in net.parameters())
    assert net.inv_freq.dtype == torch.float32
    torch.testing.assert_close(net.inv_freq, Transformer(ModelConfig.from_hf(TINY)).inv_freq, rtol=0, atol=0)
    params = dict(net.named_parameters())
    assert set(params) == set(Transformer(ModelConfig.from_hf(TINY)).state_dict()) - {"inv_freq"}
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = p.float().std().item()
            assert abs(std - DUMMY_INIT_STD) < 0.1 * DUMMY_INIT_STD, (name, std)
            assert abs(p.float().mean().item()) < 0.1 * DUMMY_INIT_STD, name
    ids = torch.tensor([5, 17, 33, 4])
    logits = net(ids, torch.arange(4), Transformer.dense_attn_for([4]))
    assert logits.shape == (4, 300) and torch.isfinite(logits).all() and logits.std() > 0


def test_dummy_weights_are_seeded_and_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    path = _config_dir(tmp_path, tie_word_embeddings=True)
    a = load_dummy(path, torch.float32, torch.device("cpu"), seed=0).net
    b = load_dummy(path / "config.json", torch.float32, torch.device("cpu"), seed=0).net
    c = load_dummy(path, torch.float32, torch.device("cpu"), seed=1).net
    same = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in same)
    assert not torch.equal(a.embed.weight, c.embed.weight)
    assert a.lm_head.weight is a.embed.weight


def test_engine_generates_exact_lengths_from_a_dummy_model(tmp_path: Path) -> None:
    from kvstrata import Engine

    path = _config_dir(tmp_path)
    with Engine(model=str(path), load_format="dummy", kv_cache_dtype="int8", recent_window=16,
                max_total_tokens=1024, max_running_requests=4) as engine:  # fmt: skip
        out = engine.generate(
            input_ids=[[3, 9, 27, 81] * 10, [5] * 20],
            sampling_params={"max_new_tokens": 7, "temperature": 0, "ignore_eos": True},
        )
        assert [len(o["output_ids"]) for o in out] == [7, 7]
        assert all(0 <= t < 300 for o in out for t in o["output_ids"])
        assert engine.get_server_info()["model"] == tmp_path.name
        engine.check_invariants()


def test_dummy_needs_a_config_and_a_known_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a model path"):
        load_model(None, load_format="dummy")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path, load_format="dummy")
    with pytest.raises(ValueError, match="unknown load_format"):
        load_model(_config_dir(tmp_path), load_format="pt")
    with pytest.raises(ValueError, match="load_format must be"):
        EngineArgs(load_format="random").validate()


def test_serve_flag_reaches_the_engine() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, environ={})
    cfg = ServerConfig.from_namespace(parser.parse_args(["--load-format", "dummy", "--model", "/m"]))
    assert cfg.engine_kwargs() == {"load_format": "dummy", "model": "/m"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "safetensors"])


def test_llama3_8b_geometry_from_config_alone_has_8b_parameters() -> None:
    """What `--load-format dummy` builds for a Llama-3-8B config.json (counted on the meta device)."""
    with torch.device("meta"):
        net = Transformer(ModelConfig.from_hf(LLAMA3_8B))
    params = sum(p.numel() for p in net.parameters())
    assert params == 8_030_261_248  # Meta-Llama-3-8B's published parameter count
    assert math.isclose(params * 2 / 2**30, 14.96, abs_tol=0.01)  # GiB of bfloat16 weights
