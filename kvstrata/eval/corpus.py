"""The evaluation corpus cut into consecutive, non-overlapping context windows of token ids.

Any UTF-8 text file works; the default is the Wikipedia summaries (``kvstrata.resources``). Only as much
text is tokenized as the token budget needs (doubling until it is enough or the text runs out), so a
short run on a large corpus starts at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kvstrata.resources import load_corpus_text


class CorpusError(ValueError):
    """The corpus cannot give even one window; the message says why and what to do."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def read_corpus(path: str | Path | None) -> str:
    """Text of ``path`` (None: the default corpus), with a clear error for missing/empty/binary files."""
    if path is not None:
        file = Path(path)
        if not file.exists():
            raise CorpusError(f"corpus file {file} does not exist")
        if file.is_dir():
            raise CorpusError(f"corpus {file} is a directory, not a text file")
    try:
        return load_corpus_text(path)
    except ValueError as exc:
        raise CorpusError(str(exc)) from exc


def cut_windows(token_ids: list[int], context: int, max_tokens: int) -> list[list[int]]:
    """Consecutive windows of ``context`` tokens, at most ``max_tokens // context`` of them."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    if max_tokens < context:
        raise ValueError(f"--tokens ({max_tokens}) must be at least --context ({context})")
    n = min(len(token_ids) // context, max_tokens // context)
    return [token_ids[i * context : (i + 1) * context] for i in range(n)]


def tokenize_windows(
    text: str, tokenizer: Tokenizer, context: int, max_tokens: int, source: str = "corpus"
) -> list[list[int]]:
    """Tokenize (a prefix of) ``text`` and cut it into windows; CorpusError if not even one fits."""
    if not text.strip():
        raise CorpusError(f"{source} is empty")
    wanted = (max_tokens // context) * context
    chars = max(4096, wanted * 6)
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) >= wanted or chars >= len(text):
            break
        chars *= 2
    windows = cut_windows(ids, context, max_tokens)
    if not windows:
        raise CorpusError(
            f"{source} is too short: it has {len(ids)} tokens, one window needs --context {context}; "
            "use a longer text or a smaller --context"
        )
    return windows
