"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 served by ferry vs HF transformers, with images.

A tiny random checkpoint of each (``vl_helpers``: Qwen2.5-VL's 3-block vision tower with
windows and one full-attention block before a 2-layer Qwen2 language model with M-RoPE;
Qwen3-VL's tower with a learned position table and two DeepStack levels before a 3-layer
Qwen3 language model with interleaved M-RoPE; Qwen3.5's tower without DeepStack before a
4-layer hybrid Gated DeltaNet / gated attention model with interleaved M-RoPE over a
partial rotary, dense and MoE) is loaded by the offline ``LLM`` (float32,
CPU). The prompts are rendered by the checkpoint's chat template and their
images processed by ``server.media.process.ImageProcessor`` (the server's path); HF
``generate`` gets the same ids and the processor's ``pixel_values`` / ``image_grid_thw``.
Greedy tokens must be equal and the chosen tokens' log-probabilities within 1e-3 over 12
steps: one image, two images in one prompt, batched with a text-only request, the same
image again (a prefix-cache hit over the image's tokens; Qwen3.5's hybrid model: on the
third run, at the snapshot its repeat leaves), a different image after the same
text (no shared KV past the text), and across chunked-prefill boundaries that cut images.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")

from parity_helpers import SP, assert_matches_hf, hf_greedy, parity_llm  # noqa: E402
from vl_helpers import IMAGE_TOKEN_ID, image_processor, images, save_tiny  # noqa: E402

from server.media.process import ImageProcessor  # noqa: E402

pytestmark = pytest.mark.slow


def _render(tok, parts: list) -> list[int]:
    """The prompt ids of one user message of ``parts`` (strings, or None for an image)."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


class Case:
    """One prompt: its expanded ids, the engine's image data, the HF reference."""

    def __init__(self, hf, tok, parts: list, pics: list, patch: int):
        ids = _render(tok, parts)
        self.ids, self.images = ImageProcessor(image_processor(patch), IMAGE_TOKEN_ID).process(
            ids, pics)
        self.ref = _hf_generate(hf, self.ids, pics, patch)


def _hf_generate(hf, prompt: list[int], pics: list, patch: int
                 ) -> tuple[list[int], list[float]]:
    """:func:`hf_greedy` with the processor's ``pixel_values`` / ``image_grid_thw`` of
    ``pics`` (none for a text-only prompt)."""
    kw = {}
    if pics:
        out = image_processor(patch)(images=pics, return_tensors="pt")
        kw = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                  mm_token_type_ids=(torch.tensor([prompt]) == IMAGE_TOKEN_ID).int())
    return hf_greedy(hf, prompt, **kw)


#: per architecture: its patch size and the grids of the "two" case's images
ARCHS = {"qwen2_5_vl": (14, [[1, 6, 6], [1, 8, 2]]), "qwen3_vl": (16, [[1, 6, 6], [1, 8, 4]]),
         "qwen3_5": (16, [[1, 6, 6], [1, 8, 4]]), "qwen3_5_moe": (16, [[1, 6, 6], [1, 8, 4]])}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def ckpt(request, tmp_path_factory):
    from transformers import AutoTokenizer

    arch = request.param
    patch = ARCHS[arch][0]
    path = tmp_path_factory.mktemp(arch)
    hf = save_tiny(path, arch=arch)
    tok = AutoTokenizer.from_pretrained(path)
    pics = images()
    cases = {
        "red": Case(hf, tok, ["What is this? ", None, " Say."], [pics["red"]], patch),
        "blue": Case(hf, tok, ["What is this? ", None, " Say."], [pics["blue"]], patch),
        "two": Case(hf, tok, ["Compare ", None, " with ", None, " now."],
                    [pics["gradient"], pics["tall"]], patch),
        "text": Case(hf, tok, ["Just some text, no image at all."], [], patch),
    }
    return hf, str(path), cases, arch


@pytest.fixture(scope="module")
def llm(ckpt):
    with parity_llm(ckpt[1], max_total_tokens=2048) as engine:
        yield engine


def _run(llm, cases: list):
    return llm.generate([c.ids for c in cases], SP, images=[c.images for c in cases])


def test_images_change_the_answer(ckpt):
    hf, _, cases, arch = ckpt
    assert cases["red"].ref[0] != cases["blue"].ref[0]  # the image matters in the checkpoint
    assert [d.grid_thw for d in cases["two"].images] == ARCHS[arch][1]


def test_one_image_matches_hf(ckpt, llm):
    assert type(llm.runner.model).__name__ == type(ckpt[0]).__name__
    llm.scheduler.flush_cache()
    for name in ("red", "two"):  # one image; two (one of windows with padding, one tall)
        out = _run(llm, [ckpt[2][name]])[0]
        assert_matches_hf(out, ckpt[2][name].ref, name)


def test_batched_with_text_only(ckpt, llm):
    llm.scheduler.flush_cache()
    cases = [ckpt[2]["text"], ckpt[2]["two"], ckpt[2]["blue"]]
    for c, out in zip(cases, _run(llm, cases)):
        assert_matches_hf(out, c.ref, "batched")


def test_same_image_hits_the_cache(ckpt, llm):
    llm.scheduler.flush_cache()
    case = ckpt[2]["two"]
    first = _run(llm, [case])[0]
    again = _run(llm, [case])[0]
    if ckpt[3].startswith("qwen3_5"):
        # a hybrid model reuses a prefix only where a state snapshot ends: the first run
        # left one at its end (past this prompt), the repeat one at its branching point
        # (the prompt's last token), which the third run hits
        assert again.token_ids == first.token_ids
        again = _run(llm, [case])[0]
    last_image_end = case.images[-1].offset + case.images[-1].length
    assert again.num_cached_tokens >= last_image_end, again.num_cached_tokens
    assert again.token_ids == first.token_ids
    assert_matches_hf(again, case.ref, "cache hit")


def test_different_images_share_no_kv(ckpt, llm):
    llm.scheduler.flush_cache()
    red, blue = ckpt[2]["red"], ckpt[2]["blue"]
    assert red.images[0].offset == blue.images[0].offset  # the same text before the image
    _run(llm, [red])
    out = _run(llm, [blue])[0]
    assert out.num_cached_tokens <= blue.images[0].offset
    assert_matches_hf(out, blue.ref, "after another image")


def test_chunked_prefill_cuts_images(ckpt):
    """Chunks of 5 tokens cut every image (9 and 4 or 8 tokens) across steps."""
    with parity_llm(ckpt[1], max_total_tokens=2048, chunked_prefill_size=5,
                    disable_radix_cache=True) as engine:
        cases = [ckpt[2]["two"], ckpt[2]["text"]]
        for c, out in zip(cases, _run(engine, cases)):
            assert_matches_hf(out, c.ref, "chunked")


def test_images_to_a_text_model_are_refused(ckpt, llm):
    from engine.validation import RequestError, images_for

    with pytest.raises(RequestError) as e:
        images_for(object(), ckpt[2]["red"].images, len(ckpt[2]["red"].ids))
    assert e.value.param == "messages"
    bad = ckpt[2]["red"]
    with pytest.raises(ValueError, match="images"):  # a span past the prompt
        llm.generate([bad.ids[:10]], SP, images=[bad.images])


def test_ngram_speculation_serves_images(ckpt):
    """NGRAM speculative decoding serves text and images as HF does: its verify step takes
    the images' M-RoPE positions (``VerifyReq.mm``; Qwen3.5's hybrid model verifies as an
    extend). A draft model or head (EAGLE, MTP, STANDALONE) is refused at start-up, or
    turns image input off on Qwen3.5 (``RankRunner``'s ``images_off_reason``)."""
    with parity_llm(ckpt[1], max_total_tokens=2048, speculative_algorithm="NGRAM") as engine:
        for name in ("text", "red", "two"):
            case = ckpt[2][name]
            assert_matches_hf(_run(engine, [case])[0], case.ref, f"{name} with NGRAM")
