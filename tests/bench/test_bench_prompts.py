"""Random token-id prompts: exact or bounded lengths, seeded, never a special token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstrata.bench.prompts import (
    load_vocabulary,
    random_prompts,
    vocabulary_from_config,
)


def _config_dir(tmp_path: Path) -> Path:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 50, "bos_token_id": 1, "eos_token_id": [2, 7]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_config_only_directory_gives_ids_below_vocab_size_without_special_ones(tmp_path: Path) -> None:
    vocab = load_vocabulary(str(_config_dir(tmp_path)), "served-name")
    assert vocab.tokenizer is None
    assert vocab.ids.tolist() == [i for i in range(50) if i not in (1, 2, 7)]
    prompts = random_prompts(vocab, 40, 30, 5, 1.0, seed=0)
    drawn = {t for p in prompts for t in p.ids}
    assert drawn <= set(vocab.ids.tolist()) and len(drawn) > 40
    assert vocab.count_tokens("anything") is None
    with pytest.raises(ValueError, match="no tokenizer"):
        vocab.decode([3])


def test_lengths_are_exact_with_ratio_one_and_bounded_otherwise(tmp_path: Path) -> None:
    vocab = vocabulary_from_config(_config_dir(tmp_path) / "config.json")
    exact = random_prompts(vocab, 25, 17, 9, 1.0, seed=5)
    assert [len(p.ids) for p in exact] == [17] * 25 and [p.output_len for p in exact] == [9] * 25
    ranged = random_prompts(vocab, 400, 40, 20, 0.5, seed=5)
    in_lens = np.array([len(p.ids) for p in ranged])
    out_lens = np.array([p.output_len for p in ranged])
    assert in_lens.min() == 20 and in_lens.max() == 40  # uniform over [20, 40]: both ends drawn
    assert out_lens.min() == 10 and out_lens.max() == 20
    zero = random_prompts(vocab, 400, 8, 8, 0.0, seed=5)
    assert min(len(p.ids) for p in zero) == 1 and min(p.output_len for p in zero) == 1


def test_same_seed_same_prompts(tmp_path: Path) -> None:
    vocab = vocabulary_from_config(_config_dir(tmp_path) / "config.json")
    a = random_prompts(vocab, 10, 12, 4, 0.3, seed=11)
    assert a == random_prompts(vocab, 10, 12, 4, 0.3, seed=11)
    assert a != random_prompts(vocab, 10, 12, 4, 0.3, seed=12)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    vocab = vocabulary_from_config(_config_dir(tmp_path) / "config.json")
    with pytest.raises(ValueError, match="range-ratio"):
        random_prompts(vocab, 1, 4, 4, 1.5, seed=0)
    with pytest.raises(ValueError, match="must be >= 1"):
        random_prompts(vocab, 1, 0, 4, 1.0, seed=0)
    with pytest.raises(ValueError, match="pass --tokenizer"):
        load_vocabulary(None, "some-remote/model")
    with pytest.raises(ValueError, match="no such file"):
        load_vocabulary(str(tmp_path / "missing"), "x")


def test_default_model_tokenizer_skips_special_tokens() -> None:
    vocab = load_vocabulary(None, "SmolLM2-135M-Instruct")  # kvstrata's embedded model, by its id
    special = set(vocab.tokenizer.all_special_ids)
    assert special and not special & set(vocab.ids.tolist())
    assert vocab.ids.size == vocab.tokenizer.vocab_size - len(special)
    assert vocab.count_tokens(vocab.decode([504, 3458, 282])) == 3
