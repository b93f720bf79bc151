"""Image input on the server (``server/media/``, ``server/pipeline/prompt.py``): chat
``image_url`` parts, Responses ``input_image`` and Anthropic ``image`` blocks reach the
engine as ``ImageData`` with the prompt's image tokens expanded; every bad, oversized,
undecodable, unallowed or surplus image, and any image to a text-only model, is a 400
naming the part. Over a fake engine (``app_helpers``) with the tiny Qwen2.5-VL tokenizer and
image processor of ``tests/engine/vl_helpers.py``."""

from __future__ import annotations

import base64
import io
import sys
import zlib
from pathlib import Path

import pytest

pytest.importorskip("PIL")

from PIL import Image  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from engine import io_struct  # noqa: E402
from server.anthropic.blocks import chat_messages  # noqa: E402
from server.media.fetch import MediaLimits  # noqa: E402
from server.media.process import ImageProcessor, expand_image_tokens  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "engine"))
from app_helpers import make_app  # noqa: E402
from vl_helpers import IMAGE_TOKEN_ID, image_processor  # noqa: E402
from vl_helpers import data_url as _data_url  # noqa: E402
from vl_helpers import png as _png  # noqa: E402


@pytest.fixture
def served(tokenizer, tmp_path):
    (tmp_path / "ok.png").write_bytes(_png())
    app, engine = make_app(allowed_local_media_path=str(tmp_path),
                           allowed_media_domains=("img.example",),
                           limit_mm_per_prompt="image=2", max_image_bytes=20000,
                           max_image_pixels=200 * 200)
    tm = engine.tm
    tm.set_tokenizer(tokenizer)
    tm.images = ImageProcessor(image_processor(), IMAGE_TOKEN_ID)
    tm.media_limits = MediaLimits.from_args(tm.args)
    return TestClient(app), engine, tmp_path


def _chat(client, *parts, role="user"):
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": role, "content": content}], "max_tokens": 2})


def _image(url: str, **kw) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **kw}}


def _sent(engine) -> io_struct.TokenizedGenerateReq:
    return [m for m in engine.sent if isinstance(m, io_struct.TokenizedGenerateReq)][-1]


def test_chat_images_reach_the_engine(served):
    client, engine, tmp = served
    r = _chat(client, "look ", _image(_data_url(_png()), detail="low"), " and ",
              _image(f"file://{tmp}/ok.png"))
    assert r.status_code == 200, r.text
    msg = _sent(engine)
    assert len(msg.images) == 2
    assert msg.images[0].content_hash == msg.images[1].content_hash  # the same pixels
    for im in msg.images:
        assert im.grid_thw == [1, 4, 4] and im.length == 4
        assert msg.input_ids[im.offset:im.offset + im.length] == [IMAGE_TOKEN_ID] * 4
    assert msg.input_ids.count(IMAGE_TOKEN_ID) == 8
    assert r.json()["usage"]["prompt_tokens"] == len(msg.input_ids)


def test_responses_input_image(served):
    client, engine, _ = served
    r = client.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what"},
        {"type": "input_image", "image_url": _data_url(_png((84, 56))), "detail": "auto"}]}],
        "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    assert [im.grid_thw for im in _sent(engine).images] == [[1, 4, 6]]


def test_anthropic_image_blocks_become_image_parts():
    data = base64.b64encode(_png()).decode()
    msgs, _ = chat_messages(None, [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data}},
        {"type": "image", "source": {"type": "url", "url": "https://img.example/a.png"}},
        {"type": "text", "text": "what?"}]}])
    parts = msgs[0]["content"]
    assert parts[0] == {"type": "image_url",
                        "image_url": {"url": f"data:image/png;base64,{data}"}}
    assert parts[1]["image_url"]["url"] == "https://img.example/a.png"


@pytest.mark.parametrize("part, why", [
    (_image("data:image/png;base64,AAAA"), "could not be decoded"),
    (_image("data:image/png;base64,@@@"), "malformed"),
    (_image("data:text/plain;base64,AAAA"), "data:image/"),
    (_image(_data_url(_png((300, 300)))), "pixels"),
    (_image("data:image/png;base64," + "A" * 40000), "larger than"),
    (_image("file:///etc/passwd"), "outside"),
    (_image("https://evil.example/x.png"), "not allowed"),
    (_image("ftp://img.example/x.png"), "data:, file:// or http(s)"),
    # these were 500s: a NUL in a file path, ports httpx or the socket refuse, control
    # characters that urllib drops before the host check
    (_image("file:///tmp/ok.png%00.txt"), "NUL"),
    (_image("http://img.example:99999/x.png"), "malformed"),
    (_image("http://img.example:abc/x.png"), "malformed"),
    (_image("http://img.example/x.png\n"), "control characters"),
    (_image("http://img.\texample/x.png"), "control characters"),
    ({"type": "image_url", "image_url": {"url": "x", "detail": "max"}}, "detail"),
])
def test_bad_images_are_400s_naming_the_part(served, part, why):
    client, _, _ = served
    r = _chat(client, "look ", part)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("messages[1].content[1].image_url"), err
    assert why in err["message"], err["message"]


def test_data_urls_as_tools_write_them(served):
    """Upper-case scheme and type (RFC 2397), base64 wrapped at 76 columns (RFC 2045) and
    without its padding are accepted; the decoded image reaches the engine."""
    client, engine, _ = served
    b64 = base64.b64encode(_png((28, 28))).decode()
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    for url in ("DATA:IMAGE/PNG;BASE64," + b64, "data:image/png;base64," + wrapped,
                "data:image/png;base64," + b64.rstrip("=")):
        r = _chat(client, "look ", _image(url))
        assert r.status_code == 200, (url[:30], r.text)
        assert len(_sent(engine).images) == 1


def test_pixel_limit_decides_over_pils_bomb_guard(tokenizer):
    """A header claiming more pixels than PIL's decompression-bomb default (~179M) is
    refused by --max-image-pixels' message, and a limit above PIL's default is ferry's."""
    from server.http.errors import APIError
    from server.media.fetch import decode_image

    buf = io.BytesIO()
    Image.new("L", (2, 2)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = (20000).to_bytes(4, "big") + (20000).to_bytes(4, "big")  # IHDR w, h
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")          # its CRC
    with pytest.raises(APIError) as err:
        decode_image(bytes(data), "p", MediaLimits(max_pixels=40_000_000))
    assert "20000x20000 pixels" in str(err.value)


def _jpeg(size, colour=(30, 120, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_default_pixel_limit_is_what_the_processors_resize_to():
    """Qwen3-VL's processor resizes to at most 16 Mi pixels (Qwen2.5-VL's to 12.8 M): the
    default --max-image-pixels decodes no more (a 6000x6000 PNG was ~100 MB decoded)."""
    from engine.args import ServerArgs

    assert ServerArgs().max_image_pixels == MediaLimits().max_pixels == 4096 * 4096


def test_a_big_jpeg_decodes_at_a_reduced_scale(tokenizer):
    """A JPEG larger than the processor's target (or the pixel limit) is decoded by PIL's
    DCT scaling (``draft``) at the largest reduction that still meets the target, then
    within the limit; other formats over the limit are refused from their header."""
    from server.http.errors import APIError
    from server.media.fetch import decode_image

    limits = MediaLimits(max_pixels=1000 * 1000)
    big = _jpeg((1600, 1200))
    img = decode_image(big, "p", limits, target_pixels=300 * 200)
    assert img.size == (400, 300) and img.mode == "RGB"  # 1/4: 1/8 would be below target
    img = decode_image(big, "p", limits)  # no target: just within the limit
    assert img.size == (800, 600)
    assert decode_image(_jpeg((200, 100)), "p", limits, target_pixels=300 * 200
                        ).size == (200, 100)  # under the target: whole
    with pytest.raises(APIError) as err:  # a PNG is decoded whole: its header decides
        decode_image(_png((1600, 1200)), "p", limits, target_pixels=300 * 200)
    assert "1600x1200 pixels" in str(err.value) and err.value.param == "p"


def test_a_decoded_image_far_over_the_target_is_reduced(tokenizer):
    """A non-JPEG image four or more times the processor's target is box-reduced by an
    integer factor (still at least the target) before the processor reads it."""
    from server.media.fetch import decode_image

    img = decode_image(_png((600, 400)), "p", MediaLimits(), target_pixels=100 * 100)
    assert img.size == (150, 100)
    assert decode_image(_png((300, 200)), "p", MediaLimits(), target_pixels=100 * 100
                        ).size == (150, 100)
    assert decode_image(_png((150, 100)), "p", MediaLimits(), target_pixels=100 * 100
                        ).size == (150, 100)


def test_the_processors_target_reaches_the_decoder(served, monkeypatch):
    from server.media import fetch

    client, engine, _ = served
    assert engine.tm.images.max_pixels == 28 * 28 * 16  # vl_helpers' processor
    seen = []
    real = fetch.decode_image
    monkeypatch.setattr(fetch, "decode_image", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    assert _chat(client, "look ", _image(_data_url(_jpeg((112, 112))))).status_code == 200
    assert seen == [{"target_pixels": 28 * 28 * 16}]


def test_too_many_images(served):
    client, _, _ = served
    url = _data_url(_png())
    r = _chat(client, _image(url), _image(url), _image(url))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].content[2].image_url"
    assert "--limit-mm-per-prompt" in r.json()["error"]["message"]


def test_text_only_model_refuses_images(served):
    client, engine, _ = served
    engine.tm.images = None
    r = _chat(client, "look ", _image(_data_url(_png())))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].content[1].image_url"
    assert "does not accept images" in r.json()["error"]["message"]


def test_images_only_in_user_messages(served):
    client, _, _ = served
    r = _chat(client, _image(_data_url(_png())), role="assistant")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].content[0].type"


PAD = "<|image_pad|>"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": f"what is {PAD} here?"}]},
     "messages[0].content"),
    ({"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "text", "text": PAD}]}]},
     "messages[1].content[1].text"),
    # beside a real image, a typed pad token is still the text's
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": f"a {PAD}"},
        {"type": "image_url", "image_url": {"url": _data_url(_png())}}]}]},
     "messages[0].content[0].text")])
def test_literal_image_pad_tokens_in_chat_text_are_400s(served, body, param):
    """A user typing the image-pad token without (or beside) an image: the template would
    place it as an image position with no image behind it; a 400 naming the text."""
    client, _, _ = served
    r = client.post("/v1/chat/completions", json=dict(body, max_tokens=2))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and PAD in err["message"], err


@pytest.mark.parametrize("prompt", [f"x {PAD} y", [5, 6, IMAGE_TOKEN_ID, 7],
                                    ["fine", f"{PAD}"]])
def test_image_pad_tokens_in_a_completions_prompt_are_400s(served, prompt):
    client, engine, _ = served
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and PAD in err["message"], err
    assert not any(isinstance(m, io_struct.TokenizedGenerateReq) for m in engine.sent)


def test_responses_and_a_text_model_with_the_pad_text(served):
    client, engine, _ = served
    r = client.post("/v1/responses", json={"input": f"say {PAD}", "max_output_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    engine.tm.images = None  # a text-only model: its own vocabulary, no image positions
    r = client.post("/v1/completions", json={"prompt": f"x {PAD}", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_http_images_fetched_within_limits(served, monkeypatch):
    import httpx

    client, engine, _ = served
    real = httpx.AsyncClient
    big = b"\0" * 30000

    def handler(request):
        return httpx.Response(200, content=_png() if request.url.path == "/ok.png" else big)

    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(
        transport=httpx.MockTransport(handler), **kw))
    r = _chat(client, "look ", _image("https://img.example/ok.png"))
    assert r.status_code == 200, r.text
    assert len(_sent(engine).images) == 1
    r = _chat(client, "look ", _image("https://img.example/big.png"))
    assert r.status_code == 400 and "larger than" in r.json()["error"]["message"]


def test_expand_image_tokens():
    ids, spans = expand_image_tokens([5, 9, 6, 9], 9, [3, 1])
    assert ids == [5, 9, 9, 9, 6, 9] and spans == [(1, 3), (5, 1)]


# ---- Gemma 3: image tokens expanded in the rendered text ----------------------------------


@pytest.fixture
def gemma3_served(tmp_path):
    from transformers import AutoTokenizer
    from vl_helpers import GEMMA3_TOKENS, gemma3_processor, save_gemma3_tokenizer

    from server.media.process import Gemma3ImageProcessor

    save_gemma3_tokenizer(tmp_path)
    app, engine = make_app(limit_mm_per_prompt="image=2")
    tm = engine.tm
    tm.set_tokenizer(AutoTokenizer.from_pretrained(tmp_path))
    tm.images = Gemma3ImageProcessor(gemma3_processor(), 257, tuple(GEMMA3_TOKENS), 16, 7, 2)
    tm.media_limits = MediaLimits.from_args(tm.args)
    return TestClient(app), engine


def test_gemma3_images_expand_in_the_text(gemma3_served):
    """``<start_of_image>`` becomes ``\\n\\n<start_of_image>`` + 16 soft tokens +
    ``<end_of_image>\\n\\n`` before tokenizing; each image is its 8x8 patches of 7 pixels,
    pooled by 2."""
    client, engine = gemma3_served
    r = _chat(client, "look ", _image(_data_url(_png((90, 60)))), " and ",
              _image(_data_url(_png(colour=(1, 2, 3)))))
    assert r.status_code == 200, r.text
    msg = _sent(engine)
    assert msg.input_ids.count(257) == 32
    nl = engine.tm.chat.tokenizer.convert_tokens_to_ids("\n")
    for im in msg.images:
        assert (im.grid_thw, im.merge, im.length, im.pixel_shape) == ([1, 8, 8], 2, 16,
                                                                      [64, 147])
        assert msg.input_ids[im.offset - 3:im.offset] == [nl, nl, 256]
        assert msg.input_ids[im.offset + 16:im.offset + 19] == [258, nl, nl]
    assert msg.images[0].content_hash != msg.images[1].content_hash
    # a typed image marker would become a second image's run (or, without an image part, the
    # raw marker token): a 400 naming the text part, with an image and without
    for parts in [("a literal <start_of_image> too ", _image(_data_url(_png()))),
                  ("a literal <start_of_image> alone",)]:
        r = _chat(client, *parts)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages[1].content[0].text", err
        assert "image marker" in err["message"], err


def test_gemma3_processor_loads_and_refuses_pan_and_scan(tmp_path):
    from vl_helpers import gemma3_config, gemma3_processor, save_gemma3_tokenizer

    from server.media.process import Gemma3ImageProcessor, load_image_processor

    cfg = gemma3_config()
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    cfg.save_pretrained(tmp_path)
    save_gemma3_tokenizer(tmp_path)
    gemma3_processor().save_pretrained(tmp_path)
    proc = load_image_processor(str(tmp_path))
    assert isinstance(proc, Gemma3ImageProcessor)
    assert (proc.image_token_id, proc.tokens, proc.patch, proc.merge) == (257, 16, 7, 2)
    assert proc.expand_text("a<start_of_image>b").count("<image_soft_token>") == 16
    type(gemma3_processor())(size={"height": 56, "width": 56},
                             do_pan_and_scan=True).save_pretrained(tmp_path)
    assert load_image_processor(str(tmp_path)) is None
