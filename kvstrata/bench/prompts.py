"""Random token-id prompts of exact lengths, drawn from the served model's vocabulary.

Prompts go to ``/v1/completions`` as lists of token ids (kvstrata, SGLang and vLLM all take them), so
the server sees exactly ``input_len`` tokens; no text round trip can merge or split tokens. Special
tokens (BOS, EOS, padding, chat markers) are never drawn. Lengths follow SGLang's random dataset:
uniform in ``[max(1, floor(len * range_ratio)), len]``, so ``--random-range-ratio 1`` makes them exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Vocabulary:
    """The ids a prompt may use, and the tokenizer (None: a model directory with config.json only)."""

    ids: np.ndarray  # int64, sorted
    tokenizer: Any = None
    source: str = ""

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError(f"{self.source} has no tokenizer: text prompts need one")
        return str(self.tokenizer.decode(ids))

    def count_tokens(self, text: str) -> int | None:
        """Tokens of generated text, for servers that report no usage (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    output_len: int


def _ordinary_ids(vocab_size: int, special: set[int]) -> np.ndarray:
    ids = np.arange(vocab_size, dtype=np.int64)
    return ids[~np.isin(ids, np.fromiter(special, dtype=np.int64, count=len(special)))]


def vocabulary_from_tokenizer(tokenizer: Any, source: str) -> Vocabulary:
    """Every id of the base vocabulary that is not a special token."""
    special = {int(i) for i in tokenizer.all_special_ids}
    return Vocabulary(_ordinary_ids(int(tokenizer.vocab_size), special), tokenizer, source)


def vocabulary_from_config(config_file: Path) -> Vocabulary:
    """``vocab_size`` of a config.json, less its bos/eos/pad ids: for random-weight models served
    without tokenizer files (``--load-format dummy``)."""
    cfg = json.loads(config_file.read_text())
    cfg = cfg.get("text_config", cfg)
    special: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = cfg.get(key)
        special.update(value if isinstance(value, list) else [] if value is None else [value])
    return Vocabulary(_ordinary_ids(int(cfg["vocab_size"]), special), None, str(config_file))


def load_vocabulary(tokenizer: str | None, served_model: str) -> Vocabulary:
    """From ``--tokenizer`` (a model directory, a tokenizer directory, a GGUF file), else from the
    served model's id when it is a local path or kvstrata's embedded default model."""
    from kvstrata import resources

    if tokenizer is None:
        if Path(served_model).expanduser().exists():
            tokenizer = served_model
        elif served_model == resources.DEFAULT_MODEL_NAME:
            tokenizer = str(resources.default_model_path())
        else:
            raise ValueError(
                f"cannot find a tokenizer for the served model {served_model!r}: pass --tokenizer "
                "(a model or tokenizer directory, or a GGUF file)"
            )
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise ValueError(f"--tokenizer {tokenizer}: no such file or directory")
    if path.suffix == ".gguf":
        from kvstrata.engine.loader import converted_dir

        path = converted_dir(path)  # the cached Hugging Face directory, tokenizer files included
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        if (path / "config.json").is_file():
            return vocabulary_from_config(path / "config.json")
        raise ValueError(f"--tokenizer {tokenizer}: neither tokenizer files nor a config.json")
    from transformers import AutoTokenizer

    return vocabulary_from_tokenizer(AutoTokenizer.from_pretrained(str(path)), str(path))


def sample_lengths(num: int, length: int, range_ratio: float, rng: np.random.Generator) -> list[int]:
    """``num`` lengths uniform in ``[max(1, floor(length * range_ratio)), length]``."""
    low = max(1, int(length * range_ratio))
    return [int(n) for n in rng.integers(low, length + 1, size=num)]


def random_prompts(
    vocab: Vocabulary,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[Prompt]:
    """Prompts of random ordinary token ids; the same seed gives the same prompts and lengths."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    if vocab.ids.size == 0:
        raise ValueError(f"{vocab.source}: the vocabulary has no ordinary tokens")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(num_prompts, input_len, range_ratio, rng)
    out_lens = sample_lengths(num_prompts, output_len, range_ratio, rng)
    return [
        Prompt(vocab.ids[rng.integers(0, vocab.ids.size, size=n)].tolist(), m)
        for n, m in zip(in_lens, out_lens, strict=True)
    ]
