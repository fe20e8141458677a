"""The Triton attention backend over image pages in a pool of their own (``--vision-kv-dtype``) equals the
torch backend: every logit row within 1e-4 (float32) and the same tokens, for tiny random LLaVA (16-token
pages: the kernels' 16-token block tiles) and Idefics3 (4-token pages: per-element tiles), with BF16, FP8
and INT4 image pages next to another text codec.

Each engine serves the same requests: a batch with two images in one prompt and one in the other, prefilled
in chunks (later chunks read the earlier chunks' image pages cold: extend over a cached image span) and
decoded for three tokens (decode over cold image pages); then a request whose image prefix comes from the
tree. Under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvstrata import Engine  # noqa: E402
from kvstrata.engine.loader import load_model  # noqa: E402

from .test_vlm_logits import TOL, prompt  # noqa: E402
from .tiny_vlm import hf_vlm, make_image, save_vlm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = {"llava": 16, "idefics3": 4}
CODECS = [("int4", "bf16"), ("int4", "fp8_e4m3"), ("fp8_e4m3", "int4")]  # (text pages, image pages)


class StepLogits:
    """Every logit row the engine computes, by (request id, tokens generated before it)."""

    def __init__(self, engine: Engine) -> None:
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        original = engine.runner.run

        def run(plan: Any) -> Any:
            sampled, out, logits = original(plan)
            for i, req in enumerate(sampled):
                self.rows[(req.rid, len(req.output_ids))] = logits[i].detach().float().cpu().clone()
            return sampled, out, logits

        engine.runner.run = run


@pytest.fixture(scope="module", params=list(PAGE))
def vlm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    return family, save_vlm(hf_vlm(family, "siglip", seed=7), Path(tmp_path_factory.mktemp(f"{family}-tri")))


def serve(path: Path, backend: str, text: str, image: str, page: int) -> tuple[dict, list, Engine]:
    """Run the requests; returns the logit rows, the outputs, and the (shut down) engine."""
    engine = Engine(
        load_model(path, dtype=torch.float32, device=DEVICE),
        attention_backend=backend,
        kv_cache_dtype=text,
        vision_kv_dtype=image,
        kv_plan="off",
        ring_dtype="float32",
        sinks=False,
        rotation=False,
        page_size=page,
        recent_window=page,
        chunked_prefill_size=3 * page,
        max_total_tokens=2048,
        disable_cuda_graph=True,
        disable_overlap_schedule=True,  # the spy reads every step's logit rows from runner.run
    )
    spy = StepLogits(engine)
    a, b, c = make_image(21), make_image(22, (20, 50)), make_image(23)
    two, one = prompt(20, [2, 9], seed=11), prompt(14, [3], seed=12)
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    with engine:
        assert engine.cache.image_pool is not None and engine.cache.image_pool.codec_names[0] == image
        outs = engine.generate(input_ids=[two, one], image_data=[[a, b], [c]], rid=["two", "one"],
                               sampling_params=params)  # fmt: skip
        again = engine.generate(
            input_ids=two + [7, 8, 9], image_data=[a, b], rid="again", sampling_params=params
        )
        outs.append(again)
        stats = engine.check_invariants()
        assert stats.tiers["image"].cached > 0 and stats.running == 0
    return spy.rows, outs, engine


@pytest.mark.parametrize(("text", "image"), CODECS)
def test_triton_equals_torch_over_the_image_pool(vlm_dir, text: str, image: str):
    family, path = vlm_dir
    ref_rows, ref_out, _ = serve(path, "torch", text, image, PAGE[family])
    rows, out, _ = serve(path, "triton", text, image, PAGE[family])
    assert rows.keys() == ref_rows.keys() and len(rows) == 3 * 3  # 3 requests x 3 tokens
    worst = max(float((rows[key] - ref_rows[key]).abs().max()) for key in rows)
    print(
        f"\n{family} text {text} image {image}: max |triton - torch logit| {worst:.2e} over {len(rows)} rows"
    )
    assert worst < TOL, worst
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref_out]
    cached = [o["meta_info"]["cached_tokens"] for o in out]
    assert cached == [o["meta_info"]["cached_tokens"] for o in ref_out] and cached[2] >= 2 * PAGE[family]
