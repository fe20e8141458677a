"""`kvstrata capacity`: tokens that fit at the Llama-3-8B geometry, JSON output, model geometry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli import main
from kvstrata.radix.capacity import GIB, Geometry, model_geometry, plan_capacity

LLAMA3_8B = Geometry(32, 8, 128)


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["capacity", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama3_8b_bf16_count_is_the_budget_after_rings_over_bf16_pages(capsys) -> None:
    out = run_json(capsys, "--kv-cache-dtype", "bf16")
    ring = 32 * (128 + 16) * 2 * 32 * 8 * 128 * 2
    assert out["ring_bytes"] == ring == 603_979_776
    assert out["tokens"] == (40 * GIB - ring) // (2 * 32 * 16 * 8 * 128 * 2) * 16 == 323_072
    assert out["ratio_to_bf16"] == 1.0


# One cold page of the Llama-3-8B geometry (16 tokens, 8 KV heads, head_dim 128), per layer, from
# the byte layouts documented in kvstrata/quant (keys: channel granularity, values: token granularity).
FP4_LAYER = (
    16 * 8 * 128 // 2  # K codes: two E2M1 codes per byte
    + 1 * 8 * 128  # K block scales: one E4M3 byte per 16-token block, head and channel
    + 1 * 8 * 1 * 2  # K global scale: BF16 per page and head
    + 16 * 8 * 128 // 2  # V codes
    + 16 * 8 * (128 // 32)  # V block scales: one E4M3 byte per 32 channels of a token and head
    + 16 * 8 * 1 * 2  # V global scale: BF16 per token and head
)
FP8_LAYER = (
    16 * 8 * 128  # K codes: one byte each
    + 1 * 8 * 1  # K scale exponents: one E8M0 byte per page and head
    + 16 * 8 * 128  # V codes
    + 16 * 8 * 1  # V scale exponents: one byte per token and head
)
RING = 32 * (128 + 16) * 2 * 32 * 8 * 128 * 2  # 32 slots x 144 BF16 tokens x K,V x 32 layers
TOKENS_FP8 = 643_472  # 1.992x the 323,072 of BF16 history


def test_llama3_8b_fp4_fits_at_least_3_6x_bf16(capsys) -> None:
    out = run_json(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--budget-gib", "40")
    assert FP4_LAYER == 18_192
    assert out["codec"] == "fp4_e2m1" and out["cold_page_bytes"] == 32 * FP4_LAYER
    assert out["tokens"] == (40 * 2**30 - RING) // (32 * FP4_LAYER) * 16 == 1_163_840
    assert out["ratio_to_bf16"] >= 3.6 and out["ratio_to_plain_bf16"] >= 3.4


def test_llama3_8b_fp8_fits_at_least_1_97x_bf16(capsys) -> None:
    out = run_json(capsys, "--kv-cache-dtype", "fp8_e4m3")
    assert out["cold_page_bytes"] == 32 * FP8_LAYER == 1_052_928
    assert out["tokens"] == (40 * 2**30 - RING) // (32 * FP8_LAYER) * 16 == TOKENS_FP8
    assert out["ratio_to_bf16"] >= 1.97 and out["ratio_to_plain_bf16"] >= 1.9


def test_text_output_names_every_tier(capsys) -> None:
    assert main(["capacity", "--kv-cache-dtype", "int4"]) == 0
    text = capsys.readouterr().out
    assert "ring overhead   0.562 GiB = 32 slots x 144 tokens x 131072 B/token" in text
    plan = plan_capacity(LLAMA3_8B, "int4", 40 * GIB)
    assert f"bytes/token     cold int4: {plan.cold_bytes_per_token:.1f}   ring bf16: 131072" in text
    assert f"history tokens  {plan.tokens:,} ({plan.pages:,} pages of 16)" in text
    assert "ratio to bf16" in text


def test_model_geometry_from_hf_config_and_gguf(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 28,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "hidden_size": 2048,
            }
        )
    )
    assert model_geometry(tmp_path) == Geometry(28, 4, 128)
    from kvstrata import resources

    assert model_geometry(resources.default_model_path()) == Geometry(30, 3, 64)  # SmolLM2-135M


def test_model_flag_sets_geometry(capsys, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64, "hidden_size": 512})
    )
    out = run_json(capsys, "--model", str(tmp_path), "--budget-gib", "1", "--kv-cache-dtype", "bf16")
    assert (out["layers"], out["kv_heads"], out["head_dim"]) == (2, 4, 64)
    assert out["tokens"] == (GIB - 32 * 144 * 2 * 2 * 4 * 64 * 2) // (2 * 2 * 16 * 4 * 64 * 2) * 16
