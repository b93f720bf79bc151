"""Qwen2.5-VL, Qwen3-VL and Gemma 3 with images on an accelerator (marker gpu): the tiny checkpoints of
``vl_helpers`` in fp32 with the Triton attention and rotary and the decode graphs on. A batch
of an image request (run eagerly: ``engine/executor/graph_replay.py``) and a text-only one,
then a text-only batch (through the graphs), must give HF ``generate``'s greedy tokens
(HF on the CPU) with log-probabilities within 1e-3, and the same image again must hit the
prefix cache."""

from __future__ import annotations

import pytest

from engine.device import resolve_device

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
DEVICE = resolve_device("auto")
if DEVICE == "cpu":
    pytest.skip("needs a CUDA or XPU device", allow_module_level=True)
pytest.importorskip("PIL")

from parity_helpers import SP, assert_matches_hf  # noqa: E402
from test_qwen_vl import ARCHS, Case  # noqa: E402
from vl_helpers import images, save_tiny  # noqa: E402

from engine.llm import LLM  # noqa: E402


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_vl_on_the_device_matches_hf(arch, tmp_path):
    from transformers import AutoTokenizer

    hf = save_tiny(tmp_path, arch=arch)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    pics, patch = images(), ARCHS[arch][0]
    two = Case(hf, tok, ["Compare ", None, " with ", None, " now."],
               [pics["gradient"], pics["tall"]], patch)
    text = Case(hf, tok, ["Just some text, no image at all."], [], patch)
    llm = LLM(str(tmp_path), dtype="float32", device=DEVICE, max_total_tokens=4096)
    try:
        assert llm.runner.graph_runner is not None
        outs = llm.generate([two.ids, text.ids], SP, images=[two.images, []])
        assert_matches_hf(outs[0], two.ref, f"{arch} image on {DEVICE}")
        assert_matches_hf(outs[1], text.ref, f"{arch} text beside it")
        again = llm.generate([two.ids, text.ids], SP, images=[two.images, []])
        assert again[0].num_cached_tokens > two.images[-1].offset
        assert_matches_hf(again[0], two.ref, f"{arch} cache hit on {DEVICE}")
        assert_matches_hf(llm.generate([text.ids], SP)[0], text.ref, f"{arch} text, graphs")
    finally:
        llm.shutdown()


def test_gemma3_images_on_the_device_match_hf(tmp_path):
    """Gemma 3: the image tokens' bidirectional attention through the Triton extend kernel's
    key limits (the device's default backend) (and its windows of 8, fewer than an image's 16 tokens), then a cache hit
    and a chunked prefill that keeps each image whole."""
    from test_gemma3_vl import Case as GemmaCase
    from transformers import AutoTokenizer
    from vl_helpers import gemma3_images, save_gemma3

    from server.media.process import load_image_processor

    hf = save_gemma3(tmp_path)
    tok, proc, pics = AutoTokenizer.from_pretrained(tmp_path), \
        load_image_processor(str(tmp_path)), gemma3_images()
    two = GemmaCase(hf, tok, proc, ["Compare ", None, " with ", None, " now."],
                    [pics["gradient"], pics["red"]])
    text = GemmaCase(hf, tok, proc, ["Just some text, no image at all."], [])
    for kw in ({}, {"chunked_prefill_size": 8, "disable_radix_cache": True}):
        llm = LLM(str(tmp_path), dtype="float32", device=DEVICE, max_total_tokens=4096, **kw)
        try:
            outs = llm.generate([two.ids, text.ids], SP, images=[two.images, []])
            assert_matches_hf(outs[0], two.ref, f"gemma3 images on {DEVICE} {kw}")
            assert_matches_hf(outs[1], text.ref, "gemma3 text beside it")
            if not kw:
                again = llm.generate([two.ids], SP, images=[two.images])[0]
                assert again.num_cached_tokens > two.images[-1].offset
                assert_matches_hf(again, two.ref, f"gemma3 cache hit on {DEVICE}")
        finally:
            llm.shutdown()
