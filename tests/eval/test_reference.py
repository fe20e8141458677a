"""The lab's unquantized path against Hugging Face transformers and against dense_forward.

Short slice of the default model (2 windows of 128 tokens of the Wikipedia summaries). The HF model is
transformers' own LlamaForCausalLM on the engine's GGUF->safetensors conversion of the same file.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvstrata.eval.configs import EvalConfig
from kvstrata.eval.corpus import read_corpus, tokenize_windows
from kvstrata.eval.runner import evaluate
from kvstrata.eval.stats import merge

CONTEXT, TOKENS = 128, 256


@pytest.fixture(scope="module")
def default_model():
    from kvstrata.resources import ResourceNotInstalled

    try:
        from kvstrata.engine.loader import load_model

        return load_model(None, dtype=torch.float32)
    except ResourceNotInstalled as exc:  # pragma: no cover - the Makefile installs it
        pytest.skip(str(exc))


@torch.inference_mode()
def test_unquantized_perplexity_matches_transformers(default_model) -> None:
    from transformers import AutoModelForCausalLM

    from kvstrata.eval.outliers import hf_directory

    windows = tokenize_windows(read_corpus(None), default_model.tokenizer, CONTEXT, TOKENS)
    assert len(windows) == 2
    scores, check = evaluate(default_model, windows, [EvalConfig("auto", None, 0, False, False)], 16)
    ours = merge(scores[EvalConfig("auto", None, 0, False, False)])
    lab_ppl = math.exp(ours.ref_nll / ours.count)

    hf = AutoModelForCausalLM.from_pretrained(hf_directory(None), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for w in windows:
        ids = torch.tensor([w])
        logits = hf(ids).logits[0, :-1].double()
        nll -= torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).sum().item()
        count += len(w) - 1
    hf_ppl = math.exp(nll / count)
    assert ours.count == count == 2 * (CONTEXT - 1)
    assert 5.0 < hf_ppl < 50.0
    assert abs(lab_ppl / hf_ppl - 1) < 1e-3  # the acceptance bound: 0.1%
    assert abs(lab_ppl / hf_ppl - 1) < 1e-5  # what float32 actually gives
    # the cache path (cold fp32 pages + ring, 16-token chunks) against the model's dense_forward
    assert check is not None
    assert check.max_abs_logit_diff < 1e-3 * check.max_abs_logit
    assert check.nll_rel_diff < 1e-5
