"""Corpus windowing and its clear errors (empty, unreadable, too short, not UTF-8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.eval.corpus import CorpusError, cut_windows, read_corpus, tokenize_windows


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 251 for c in text]


def test_cut_windows_is_consecutive_and_capped() -> None:
    ids = list(range(100))
    w = cut_windows(ids, 16, 64)
    assert len(w) == 4 and w[0] == list(range(16)) and w[3] == list(range(48, 64))
    assert len(cut_windows(ids, 16, 10_000)) == 6  # the text runs out first
    with pytest.raises(ValueError, match="at least --context"):
        cut_windows(ids, 16, 8)


def test_tokenize_windows_reads_only_what_it_needs() -> None:
    text = "abcdefghij" * 10_000
    w = tokenize_windows(text, CharTokenizer(), 128, 1024)
    assert len(w) == 8 and all(len(x) == 128 for x in w)
    assert w[1][0] == CharTokenizer().encode("abcdefghij" * 13)[128]


def test_errors_are_clear(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(CorpusError, match="empty"):
        read_corpus(empty)
    with pytest.raises(CorpusError, match="does not exist"):
        read_corpus(tmp_path / "missing.txt")
    with pytest.raises(CorpusError, match="directory"):
        read_corpus(tmp_path)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage\xc3")
    with pytest.raises(CorpusError, match="not UTF-8"):
        read_corpus(binary)
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    with pytest.raises(CorpusError, match=r"too short: it has 16 tokens, one window needs --context 64"):
        tokenize_windows(read_corpus(short), CharTokenizer(), 64, 1024, source=str(short))


def test_any_utf8_file_works(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("héllo wörld ✓ " * 50, encoding="utf-8")
    w = tokenize_windows(read_corpus(f), CharTokenizer(), 32, 128)
    assert len(w) == 4
