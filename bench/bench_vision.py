"""ferry bench-vision: image input of a vision-language model, in-process (issue 48).

For one synthetic image of ``--image-size`` pixels a side (random pixels on the model's
patch grid, the size rounded to the patch-times-merge unit as the image processor does) and
``--text-len`` text tokens around it:

- the vision tower alone (``encoder_s``): one image's patches to its token embeddings;
- the time to the first token of the whole request (``ttft_s``: the tower, then the prefill
  of text and image tokens, one sampled token), the prefix cache flushed before each run;
- the same prompt length without an image (``ttft_text_s``), for comparison.

Medians over ``--repeats`` runs after a warm-up. Runs on dummy weights of a config file
(``--model-path engine/configs/qwen2.5-vl-7b-instruct.json --load-format dummy``; Gemma 3's
``gemma-3-27b.json`` takes its fixed 896-pixel images, 256 tokens, whatever
``--image-size``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from bench.bench_latency import _Timer
from bench.result_line import emit_result
from engine.args import ServerArgs
from engine.io_struct import ImageData
from engine.sampling.params import SamplingParams
from server.cli import add_engine_args


def synthetic_image(vc, size: int, offset: int, seed: int = 0) -> ImageData:
    """A random image of about ``size`` x ``size`` pixels for a tower with config ``vc``,
    its tokens starting at prompt index ``offset`` (Qwen's towers)."""
    patch, merge, tp = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
    unit = patch * merge
    g = max(unit, round(size / unit) * unit) // patch
    pixels = torch.randn(g * g, 3 * tp * patch * patch,
                         generator=torch.Generator().manual_seed(seed))
    return ImageData(pixel_values=pixels.numpy().astype("<f4").tobytes(),
                     pixel_shape=list(pixels.shape), grid_thw=[1, g, g], merge=merge,
                     content_hash=seed, offset=offset, length=(g // merge) ** 2)


def _gemma3_image(vc, offset: int, seed: int, tokens: int = 256) -> ImageData:
    """Gemma 3's random image: SigLIP takes ``image_size`` square images only, its
    ``(image_size / patch)^2`` patches pooled to ``tokens`` (``mm_tokens_per_image``)."""
    g, patch = vc.image_size // vc.patch_size, vc.patch_size
    merge = g // int(round(tokens ** 0.5))
    pixels = torch.randn(g * g, 3 * patch * patch, generator=torch.Generator().manual_seed(seed))
    return ImageData(pixel_values=pixels.numpy().astype("<f4").tobytes(),
                     pixel_shape=list(pixels.shape), grid_thw=[1, g, g], merge=merge,
                     content_hash=seed, offset=offset, length=tokens)


def _encoder(model):
    """``encode(pixels, grid)``: the model's image encoder (Qwen's ``visual``, Gemma 3's
    tower and projector)."""
    if hasattr(model, "visual"):
        return model.visual
    from engine.models.gemma3_vision import encode_image

    return lambda pixels, grid: encode_image(model.vision_tower, model.multi_modal_projector,
                                             pixels)


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def image_llm(ns: argparse.Namespace):
    """The in-process ``LLM`` of the parsed engine flags ``ns``; SystemExit naming the model
    class when it does not read images."""
    from engine.llm import LLM

    args = ServerArgs.from_cli_args(ns)
    llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    if not getattr(llm.runner.model, "accepts_images", False):
        raise SystemExit(f"{type(llm.runner.model).__name__} does not read images")
    return llm


def dummy_image(model, image_size: int, position: int):
    """One synthetic image for ``model`` at prompt position ``position``: a square of
    ``image_size`` pixels for the Qwen towers, Gemma 3's fixed token count otherwise."""
    vc = model.config.vision_config
    if hasattr(vc, "spatial_merge_size"):
        return synthetic_image(vc, image_size, position)
    return _gemma3_image(vc, position, 0, int(model.config.mm_tokens_per_image))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ferry bench-vision", description=__doc__)
    p.add_argument("--image-size", type=int, default=1024, help="pixels a side (default 1024)")
    p.add_argument("--text-len", type=int, default=100, help="text tokens (default 100)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (default 3)")
    p.add_argument("--result-jsonl", default=None, help="append one JSON line")
    add_engine_args(p)
    ns = p.parse_args(argv)
    llm = image_llm(ns)
    model, runner = llm.runner.model, llm.runner
    half = ns.text_len // 2
    image = dummy_image(model, ns.image_size, half)
    g = torch.Generator().manual_seed(1)
    vocab = model.model_config.vocab_size
    text = torch.randint(10, min(1000, vocab), (ns.text_len,), generator=g).tolist()
    ids = text[:half] + [model.image_token_id] * image.length + text[half:]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def request(with_image: bool):
        llm.scheduler.flush_cache()
        llm.generate([ids], sp, images=[[image] if with_image else []])

    pixels = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32) \
        .view(image.pixel_shape)

    encode = _encoder(model)

    def timed_encode():
        with torch.inference_mode(), _Timer(runner.device_type) as t:
            encode(pixels, tuple(image.grid_thw))
        return t.elapsed

    timed_encode()
    encoder = statistics.median(timed_encode() for _ in range(ns.repeats))
    res = {"image_size": ns.image_size, "image_tokens": image.length,
           "text_tokens": ns.text_len, "device": runner.device_type,
           "dtype": str(runner.dtype).replace("torch.", ""), "encoder_s": encoder,
           "ttft_s": _median_s(lambda: request(True), ns.repeats),
           "ttft_text_s": _median_s(lambda: request(False), ns.repeats)}
    emit_result(res, f"image {ns.image_size}px ({image.length} tokens) + {ns.text_len} text "
                f"tokens | encoder {encoder * 1e3:.1f} ms | TTFT {res['ttft_s'] * 1e3:.1f} ms "
                f"(text only, same length: {res['ttft_text_s'] * 1e3:.1f} ms)",
                ns.result_jsonl)
    llm.shutdown()


if __name__ == "__main__":
    main()
