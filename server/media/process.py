"""The images of a prompt, processed for the engine: ``ImageProcessor``.

The chat template renders one image-pad token per image (Qwen2.5-VL's
``<|vision_start|><|image_pad|><|vision_end|>``); the model's image processor (transformers'
PIL one, ``Qwen2VLImageProcessorPil``: resize to multiples of ``patch * merge`` pixels
within its pixel bounds, normalise, flatten into patches) gives each image's
``pixel_values`` and ``image_grid_thw``; :func:`expand_image_tokens` repeats each pad token
to the image's token count ``t * (h / merge) * (w / merge)``; and each image becomes an
``engine.io_struct.ImageData`` (float32 bytes, grid, a BLAKE2b hash of the pixels and grid,
its span of prompt tokens), which msgspec carries to the engine.
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine.io_struct import ImageData


class ImageError(ValueError):
    """An image the processor cannot take; ``index``: which image of the prompt."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.message, self.index = message, index


def content_hash(pixels: bytes, grid: list[int]) -> int:
    """A 63-bit BLAKE2b hash of an image's processed pixels and grid."""
    h = hashlib.blake2b(pixels, digest_size=8, person=b"ferry-img")
    h.update(bytes(str(grid), "ascii"))
    return int.from_bytes(h.digest(), "little") >> 1


def expand_image_tokens(ids: list[int], image_token_id: int, counts: list[int]
                        ) -> tuple[list[int], list[tuple[int, int]]]:
    """``ids`` with the k-th ``image_token_id`` repeated ``counts[k]`` times, and each
    image's ``(offset, length)`` in the result.

    Raises:
        ImageError: the prompt has another number of image tokens than images (index: the
            first image without a token, or -1 for a token without an image).
    """
    out: list[int] = []
    spans = []
    for t in ids:
        if t != image_token_id:
            out.append(t)
            continue
        if len(spans) == len(counts):
            raise ImageError("the prompt has more image tokens than images", -1)
        spans.append((len(out), counts[len(spans)]))
        out.extend([image_token_id] * counts[len(spans) - 1])
    if len(spans) != len(counts):
        raise ImageError(f"the chat template placed {len(spans)} image tokens for "
                         f"{len(counts)} images", len(spans))
    return out, spans


def max_pixels_of(processor: Any) -> int | None:
    """The most pixels Qwen2-VL's family of processors resizes an image to: its
    ``max_pixels``, which transformers 5 keeps as ``size["longest_edge"]`` (a pixel count
    there, beside ``shortest_edge``: ``min_pixels``); None for another kind of processor."""
    value = getattr(processor, "max_pixels", None)
    size = getattr(processor, "size", None)
    if not value and size is not None and getattr(processor, "merge_size", None):
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        value = get("max_pixels") or get("longest_edge")
    return int(value) if isinstance(value, int | float) and value > 0 else None


class ImageProcessor:
    """A model's image processing (module docstring).

    Args:
        processor: transformers' image processor of the model (``AutoImageProcessor``;
            ``pixel_values`` and ``image_grid_thw`` out, ``merge_size`` set).
        image_token_id: the prompt's image-pad token.
    """

    def __init__(self, processor: Any, image_token_id: int):
        self.processor = processor
        self.image_token_id = image_token_id
        self.merge = int(getattr(processor, "merge_size", 1) or 1)
        #: the most pixels the processor resizes an image to (None: not known), so the
        #: decoder need not decode more (``server/media/fetch.py``)
        self.max_pixels = max_pixels_of(processor)

    def process(self, ids: list[int], images: list) -> tuple[list[int], list[ImageData]]:
        """The prompt ``ids`` (one image token per image) and its PIL ``images`` -> the
        expanded ids and the engine's ``ImageData``.

        Raises:
            ImageError: an image the processor rejects, or image tokens that do not match.
        """
        items = []
        for k, img in enumerate(images):
            try:
                out = self.processor(images=[img], return_tensors="pt")
            except Exception as exc:  # noqa: BLE001 - PIL/numpy errors of a strange image
                raise ImageError(f"the image could not be processed: {exc}", k) from None
            pixels = out["pixel_values"].float().contiguous()
            grid = [int(x) for x in out["image_grid_thw"][0].tolist()]
            items.append((pixels, grid))
        counts = [g[0] * (g[1] // self.merge) * (g[2] // self.merge) for _, g in items]
        ids, spans = expand_image_tokens(ids, self.image_token_id, counts)
        data = []
        for (pixels, grid), (offset, length) in zip(items, spans):
            raw = pixels.numpy().astype("<f4").tobytes()
            data.append(ImageData(pixel_values=raw, pixel_shape=list(pixels.shape),
                                  grid_thw=grid, merge=self.merge,
                                  content_hash=content_hash(raw, grid), offset=offset,
                                  length=length))
        return ids, data


def load_image_processor(model_path: str | None) -> ImageProcessor | None:
    """The image processing of the model at ``model_path`` (an HF directory whose
    architecture ferry runs with image input and whose ``preprocessor_config.json``
    transformers' ``AutoImageProcessor`` reads: the PIL processors, no torchvision), or None
    for a text-only model (its image parts are then a 400)."""
    import json
    import logging
    import os

    if not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    from engine.models import MODEL_REGISTRY

    arch = (cfg.get("architectures") or [""])[0]
    if not getattr(MODEL_REGISTRY.get(arch), "accepts_images", False):
        return None
    log = logging.getLogger("ferry.server")
    try:
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - no preprocessor_config.json, no pillow...
        log.warning("%s reads images, but its image processor did not load (%s): image "
                    "parts will be refused", arch, exc)
        return None
    log.info("image input on: %s (%s)", arch, type(proc).__name__)
    return ImageProcessor(proc, int(cfg["image_token_id"]))
