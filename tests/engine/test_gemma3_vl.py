"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) served by ferry vs HF
transformers.

A tiny random checkpoint (``vl_helpers.save_gemma3``: a 2-layer SigLIP on 56-pixel images
in 7-pixel patches, pooled to 16 tokens per image, before a 6-layer Gemma 3 language model
with windows of 8 tokens, fewer than an image's) is loaded by the offline ``LLM`` (float32,
CPU). Prompts are rendered by the checkpoint's chat template with the server's image
processing (``server.media.process.load_image_processor``: ``<start_of_image>`` expanded in
the text, transformers' Gemma 3 image processor, the image cut into the tower's patches);
HF ``generate`` gets the same ids, the processor's ``pixel_values`` and the image tokens'
``token_type_ids`` (their bidirectional attention). Greedy tokens must be equal and the
chosen tokens' log-probabilities within 1e-3 over 12 steps: one image, two images in one
prompt, images of two sizes, batched with a text-only request, the same image again (a
prefix-cache hit), a different image after the same text, and prefill chunks of 5 tokens
(which never cut an image: its tokens see each other).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")

from parity_helpers import SP, assert_matches_hf, hf_greedy, parity_llm  # noqa: E402
from vl_helpers import GEMMA3_IMAGE_ID, gemma3_images, save_gemma3  # noqa: E402

from server.media.process import load_image_processor  # noqa: E402

pytestmark = pytest.mark.slow


class Case:
    """One prompt: its expanded ids, the engine's image data, the HF reference."""

    def __init__(self, hf, tok, proc, parts: list, pics: list):
        content = [{"type": "image"} if p is None else {"type": "text", "text": p}
                   for p in parts]
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(proc.expand_text(text), add_special_tokens=False)
        self.ids, self.images = proc.process(ids, pics)
        self.pics = pics
        self.ref = _hf_generate(hf, proc, self.ids, pics)


def _hf_generate(hf, proc, prompt: list[int], pics: list, bidirectional: bool = True):
    """:func:`hf_greedy` with the processor's ``pixel_values`` and the image tokens'
    ``token_type_ids`` (``bidirectional=False``: none, HF then attends causally)."""
    kw = {}
    if pics:
        kw["pixel_values"] = proc.processor(images=pics, return_tensors="pt")["pixel_values"]
        if bidirectional:
            kw["token_type_ids"] = (torch.tensor([prompt]) == GEMMA3_IMAGE_ID).long()
    return hf_greedy(hf, prompt, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("gemma3_vl")
    hf = save_gemma3(path)
    tok = AutoTokenizer.from_pretrained(path)
    proc = load_image_processor(str(path))
    pics = gemma3_images()
    cases = {
        "red": Case(hf, tok, proc, ["What is this? ", None, " Say."], [pics["red"]]),
        "blue": Case(hf, tok, proc, ["What is this? ", None, " Say."], [pics["blue"]]),
        "two": Case(hf, tok, proc, ["Compare ", None, " with ", None, " now."],
                    [pics["gradient"], pics["red"]]),
        "text": Case(hf, tok, proc, ["Just some text, no image at all."], []),
    }
    return hf, str(path), cases, proc


@pytest.fixture(scope="module")
def llm(ckpt):
    with parity_llm(ckpt[1], max_total_tokens=2048) as engine:
        yield engine


def _run(llm, cases: list):
    return llm.generate([c.ids for c in cases], SP, images=[c.images for c in cases])


def test_images_and_their_attention_change_the_answer(ckpt):
    """The image matters, and so does the bidirectional attention within it (HF without
    token_type_ids attends causally: other log-probs), so the checks below can fail."""
    hf, _, cases, proc = ckpt
    red = cases["red"]
    assert red.ref != cases["blue"].ref
    causal = _hf_generate(hf, proc, red.ids, red.pics, bidirectional=False)
    assert max(abs(a - b) for a, b in zip(causal[1], red.ref[1])) > 1e-2
    two = cases["two"]
    assert [(d.grid_thw, d.merge, d.length) for d in two.images] == [([1, 8, 8], 2, 16)] * 2
    assert [two.ids[d.offset - 1] for d in two.images] == [256, 256]   # <start_of_image>
    assert [two.ids[d.offset + d.length] for d in two.images] == [258, 258]


def test_one_and_two_images_match_hf(ckpt, llm):
    assert type(llm.runner.model).__name__ == "Gemma3ForConditionalGeneration"
    for name in ("red", "blue", "two"):
        llm.scheduler.flush_cache()
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
    last = case.images[-1]
    assert again.num_cached_tokens >= last.offset + last.length, again.num_cached_tokens
    assert again.token_ids == first.token_ids
    assert_matches_hf(again, case.ref, "cache hit")


def test_different_images_share_no_kv(ckpt, llm):
    llm.scheduler.flush_cache()
    red, blue = ckpt[2]["red"], ckpt[2]["blue"]
    assert red.images[0].offset == blue.images[0].offset
    _run(llm, [red])
    out = _run(llm, [blue])[0]
    assert out.num_cached_tokens <= blue.images[0].offset
    assert_matches_hf(out, blue.ref, "after another image")


def test_ngram_speculation_with_images_matches_hf(ckpt):
    """NGRAM verify steps over image requests (no M-RoPE here; the image's bidirectional
    span lies in the prompt, before any draft) give HF's greedy tokens."""
    with parity_llm(ckpt[1], max_total_tokens=2048, speculative_algorithm="NGRAM") as engine:
        for name in ("red", "two"):
            assert_matches_hf(_run(engine, [ckpt[2][name]])[0], ckpt[2][name].ref,
                              f"{name} with NGRAM")
        assert engine.scheduler.spec.stats["spec_verify_steps"] > 0


def test_chunked_prefill_keeps_images_whole(ckpt, monkeypatch):
    """Chunks of 5 tokens: every chunk that reaches an image ends before it or takes it
    whole (16 tokens past the budget), and the answers are HF's."""
    from engine.scheduler.admission import ExtendAdder

    chunks = []
    add = ExtendAdder._add

    def spy(self, req, n, waiting):
        if req.mm is not None:
            chunks.append((req.kv_len, req.kv_len + n))
        return add(self, req, n, waiting)

    monkeypatch.setattr(ExtendAdder, "_add", spy)
    with parity_llm(ckpt[1], max_total_tokens=2048, chunked_prefill_size=5,
                    disable_radix_cache=True) as engine:
        cases = [ckpt[2]["two"], ckpt[2]["text"]]
        outs = _run(engine, cases)
    for c, out in zip(cases, outs):
        assert_matches_hf(out, c.ref, "chunked")
    spans = [(d.offset, d.offset + d.length) for d in cases[0].images]
    assert [c for c in chunks if c[1] - c[0] > 5] == spans   # each image in one chunk
    assert chunks[-1][1] == len(cases[0].ids)
    for lo, hi in chunks:
        assert not any(a < hi < b for a, b in spans), (lo, hi)


def test_text_only_and_a_wrong_grid(ckpt):
    """A text-only request is the language model's (HF without pixels); the encoder's
    grid is checked against the request (a 400 naming ``images``)."""
    from engine.validation import RequestError, images_for

    hf, path, cases, _ = ckpt
    with parity_llm(path) as engine:
        out = engine.generate([cases["text"].ids], SP)[0]
        assert_matches_hf(out, cases["text"].ref, "text only")
        bad = cases["red"].images[0]
        wrong = type(bad)(**{f: getattr(bad, f) for f in bad.__struct_fields__})
        wrong.grid_thw, wrong.merge = [1, 4, 16], 2
        with pytest.raises(RequestError) as e:
            images_for(engine.runner.model, [wrong], len(cases["red"].ids))
        assert e.value.param == "images"


def test_tp2_serves_text_and_images(ckpt):
    """With tensor parallelism (gloo, 2 ranks; the tower whole on each) the model serves
    text and images as HF does (``tests/engine/test_vision_tp.py`` checks TP=2 against TP=1
    in more cases)."""
    from engine.llm import LLM

    _, path, cases, _ = ckpt
    names = ["text", "red", "two"]
    with LLM(path, tp_size=2, cpu_threads=1, dtype="float32", device="cpu", seed=3) as llm:
        assert llm.runner.model.accepts_images is True
        outs = _run(llm, [cases[n] for n in names])
    for n, out in zip(names, outs):
        assert_matches_hf(out, cases[n].ref, f"TP=2 {n}")
