"""Images under tensor parallelism and the encoder budget (issue 48 items 4 and 5), on the
CPU with gloo.

TP: each image model (Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3; the tiny random checkpoints
of ``vl_helpers``, built once per module) is served by the offline ``LLM`` at TP=1 and TP=2
(the vision tower whole on both ranks, rank 0 sending the worker the images of each step:
``engine/executor/tp_images.py``) with 16-token prefill chunks, which cut the Qwen images
across steps (the worker encodes an image once and keeps its embeddings for the next
chunk): one image, two images in one prompt, a batch of a text request and two image
requests, and the two-image prompt again (a prefix-cache hit over its images; Qwen3.5's
hybrid model hits on the third run, at the snapshot the second leaves). Greedy tokens and
cached-token counts equal, every returned log-prob within 1e-3.

Encoder budget (``engine/scheduler/admission.py``, gate 5): with a budget of 100 patches,
three requests with a 64-patch image each are admitted one image per step (the token budget
alone would take two and a half prompts), and the outputs equal a run with the default
budget.
"""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

from parity_helpers import LOGPROB_TOL, SP, floats_in, parity_llm  # noqa: E402
from vl_helpers import gemma3_images, images, save_gemma3, save_tiny  # noqa: E402

from server.media.process import load_image_processor  # noqa: E402

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3")


def _prompt(tok, proc, parts: list, pics: list) -> tuple[list[int], list]:
    """(expanded ids, image data) of one user message of ``parts`` (None: an image)."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    if callable(getattr(proc, "expand_text", None)):
        text = proc.expand_text(text)
    return proc.process(tok.encode(text, add_special_tokens=False), pics)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """``ckpt(arch)``: (checkpoint folder, prompts by name), built on first use."""
    from transformers import AutoTokenizer

    built: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in built:
            path = tmp_path_factory.mktemp(arch)
            if arch == "gemma3":
                save_gemma3(path)
                pics = gemma3_images()
                one, two = [pics["red"]], [pics["gradient"], pics["blue"]]
            else:
                save_tiny(path, arch=arch)
                pics = images()
                one, two = [pics["red"]], [pics["gradient"], pics["tall"]]
            tok = AutoTokenizer.from_pretrained(path)
            proc = load_image_processor(str(path))
            built[arch] = (str(path), {
                "one": _prompt(tok, proc, ["What is this? ", None, " Say."], one),
                "two": _prompt(tok, proc, ["Compare ", None, " with ", None, " now."], two),
                "blue": _prompt(tok, proc, ["Describe ", None], [two[1]]),
                "text": _prompt(tok, proc, ["Just some text, no image at all."], []),
            })
        return built[arch]

    return get



def _generate(llm, prompts: list) -> list:
    return llm.generate([ids for ids, _ in prompts], SP, images=[im for _, im in prompts])


def _run(path: str, p: dict, hybrid: bool, **kw) -> tuple[list, list[float], list[int]]:
    """(tokens, log-probs, cached tokens) of the module docstring's sequence."""
    with parity_llm(path, max_total_tokens=2048, chunked_prefill_size=16, **kw) as llm:
        if kw.get("tp_size", 1) > 1:
            assert llm.runner.model.accepts_images
        outs = _generate(llm, [p["one"]]) + _generate(llm, [p["two"]])
        outs += _generate(llm, [p["text"], p["blue"], p["one"]])
        outs += _generate(llm, [p["two"]])
        if hybrid:   # the repeat leaves a snapshot at its branching point: the next hits
            outs += _generate(llm, [p["two"]])
    lps = [v for o in outs for v in floats_in(o.logprobs)]
    return [list(o.token_ids) for o in outs], lps, [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_tp1_with_images(arch, ckpt):
    path, prompts = ckpt(arch)
    hybrid = arch == "qwen3_5"
    ref_toks, ref_lps, ref_cached = _run(path, prompts, hybrid)
    toks, lps, cached = _run(path, prompts, hybrid, tp_size=2)
    two = prompts["two"][1]
    assert ref_cached[-1] >= two[-1].offset + two[-1].length, "no cache hit over the images"
    assert cached == ref_cached
    assert toks == ref_toks
    assert len(lps) == len(ref_lps) > 0
    worst = max(abs(a - b) for a, b in zip(lps, ref_lps))
    assert worst < LOGPROB_TOL, f"{arch}: TP=2 log-prob differs from TP=1 by {worst:.2e}"


def test_encoder_budget_splits_image_requests(ckpt, monkeypatch):
    from engine.scheduler.admission import ExtendAdder

    path, prompts = ckpt("qwen2_5_vl")
    # three different 8x8-patch (64-patch, 16-token) images: no shared prefix past the text
    from PIL import Image
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    proc = load_image_processor(path)
    reqs = [_prompt(tok, proc, ["Look: ", None, " ok"], [Image.new("RGB", (112, 112), c)])
            for c in [(200, 10, 10), (10, 200, 10), (10, 10, 200)]]
    assert [im[0].pixel_shape[0] for _, im in reqs] == [64] * 3
    steps: list[tuple[int, int]] = []   # (patches encoded, prompt tokens) per extend step
    real_add = ExtendAdder._add

    def spy(self, req, n, waiting):
        if not self.reqs:
            steps.append((0, 0))
        cost = self._encoder_cost(req, n)
        real_add(self, req, n, waiting)
        steps[-1] = (steps[-1][0] + cost, steps[-1][1] + n)

    with parity_llm(path, max_total_tokens=2048) as llm:
        ref = _generate(llm, reqs)
    monkeypatch.setattr(ExtendAdder, "_add", spy)
    with parity_llm(path, max_total_tokens=2048, chunked_prefill_size=100,
                    max_prefill_tokens=100) as llm:
        assert llm.scheduler.encoder_budget == 100
        got = _generate(llm, reqs)
    assert sum(len(ids) for ids, _ in reqs) < 2.5 * 100   # the token budget: under 3 steps
    encoded = [e for e, _ in steps if e]
    assert encoded == [64, 64, 64], steps                  # one image per step
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        worst = max(abs(x - y) for x, y in zip(floats_in(a.logprobs), floats_in(b.logprobs)))
        assert worst < LOGPROB_TOL
