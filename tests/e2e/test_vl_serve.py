"""``ferry serve`` on a tiny Qwen2.5-VL checkpoint with image input, through the whole
server: a chat completion with a base64 image equals HF ``generate`` on the same prompt and
pixels; the same image again is a prefix-cache hit over its tokens (``cached_tokens``); a
``file://`` image under ``--allowed-local-media-path``, Responses' ``input_image`` and
Anthropic's base64 ``image`` block are answered; a bad image is a 400 naming the part. One
server for the module.

The checkpoint, tokenizer and image processor come from ``tests/engine/vl_helpers.py``; the
offline engine's parity (two images, batching with text, chunked prefill, cache sharing) is
``tests/engine/test_qwen_vl.py``.
"""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import FerryServer

pytestmark = pytest.mark.slow
pytest.importorskip("PIL")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

NEW_TOKENS = 12
MODEL = "tiny-vl"


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(server, HF model, checkpoint dir, media dir) of a tiny random Qwen2.5-VL."""
    from vl_helpers import images, save_tiny

    ckpt = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = save_tiny(ckpt)
    media = tmp_path_factory.mktemp("media")
    (media / "gradient.png").write_bytes(_png(images()["gradient"]))
    srv = FerryServer(tmp_path_factory.mktemp("ferry-vl"), [
        "--model-path", str(ckpt), "--device", "cpu", "--dtype", "float32",
        "--served-model-name", MODEL, "--max-total-tokens", "2048",
        "--allowed-local-media-path", str(media)])
    srv.start()
    try:
        yield srv, hf, ckpt, media
    finally:
        srv.stop()


def _chat(srv, content, **kw):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=srv.http_timeout, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **kw})


def test_chat_with_an_image_equals_hf_and_hits_the_cache(vl):
    from transformers import AutoTokenizer
    from vl_helpers import IMAGE_TOKEN_ID, image_processor, images

    from server.media.process import ImageProcessor

    srv, hf, ckpt, _ = vl
    assert "image input on: Qwen2_5_VLForConditionalGeneration" in srv.log()
    pic = images()["red"]
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "What is this? "}, {"type": "image"}]}], tokenize=False,
        add_generation_prompt=True)
    ids, _ = ImageProcessor(image_processor(), IMAGE_TOKEN_ID).process(
        tok.encode(text, add_special_tokens=False), [pic])
    px = image_processor()(images=[pic], return_tensors="pt")
    x = torch.tensor([ids])
    with torch.no_grad():
        seq = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                          mm_token_type_ids=(x == IMAGE_TOKEN_ID).int())
    want = tok.decode(seq[0, len(ids):].tolist(), skip_special_tokens=True)
    url = "data:image/png;base64," + base64.b64encode(_png(pic)).decode()
    content = [{"type": "text", "text": "What is this? "},
               {"type": "image_url", "image_url": {"url": url, "detail": "high"}}]
    bodies = []
    for _ in range(2):
        r = _chat(srv, content)
        assert r.status_code == 200, r.text
        bodies.append(r.json())
    for body in bodies:
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["choices"][0]["message"]["content"] == want
    assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) - 8


def test_file_responses_and_anthropic_images(vl):
    srv, _, _, media = vl
    r = _chat(srv, [{"type": "image_url", "image_url": {"url": f"file://{media}/gradient.png"}},
                    {"type": "text", "text": "and?"}])
    assert r.status_code == 200, r.text
    url = "data:image/png;base64," + base64.b64encode((media / "gradient.png").read_bytes()) \
        .decode()
    r = httpx.post(srv.url + "/v1/responses", timeout=srv.http_timeout, json={
        "model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "?"}]}]})
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/v1/messages", timeout=srv.http_timeout,
                   headers={"anthropic-version": "2023-06-01"}, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": url.split(",", 1)[1]}},
            {"type": "text", "text": "?"}]}]})
    assert r.status_code == 200, r.text


def test_bad_images_are_400s(vl):
    srv = vl[0]
    r = _chat(srv, [{"type": "text", "text": "x"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content[1].image_url"
    r = _chat(srv, [{"type": "image_url", "image_url": {"url": "https://x.example/a.png"}}])
    assert r.status_code == 400 and "--allowed-media-domains" in r.json()["error"]["message"]
