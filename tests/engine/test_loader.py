"""Loader: GGUF conversion and its cache, safetensors directories, configs, tokenizer and chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tiny_models
import torch

from kvstrata.engine import loader
from kvstrata.engine.config import ModelConfig
from kvstrata.engine.loader import load_model
from kvstrata.engine.weights_gguf import unpermute

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing\n\n",
    "naïve café, 東京, emoji 🙂 and a ZWJ family 👨‍👩‍👧",
    "x = [1, 22, 333]; print(f'{x!r}')\t# 2024-11-29",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Ça va ?"},
    ],
]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_llama():
    import transformers

    cfg = transformers.LlamaConfig(**tiny_models.TINY, tie_word_embeddings=False, rope_theta=10000.0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    tiny_models.randomize_(model, seed=3)
    return model


# ------------------------------------------------------------------------------------------- GGUF
def test_gguf_q8_0_with_permuted_qk_matches_transformers(tmp_path, cache_dir, tiny_llama):
    stored = tiny_models.write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf", ("attn_q", "attn_k", "ffn_up"))
    tiny_llama.load_state_dict(stored)  # the reference sees the Q8_0-rounded weights the file holds
    model = load_model(tmp_path / "tiny.gguf")
    ids = torch.randint(0, 300, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tiny_llama(ids).logits[0]
    ours = model.net.dense_forward(ids)[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5
    cfg = model.config
    assert (cfg.architecture, cfg.q_heads, cfg.kv_heads, cfg.head_dim) == ("LlamaForCausalLM", 4, 2, 16)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.tie_word_embeddings) == (258, (259,), False)
    assert model.name == "tiny" and model.path == tmp_path / "tiny.gguf"


def test_gguf_tokenizer_and_chat_template(tmp_path, cache_dir, tiny_llama):
    tiny_models.write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf")
    tok = load_model(tmp_path / "tiny.gguf").tokenizer
    ids = tok.encode("the tiny the")
    assert tok.convert_ids_to_tokens(ids) == ["t", "he", "Ġt", "i", "n", "y", "Ġt", "he"]
    assert tok.decode(ids) == "the tiny the"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_end|>") == [259]


def test_gguf_cache_is_reused_and_keyed_on_mtime(tmp_path, cache_dir, tiny_llama, monkeypatch):
    gguf_file = tmp_path / "tiny.gguf"
    tiny_models.write_llama_gguf(tiny_llama, gguf_file)
    first = load_model(gguf_file)
    (entry,) = (cache_dir / "models").iterdir()
    assert entry.name.startswith("tiny-")
    names = {p.name for p in entry.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", loader.SOURCE_FILE} <= names
    source = json.loads((entry / loader.SOURCE_FILE).read_text())
    assert source["path"] == str(gguf_file.resolve()) and source["size"] == gguf_file.stat().st_size

    import kvstrata.engine.weights_gguf as weights_gguf

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache is valid")

    monkeypatch.setattr(weights_gguf, "convert_gguf", no_conversion)
    second = load_model(gguf_file)
    ids = torch.arange(30)[None]
    assert torch.equal(first.net.dense_forward(ids), second.net.dense_forward(ids))
    # a changed file (new mtime) gets a new entry
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="converted again"):
        load_model(gguf_file)
    monkeypatch.undo()
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(cache_dir))
    load_model(gguf_file)
    assert len(list((cache_dir / "models").iterdir())) == 2
    assert not [p for p in (cache_dir / "models").iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_directory_holding_one_gguf(tmp_path, cache_dir, tiny_llama):
    tiny_models.write_llama_gguf(tiny_llama, tmp_path / "only.gguf")
    assert load_model(tmp_path).path == tmp_path / "only.gguf"


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(4 * 16, 8).numpy()
    assert (unpermute(tiny_models.permute(w, 4), 4) == w).all()
    assert not (tiny_models.permute(w, 4) == w).all()


# ------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_config_round_trip_through_transformers(kind):
    import transformers

    hf_cfg = tiny_models.hf_model(kind).config
    ours = ModelConfig.from_hf(hf_cfg.to_dict())
    again = ModelConfig.from_hf(ours.to_hf())
    assert again == ours
    # transformers reads our config.json back to the same model geometry
    reread = transformers.AutoConfig.for_model(**ours.to_hf())
    assert ModelConfig.from_hf(reread.to_dict()) == ours


def test_config_from_transformers_4_layout():
    d = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [7, 9],
    }
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (cfg.head_dim, cfg.group_size, cfg.eos_token_ids) == (32, 4, (7, 9))
    assert cfg.attn_scale == pytest.approx(32**-0.5)


def test_generation_config_eos_ids_are_added(tmp_path):
    model = tiny_models.hf_model("qwen2")
    path = tiny_models.save_hf(model, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert load_model(path).config.eos_token_ids == (2, 5)


# ------------------------------------------------------------------------------------------- errors
def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json and 0 .gguf files"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="unsupported model.*GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_model(tmp_path, dtype="int8")


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    model = tiny_models.hf_model("qwen3")
    path = tiny_models.save_hf(model, tmp_path / "m")
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor 'layers.1.self_attn.k_norm.weight'"):
        load_model(path)
    state["model.layers.1.self_attn.k_norm.weight"] = torch.ones(32)
    state["model.extra.weight"] = torch.ones(3)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 unexpected tensors, e.g. \['extra.weight'\]"):
        load_model(path)


# ------------------------------------------------------------------------------------------- default model
@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' own tokenizer of the default GGUF (AutoTokenizer with gguf_file, offline)."""
    from transformers import AutoTokenizer

    from kvstrata.resources import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_default_tokenizer_matches_transformers(default_model, hf_tokenizer):
    from transformers import PreTrainedTokenizerFast

    from kvstrata.engine.tokenizer import LockedTokenizer

    tok = default_model.tokenizer
    assert isinstance(tok, LockedTokenizer)  # shared by threads: every call under one lock
    assert isinstance(tok.inner, PreTrainedTokenizerFast)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # digits are single tokens in SmolLM2
    assert tok.encode("<|im_start|>") == [1]


def test_default_chat_template_matches_transformers(default_model, hf_tokenizer):
    tok = default_model.tokenizer
    for chat in CHATS:
        for gen in (False, True):
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert text == hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert ids == tok.encode(text)
    text = tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
