"""Incremental detokenization that never splits a multi-byte character, and stop-string matching.

Byte-level BPE emits one UTF-8 character over several tokens; decoding a partial one gives U+FFFD.
We decode a short window of ids (a few ids of context plus the new ones) and hold back the text
while it ends in U+FFFD, as vLLM and SGLang do. Context ids keep SentencePiece-style tokenizers
from dropping the leading space of a word that starts the window.

A byte-level BPE tokenizer (GPT-2 style: SmolLM2, Qwen) maps every id to fixed bytes, so its
text is the UTF-8 decoding of the ids' concatenated bytes: `byte_table` builds that map once per
tokenizer (and checks it against the tokenizer's own decode), and the detokenizer then feeds bytes to
an incremental UTF-8 decoder, which holds back a partial character by itself. That is one dict lookup
per token instead of two tokenizer calls; the streaming engine thread detokenizes every token of
every running request between two steps.
"""

from __future__ import annotations

import codecs
import json
import random
import threading
import weakref
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT_IDS = 5
CHECK_IDS = 512  # ids per decode when checking a byte table against the tokenizer
_tables: weakref.WeakKeyDictionary[Any, dict[bool, dict[int, bytes] | None]] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in for each byte (as ``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping: dict[str, int] = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


UNICODE_TO_BYTE = _byte_level_alphabet()


def byte_table(tokenizer: Any, skip_special_tokens: bool = True) -> dict[int, bytes] | None:
    """id -> the exact bytes it adds to decoded text, for a byte-level BPE tokenizer whose ``decode``
    is exactly the UTF-8 decoding (errors replaced) of those bytes; None for any other tokenizer.
    Built once per tokenizer and mode, and checked against ``decode`` on every id before use."""
    if tokenizer is None:
        return None
    inner = getattr(tokenizer, "inner", tokenizer)  # a LockedTokenizer's tokenizer
    with _tables_lock:
        try:
            modes = _tables.setdefault(inner, {})
        except TypeError:  # not weakly referenceable or not hashable: no table, the window path
            return None
        if skip_special_tokens not in modes:
            modes[skip_special_tokens] = _build_table(tokenizer, inner, skip_special_tokens)
        return modes[skip_special_tokens]


def _build_table(tokenizer: Any, inner: Any, skip: bool) -> dict[int, bytes] | None:
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is None or getattr(inner, "clean_up_tokenization_spaces", True):
        return None
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return None
    if decoder.get("type") != "ByteLevel":
        return None
    try:  # a tokenizer without these falls back to the window path rather than failing the engine
        added_tokens = backend.get_added_tokens_decoder()
        added = {int(i): t.content for i, t in added_tokens.items()}
        special = set(inner.all_special_ids) | {int(i) for i, t in added_tokens.items() if t.special}
    except (AttributeError, TypeError, ValueError):
        return None
    table: dict[int, bytes] = {}
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        if i in added:
            table[i] = b"" if skip and i in special else added[i].encode()
        elif all(ch in UNICODE_TO_BYTE for ch in piece):
            table[i] = bytes(UNICODE_TO_BYTE[ch] for ch in piece)
        else:
            table[i] = piece.encode()
    return table if _matches_decode(tokenizer, table, skip) else None


def _matches_decode(tokenizer: Any, table: dict[int, bytes], skip: bool) -> bool:
    """Every id, in shuffled runs of CHECK_IDS (so that bytes of characters split across tokens meet),
    decodes as the table says."""
    ids = sorted(table)
    random.Random(0).shuffle(ids)
    for start in range(0, len(ids), CHECK_IDS):
        run = ids[start : start + CHECK_IDS]
        want = tokenizer.decode(run, skip_special_tokens=skip)
        if b"".join(table[i] for i in run).decode("utf-8", "replace") != want:
            return False
    return True


class IncrementalDetokenizer:
    """``byte_level=False`` always decodes windows of ids (the path of tokenizers without a byte table)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        byte_level: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_IDS:])
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # ids before it have been turned into text
        self.text = ""
        self._bytes = byte_table(tokenizer, skip_special_tokens) if byte_level else None
        if self._bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._utf8.decode(self._bytes_of(self.ids))  # a character the prompt left partial

    def _bytes_of(self, ids: Sequence[int]) -> bytes:
        table = self._bytes
        assert table is not None
        return b"".join(table.get(i, b"") for i in ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:  # a model without tokenizer files: ids in, ids out, no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (possibly empty while a character is partial)."""
        if self._bytes is not None:
            return self._emit(self._utf8.decode(self._bytes_of(token_ids)))
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is held back, even an incomplete character."""
        if self._bytes is not None:
            return self._emit(self._utf8.decode(b"", final=True))
        return self._advance(final=True)

    def _emit(self, delta: str) -> str:
        self.text += delta
        return delta

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""
        if not full.startswith(prefix):  # a merge changed earlier text: emit only what is new
            common = 0
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            delta = full[max(common, len(prefix)) :]
        else:
            delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """Earliest stop string that ends at or after ``start`` (so new text is searched once)."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(0, start - len(s) + 1))
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string.

    A stream must not show those characters yet: the next token may complete the stop string.
    """
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
