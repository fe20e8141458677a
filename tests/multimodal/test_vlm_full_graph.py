"""A vision-language model with quantized text pages keeps its image pages in a pool of their own; the
whole-step decode graph is still used: text-only decode steps replay the whole step, steps over image
pages replay the piecewise pieces around eager attention. Greedy tokens equal the eager engine's, for
text-only requests, a request with an image, and the two in one batch. The graphs' steps run eagerly on
their static buffers (`FullDecodeGraphs.use_pieces`), the Triton kernels interpreted on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graph_steps import take_steps  # noqa: E402

from kvstrata import Engine  # noqa: E402
from kvstrata.engine.full_graph import FullDecodeGraphs  # noqa: E402
from kvstrata.engine.loader import load_model  # noqa: E402

from .test_vlm_logits import prompt  # noqa: E402
from .tiny_vlm import hf_vlm, make_image, save_vlm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW = 6
PAGE = 16


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vlm(hf_vlm("llava", "siglip", seed=3), Path(tmp_path_factory.mktemp("llava-full")))


def rounds(path: Path, full: bool) -> tuple[list[list[list[int]]], list[tuple[int, int, int]]]:
    """Greedy outputs of three rounds (text only; one image; text and image together) and, with the
    whole-step graphs, their `take_steps` per round."""
    engine = Engine(
        load_model(path, dtype=torch.float32, device=DEVICE),
        attention_backend="triton",
        kv_cache_dtype="fp8_e4m3",
        vision_kv_dtype="bf16",
        kv_plan="off",
        sinks=False,
        page_size=PAGE,
        recent_window=PAGE,
        max_total_tokens=2048,
        max_running_requests=4,
        disable_cuda_graph=True,
    )
    params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    text = [prompt(40, [], seed=31), prompt(23, [], seed=32)]
    with_image = prompt(12, [2], seed=33)
    graphs = None
    try:
        assert engine.cache.image_pool is not None
        if full:
            graphs = FullDecodeGraphs(engine.runner.net, 4, engine.cache, engine.runner.backend, 256)
            assert graphs.with_pieces
            graphs.use_pieces()
            engine.runner.graphs = graphs
        outs, counts = [], []
        for ids, images in (
            (text, None),
            ([with_image], [[make_image(41)]]),
            ([prompt(30, [], seed=34), with_image], [[], [make_image(41)]]),
        ):
            got = engine.generate(input_ids=ids, image_data=images, sampling_params=params)
            outs.append([o["output_ids"] for o in got])
            if graphs is not None:
                counts.append(take_steps(graphs, engine))
        stats = engine.check_invariants()
        assert stats.running == 0 and stats.tiers["image"].cached > 0
        return outs, counts
    finally:
        engine.shutdown()


def test_whole_step_graph_beside_an_image_pool(llava: Path):
    eager, _ = rounds(llava, full=False)
    full, counts = rounds(llava, full=True)
    assert full == eager
    # (whole, piecewise) steps; NEW - 1 decode steps a round (the first token is the prefill's), and on
    # CUDA the step overlap scheduling runs past the end of a round whose ids stayed on the device (text
    # only: a request with an image reads its ids back every step)
    steps = [NEW - 1 + past_end for _, _, past_end in counts]
    assert counts[0][:2] == (steps[0], 0)  # text only: every decode step whole
    # the image alone: whole while its tokens sit in the BF16 ring, then the pieces once its page has
    # left the window for the image pool (written, then read cold)
    whole, pieces, _ = counts[1]
    assert whole + pieces == steps[1] and whole > 0 and pieces > 0
    # text and image together, the image's pages from the tree (in the image pool from the first step):
    # one sequence with image pages puts the batch on the pieces
    assert counts[2][:2] == (0, steps[2])
