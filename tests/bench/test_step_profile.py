"""`benchmarks/decode_step_gpu.py`'s profile arithmetic: which kernel records count in the per-kind
breakdown, and the "no kernel running" row when kernels overlap (a dependent launch, two streams)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest


@pytest.fixture
def step(monkeypatch):
    """The benchmark module, imported with ``benchmarks/`` on the path (as test_attention_sweep does)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    return importlib.import_module("decode_step_gpu")


def test_an_enclosing_record_is_left_out_and_overlapping_kernels_are_kept(step) -> None:
    records = [
        (0.0, 100.0, "graph"),  # encloses the two kernels it ran
        (0.0, 50.0, "nvjet_gemm"),
        (40.0, 100.0, "_decode_kernel"),  # starts before the GEMM ends (PDL): kept
        (120.0, 130.0, "rms_norm_kernel"),
        (125.0, 140.0, "copy_kernel"),  # another stream: kept
    ]
    leaves = step.leaf_records(records)
    assert [n for _, _, n in leaves] == ["nvjet_gemm", "_decode_kernel", "rms_norm_kernel", "copy_kernel"]
    assert step.busy_us(records) == 140.0 - 20.0
    assert step.busy_us(leaves) == 120.0


def test_two_overlapping_records_around_one_kernel_are_both_left_out(step) -> None:
    records = [(0.0, 10.0, "outer"), (5.0, 20.0, "overlaps outer"), (6.0, 9.0, "kernel")]
    assert [n for _, _, n in step.leaf_records(records)] == ["kernel"]


def test_the_table_counts_overlapped_kernel_time_once_in_the_gap(step) -> None:
    records = [(0.0, 50.0, "nvjet_gemm"), (40.0, 100.0, "_decode_kernel")]
    leaves = step.leaf_records(records)
    profile = {
        "wall_ms_per_step": 0.12,
        "leaf_busy_ms_per_step": step.busy_us(leaves) / 1e3,
        "kernels_per_step": 2,
        "kernel_ms_per_step_by_kind": {"matmul (cuBLAS/CUTLASS)": 0.05, "attention (Triton)": 0.06},
        "top_kernels_ms_per_step": {},
    }
    run = {"profile": profile, "weight_bytes": 2e6, "dense": "fused", "kv": "auto", "plan": "table",
           "loop": "overlap", "graph": "full"}  # fmt: skip
    table = step.profile_table(run, batch=1)
    assert "| all kernels | 0.11 |" in table
    assert "| of which overlapped by other kernels | 0.01 |" in table
    assert "| no kernel running (launch/host gaps) | 0.02 |" in table


def test_split_k_option_sets_the_output_and_down_products(step) -> None:
    from kvstrata.engine.config import ModelConfig
    from kvstrata.engine.model import Transformer

    net = Transformer(ModelConfig.from_hf(step.GEOMETRIES["tiny"]))
    step.set_split_k(net, "down=2")
    assert {(layer.attn.wo.split_k, layer.mlp.w2.split_k) for layer in net.layers} == {(1, 2)}
    step.set_split_k(net, "o=4,down=1")
    assert {(layer.attn.wo.split_k, layer.mlp.w2.split_k) for layer in net.layers} == {(4, 1)}
    assert {layer.attn.wqkv.split_k for layer in net.layers} == {1}
    for bad in ("up=2", "down=0", "o=", "down=two"):
        with pytest.raises(ValueError, match="--split-k takes"):
            step.set_split_k(net, bad)
    odd = net.layers[0].mlp.w2.in_features + 1  # more chunks than features: no even split
    with pytest.raises(ValueError, match="do not split"):
        step.set_split_k(net, f"down={odd}")
