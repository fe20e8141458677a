"""Incremental detokenization that never splits a multi-byte character, and stop-string matching.

Byte-level BPE emits one UTF-8 character over several tokens; decoding a partial one gives U+FFFD.
We decode a short window of ids (a few ids of context plus the new ones) and hold back the text
while it ends in U+FFFD, as vLLM and SGLang do. Context ids keep SentencePiece-style tokenizers
from dropping the leading space of a word that starts the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT_IDS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_IDS:])
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # ids before it have been turned into text
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:  # a model without tokenizer files: ids in, ids out, no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (possibly empty while a character is partial)."""
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is held back, even an incomplete character."""
        return self._advance(final=True)

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
