"""Incremental detokenization never splits a character; stop strings are found once and held back.
Both paths: the byte table (byte-level BPE) and windows of ids decoded by the tokenizer."""

import random

import pytest

from kvstrata.engine.detokenizer import IncrementalDetokenizer, byte_table, find_stop, stop_holdback


@pytest.fixture(scope="module")
def tokenizer():
    from kvstrata.engine.loader import converted_dir, load_tokenizer
    from kvstrata.resources import default_model_path

    return load_tokenizer(converted_dir(default_model_path()))


TEXTS = [
    "Hello, world! Ünïcödé façade",
    "emoji 😀👍🏽 and family 👨‍👩‍👧 done",
    "中文字符测试，日本語のテキスト、한국어",
    "mixed: naïve café — 東京 🚀 end",
]


@pytest.mark.parametrize("byte_level", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_never_emits_replacement(tokenizer, text, byte_level):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, byte_level=byte_level)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert detok.text == text
    # multi-byte characters spanning tokens produced empty deltas while incomplete
    if any(ord(c) > 0xFFFF for c in text):
        assert "" in deltas[:-1]


@pytest.mark.parametrize("byte_level", [True, False])
def test_prompt_context_keeps_leading_space(tokenizer, byte_level):
    prompt = tokenizer.encode("The capital")
    out = tokenizer.encode(" of France is Paris")
    detok = IncrementalDetokenizer(tokenizer, prompt, byte_level=byte_level)
    text = "".join(detok.add([t]) for t in out) + detok.flush()
    assert text == " of France is Paris"


@pytest.mark.parametrize("byte_level", [True, False])
def test_flush_emits_incomplete_tail(tokenizer, byte_level):
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer, byte_level=byte_level)
    text = "".join(detok.add([t]) for t in ids[:-1])
    assert "\ufffd" not in text
    assert detok.flush().endswith("\ufffd")


def test_find_stop_earliest_and_only_new_text():
    assert find_stop("abc STOP def END", ["END", "STOP"], 0) == (4, "STOP")
    assert find_stop("abc STOP def", ["STOP"], 9) is None  # ended before the new text
    assert find_stop("abc STO", ["STOP"], 5) is None
    assert find_stop("abc STOP", ["STOP"], 7) == (4, "STOP")  # completed by the new text


def test_stop_holdback():
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("hello", ["world"]) == 0
    assert stop_holdback("abc\n", ["\n\n", "xyz"]) == 1
    assert stop_holdback("a", ["abc", "a"]) == 1


def test_request_text_on_length_cut_and_stop_string(tokenizer):
    from kvstrata.engine.request import Request
    from kvstrata.engine.sampling_params import SamplingParams

    ids = tokenizer.encode("ok 😀")
    req = Request("r", [1], SamplingParams(max_new_tokens=len(ids) - 1), tokenizer, frozenset(), 49152)
    for t in ids[:-1]:
        req.append(t, 0.0)
    assert req.finish_reason == {"type": "length", "length": len(ids) - 1}
    assert req.visible_text() == "ok "  # the emoji's bytes are still incomplete: held back
    req.finish(req.finish_reason, 1.0)
    assert req.visible_text().startswith("ok ") and req.visible_text().count("\ufffd") == 1  # flushed once

    ids = tokenizer.encode("Hello world. The end")
    req = Request("s", [1], SamplingParams(max_new_tokens=50, stop=["world"]), tokenizer, frozenset(), 49152)
    shown = []
    for t in ids:
        req.append(t, 0.0)
        shown.append(req.visible_text())
        if req.finish_reason:
            break
    assert "wor" not in "".join(shown[:-1])  # a possible stop string is held back
    req.finish(req.finish_reason, 1.0)
    assert req.finish_reason == {"type": "stop", "matched": "world"}
    assert req.visible_text() == "Hello "


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_table_streams_what_decode_gives(tokenizer, skip_special_tokens):
    """Random ids (special ones, and bytes of characters split across tokens, included), fed in
    random runs: the streamed text is the tokenizer's decode of all of them, and a partial character
    never comes out before it is complete or flushed."""
    assert byte_table(tokenizer, skip_special_tokens) is not None  # SmolLM2: byte-level BPE
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        ids += [rng.randrange(17)] * rng.randrange(2)  # a special or added token now and then
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        pieces, i = [], 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            pieces.append(detok.add(ids[i : i + n]))
            i += n
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.text == "".join(pieces)


def test_byte_table_only_for_byte_level_decoders():
    class WordPiece:  # decode() is not the UTF-8 of per-id bytes
        backend_tokenizer = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    assert byte_table(WordPiece()) is None
    assert byte_table(None) is None
    detok = IncrementalDetokenizer(WordPiece())
    assert detok.add([5]) == "5" and detok.add([6]) == " 6"


def test_byte_table_falls_back_when_the_tokenizer_lacks_the_added_tokens_api():
    """A byte-level backend without ``get_added_tokens_decoder`` (or ``all_special_ids``) gets no table
    (the window path) instead of failing the engine's construction."""
    import json

    class Backend:
        def to_str(self):
            return json.dumps({"decoder": {"type": "ByteLevel"}})

    class Partial:
        backend_tokenizer = Backend()
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=True):
            return ""

    assert byte_table(Partial()) is None
