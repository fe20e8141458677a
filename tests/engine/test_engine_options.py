"""EngineArgs: validation messages, dtype/codec resolution, plans, pool sizing."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.engine import options
from kvstrata.engine.inputs import normalize_inputs
from kvstrata.engine.options import EngineArgs, load_plan, pool_pages

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float64"}, "dtype must be"),
        ({"recent_window": 20}, "multiple of page_size"),
        ({"max_running_requests": 0}, "max_running_requests must be >= 1"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static must be in"),
        ({"drift_sample_rate": 2}, "drift_sample_rate must be in"),
        ({"drift_metric": "bleu"}, "drift_metric must be"),
        ({"drift_raise_share": 0.0}, "drift_raise_share must be in"),
        ({"drift_raise_dtype": "fp5"}, "fp5"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).validate()


def test_shipped_defaults_follow_the_codec(tmp_path):
    shipped = EngineArgs()
    assert shipped.kv_cache_dtype == "fp8_e4m3"
    assert (shipped.recent_window, shipped.rotation, shipped.sinks) == (128, False, True)
    fp4 = EngineArgs(kv_cache_dtype="fp4_e2m1")
    assert (fp4.recent_window, fp4.rotation, fp4.sinks) == (256, False, True)
    raw = EngineArgs(kv_cache_dtype="auto")
    assert (raw.recent_window, raw.sinks) == (0, False)
    explicit = EngineArgs(kv_cache_dtype="fp4_e2m1", recent_window=64, sinks=False)
    assert (explicit.recent_window, explicit.sinks) == (64, False)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layer_codecs": ["fp4_e2m1", "fp8_e4m3"], "recent_window": 320}))
    from_plan = EngineArgs(kv_cache_dtype=str(plan))
    assert from_plan.layer_plan == str(plan)
    assert (from_plan.recent_window, from_plan.sinks) == (320, True)
    assert from_plan.resolve_layer_codecs(2, torch.float32) == ["fp4_e2m1", "fp8_e4m3"]
    assert from_plan.resolve_ring_dtype(torch.float32) == torch.bfloat16


def test_auto_resolution():
    a = EngineArgs(kv_cache_dtype="auto")
    assert a.resolve_dtype(CPU) == torch.float32
    assert a.resolve_dtype(torch.device("cuda")) == torch.bfloat16
    assert a.resolve_layer_codecs(3, torch.float32) == ["fp32"] * 3
    assert a.resolve_layer_codecs(2, torch.bfloat16) == ["bf16"] * 2
    assert a.resolve_ring_dtype(torch.float32) == torch.float32  # unquantized: the compute dtype
    assert not a.resolve_sinks(["fp32"] * 3)
    q = EngineArgs(kv_cache_dtype="int8")
    assert q.resolve_layer_codecs(2, torch.float32) == ["int8", "int8"]
    assert q.resolve_ring_dtype(torch.float32) == torch.bfloat16
    assert q.resolve_sinks(["int8"]) and not EngineArgs(kv_cache_dtype="int8", sinks=False).resolve_sinks(
        ["int8"]
    )
    with pytest.raises((KeyError, ValueError)):
        EngineArgs(kv_cache_dtype="int3").resolve_layer_codecs(2, torch.float32)


def test_plan_file_forms(tmp_path):
    assert load_plan(["int4", "fp8_e4m3"]) == ["int4", "fp8_e4m3"]
    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"layers": [{"codec": "int4"}, "fp8_e4m3"]}))
    assert load_plan(f) == ["int4", "fp8_e4m3"]
    f.write_text(json.dumps({"layer_codecs": ["int8"]}))
    assert EngineArgs(layer_plan=str(f)).resolve_layer_codecs(1, torch.float32) == ["int8"]
    with pytest.raises(ValueError, match="layer plan has 1 layers, the model has 2"):
        EngineArgs(layer_plan=str(f)).resolve_layer_codecs(2, torch.float32)
    f.write_text("{")
    with pytest.raises(ValueError, match="cannot read layer plan"):
        load_plan(f)


def test_pool_sizing(monkeypatch):
    assert pool_pages(EngineArgs(max_total_tokens=100, page_size=16), CPU, 1000) == 7
    assert pool_pages(EngineArgs(), CPU, 1000) == 16384 // 16
    monkeypatch.setattr(options, "available_memory", lambda device: 10 << 30)
    assert pool_pages(EngineArgs(mem_fraction_static=0.01), CPU, 1 << 20) == (10 << 30) // 100 // (1 << 20)
    assert pool_pages(EngineArgs(mem_fraction_static=0.01), CPU, 1 << 40) == 1  # never an empty pool


def test_inputs_normalisation():
    b = normalize_inputs(None, [1, 2], {"n": 2}, "r", None)
    assert b.single and b.ids == [[1, 2]] and b.rids == ["r"]
    b = normalize_inputs(None, [[1], [2, 3]], [{}, {"top_k": 2}], None, None)
    assert not b.single and b.params[1] == {"top_k": 2} and b.rids == [None, None]
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        normalize_inputs(None, [[1]], [{}, {}], None, None)
    with pytest.raises(ValueError, match="a batch needs a list of rids"):
        normalize_inputs(None, [[1], [2]], {}, "r", None)
    with pytest.raises(ValueError, match="input_ids must be"):
        normalize_inputs(None, [[1], "x"], {}, None, None)


def test_raise_codecs_widen_each_part_one_step():
    from kvstrata.engine.kvplan import raise_codecs

    assert raise_codecs(["fp4_e2m1", "int4/fp4_e2m1", "fp8_e4m3"], "auto") == [
        "int4/fp8_e4m3", "int8_asym/fp8_e4m3", "int8_asym/int8"
    ]  # fmt: skip
    assert raise_codecs(["fp4_e2m1"] * 2, "int8") == ["int8", "int8"]
    assert raise_codecs(["fp4_e2m1"], "off") is None
    assert raise_codecs(["bf16", "fp32"], "auto") is None  # nothing to widen: no raised pool
