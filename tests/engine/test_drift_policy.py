"""Drift monitor: exact scores on known distributions, EWMA, fallback levels with hysteresis."""

import math

import pytest
import torch

from kvstrata.engine.drift import DriftJob, DriftMonitor, FallbackPolicy, score


def test_score_exact_on_known_logits():
    vocab = 4
    ref_logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)  # positions 1..3 predict tokens 2..4
    served = torch.log_softmax(torch.tensor([[0.0, 0.0, 0.0, 0.0]] * 2), dim=-1)

    def dense_forward(ids, logits_from=0):
        assert ids.tolist() == [[1, 2, 3]]  # prompt (2) + first generated token
        assert logits_from == 1  # only the positions that predict generated tokens
        return ref_logits[logits_from:].unsqueeze(0)

    job = DriftJob("r", [1, 2, 3, 0], prompt_len=2, served=served)
    ratio, kl = score(dense_forward, job)
    ref = torch.log_softmax(ref_logits[0], dim=-1)
    nll_ref = -(ref[3] + ref[0]) / 2
    nll_served = math.log(vocab)
    assert ratio == pytest.approx(math.exp(nll_served - nll_ref), rel=1e-6)
    expected_kl = float((ref.exp() * (ref - math.log(1 / vocab))).sum())
    assert kl == pytest.approx(expected_kl, rel=1e-6)


def test_identical_distributions_give_ratio_one_kl_zero():
    logits = torch.randn(1, 6, 10)
    served = torch.log_softmax(logits[0, 2:5], dim=-1)
    job = DriftJob("r", [1, 2, 3, 4, 5, 6], 3, served)
    ratio, kl = score(lambda ids, logits_from=0: logits[:, logits_from : ids.shape[1]], job)
    assert ratio == pytest.approx(1.0, abs=1e-6)
    assert kl == pytest.approx(0.0, abs=1e-6)


def test_policy_up_hold_and_hysteresis():
    p = FallbackPolicy(threshold=0.1, max_level=2, alpha=0.5, cooldown=3)
    assert p.update(0.0) == 0 and p.ewma == 0.0
    assert p.update(0.4) == 1 and p.ewma == pytest.approx(0.2)  # over threshold: up
    assert p.update(0.4) == 0  # first sample at a new level may predate it: hold
    assert p.update(0.4) == 1 and p.level == 2
    assert p.update(0.4) == 0 and p.update(0.4) == 0 and p.level == 2  # capped at max_level
    # ewma 0.39 -> 0.19, 0.097, 0.048 (< threshold / 2: streak 1), ... third low sample steps down
    assert [p.update(0.0) for _ in range(8)] == [0, 0, 0, 0, -1, 0, 0, -1]
    assert p.level == 0 and p.update(0.0) == 0
    assert p.changes == 4


def certain_reference(ids, logits_from=0):  # the reference says token 0 is certain
    logits = torch.full((1, ids.shape[1] - logits_from, 4), -20.0)
    logits[..., 0] = 20.0
    return logits


def feed_uniform_served(mon: DriftMonitor, n: int):
    """``n`` jobs whose served distribution was uniform, each scored before the next; the final stats."""
    served = torch.log_softmax(torch.zeros(3, 4), dim=-1)
    for i in range(n):
        assert mon.submit(DriftJob(f"r{i}", [1, 2, 0, 0, 0], 2, served))
        assert mon.wait_idle(10)
    stats = mon.stats()
    mon.close()
    return stats


def test_monitor_worker_changes_level_and_reports():
    levels = []
    samples = []

    mon = DriftMonitor(
        certain_reference, 1.0, threshold=0.05, base_window=32, max_level=2, alpha=1.0, cooldown=2,
        on_level=lambda lvl, w: levels.append((lvl, w)), on_sample=samples.append,
    )  # fmt: skip
    stats = feed_uniform_served(mon, 3)
    assert levels == [(1, 64), (2, 128)]
    assert stats.level == 2 and stats.window == 128 and stats.samples == 3
    assert stats.ppl_ratios[0] == pytest.approx(4.0, rel=1e-3)  # uniform over 4 vs certain
    assert [s.level for s in samples] == [1, 1, 2]


def test_rescoring_a_long_prompt_computes_logits_of_the_scored_steps_only(default_model):
    """A 16K-token prompt would need 16K x vocab float32 logits (3 GB for a 49K vocabulary); the
    re-score computes the n rows it compares and gets the same numbers as the full computation."""
    net = default_model.net
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, default_model.config.vocab_size, (300,), generator=g).tolist()
    prompt_len, n = 290, 10
    full = net.dense_forward(torch.tensor([ids[: prompt_len + n - 1]]))[0]
    served = torch.log_softmax(full[prompt_len - 1 :] + 0.3 * torch.randn(n, full.shape[-1], generator=g), -1)
    rows: list[int] = []

    def recording(x, logits_from=0):
        out = net.dense_forward(x, logits_from=logits_from)
        rows.append(out.shape[1])
        return out

    job = DriftJob("r", ids, prompt_len, served)
    ratio, kl = score(recording, job)
    assert rows == [n]
    ref_ratio, ref_kl = score(lambda x, logits_from=0: full[None, logits_from:], job)
    assert ratio == pytest.approx(ref_ratio, rel=1e-4) and kl == pytest.approx(ref_kl, rel=1e-3, abs=1e-6)


def test_with_a_raised_pool_level_one_raises_precision_and_the_window_steps_come_after():
    levels = []
    mon = DriftMonitor(
        certain_reference, 1.0, threshold=0.05, base_window=32, max_level=2, alpha=1.0, cooldown=2,
        on_level=lambda lvl, w: levels.append((lvl, w)), raised_codecs=["int4/fp8_e4m3"] * 3 + ["int8"],
    )  # fmt: skip
    assert [(mon.window(lvl), mon.raised(lvl)) for lvl in range(4)] == [
        (32, False), (32, True), (64, True), (128, True)
    ]  # fmt: skip
    assert (
        mon.describe(1)
        == "recent window 32, new pages in raised codecs int4/fp8_e4m3 (layers 0-2), int8 (layer 3)"
    )
    assert mon.describe(0) == "recent window 32, new pages in shipped codecs"
    stats = feed_uniform_served(mon, 5)
    assert levels == [(1, 32), (2, 64), (3, 128)]  # max_level counts the window steps after the raise
    assert stats.level == 3 and stats.raised and stats.window == 128


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_dense_forward_logits_from_equals_the_tail_of_the_full_logits(device):
    """The drift monitor's reference pass keeps only the tail's logits; on every device (on CUDA the
    row index was once built on the CPU and failed) they equal the full computation's tail."""
    from kvstrata.engine.config import ModelConfig
    from kvstrata.engine.loader import dummy_model

    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 97,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    )
    net = dummy_model(cfg, torch.float32, torch.device(device), seed=0)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
    full = net.dense_forward(ids)
    tail = net.dense_forward(ids, logits_from=13)
    assert tail.shape == (2, 7, 97) and tail.device.type == device
    torch.testing.assert_close(tail, full[:, 13:], rtol=1e-5, atol=1e-5)
