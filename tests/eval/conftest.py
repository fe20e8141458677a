"""Shared fixtures: tiny Qwen2-style models (with and without planted outlier key channels)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.eval.corpus import read_corpus
from kvstrata.eval.outliers import build_tiny_outlier_model

SCALE = 30.0


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(planted, plain): same seed and weights except the planted key/query channel scaling."""
    text = read_corpus(None)
    root = tmp_path_factory.mktemp("tiny_models")
    planted = build_tiny_outlier_model(root / "planted", text, scale=SCALE)
    plain = build_tiny_outlier_model(root / "plain", text, scale=1.0)
    return planted, plain


@pytest.fixture(scope="session")
def offset_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-style model with Qwen2.5's real outlier: a key bias of 30 (~40x the keys' spread)
    on the lowest-frequency RoPE channels of layer 0 (rope_theta 1e6, like Qwen2.5)."""
    root = tmp_path_factory.mktemp("offset_model")
    return build_tiny_outlier_model(
        root / "offset", read_corpus(None), scale=1.0, key_offset=30.0, offset_layers=(0,), rope_theta=1e6
    )
