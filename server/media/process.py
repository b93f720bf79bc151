"""The images of a prompt, processed for the engine: ``ImageProcessor``.

The chat template renders one image-pad token per image (Qwen2.5-VL's
``<|vision_start|><|image_pad|><|vision_end|>``); the model's image processor (transformers'
PIL one, ``Qwen2VLImageProcessorPil``: resize to multiples of ``patch * merge`` pixels
within its pixel bounds, normalise, flatten into patches) gives each image's
``pixel_values`` and ``image_grid_thw``; :func:`expand_image_tokens` repeats each pad token
to the image's token count ``t * (h / merge) * (w / merge)``; and each image becomes an
``engine.io_struct.ImageData`` (float32 bytes, grid, a BLAKE2b hash of the pixels and grid,
its span of prompt tokens), which msgspec carries to the engine. Gemma 3
(:class:`Gemma3ImageProcessor`) expands its image tokens in the rendered text instead, as
its transformers processor does, and sends its square image as the tower's patches.
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

    #: ``expand_text(text) -> text`` on the rendered chat prompt before it is tokenized
    #: (:class:`Gemma3ImageProcessor`'s), or None: the ids are expanded (:meth:`process`)
    expand_text = None
    #: the image marker :attr:`expand_text` replaces (Gemma 3's ``<start_of_image>``), or None
    boi: str | None = None

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


def patchify(image: Any, patch: int) -> tuple[Any, list[int]]:
    """A processed image ``[C, H, W]`` (torch) -> its ``patch x patch`` patches row-major,
    each flattened channel-first, ``[H/p * W/p, C * p * p]``, and the grid ``[1, H/p, W/p]``."""
    c, h, w = image.shape
    rows, cols = h // patch, w // patch
    x = image.reshape(c, rows, patch, cols, patch).permute(1, 3, 0, 2, 4)
    return x.reshape(rows * cols, c * patch * patch).contiguous(), [1, rows, cols]


def image_runs(ids: list[int], token: int, length: int, images: int
               ) -> list[tuple[int, int]]:
    """``(offset, length)`` of each run of ``token`` in ``ids`` (a prompt whose image tokens
    were expanded in text).

    Raises:
        ImageError: a run of another length than ``length``, or another number of runs
            than ``images`` (index: the first image without its tokens, or -1).
    """
    spans = []
    i = 0
    while i < len(ids):
        if ids[i] != token:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == token:
            j += 1
        if j - i != length:
            raise ImageError(f"the prompt has {j - i} image tokens in a row where an image "
                             f"takes {length}", min(len(spans), images - 1) if images else -1)
        spans.append((i, length))
        i = j
    if len(spans) != images:
        raise ImageError(f"the chat template placed {len(spans)} images' tokens for {images} "
                         "images", min(len(spans), images - 1) if len(spans) < images else -1)
    return spans


class Gemma3ImageProcessor(ImageProcessor):
    """Gemma 3's images: the chat template writes ``<start_of_image>`` per image, which
    :meth:`expand_text` replaces in the rendered text as transformers' ``Gemma3Processor``
    does (``"\n\n" + boi + image_token * tokens + eoi + "\n\n"``, so the newlines
    tokenize with their neighbours as in HF); transformers' Gemma 3 image processor (PIL;
    no pan-and-scan) gives the ``[C, S, S]`` image, cut into the tower's patches
    (:func:`patchify`, grid ``(1, S/p, S/p)``, ``merge`` = the projector's pooling kernel).

    Args:
        processor: the image processor (``Gemma3ImageProcessorPil``).
        image_token_id: the image soft token's id; ``texts``: ``(boi, image, eoi)`` token
            strings; ``tokens``: ``mm_tokens_per_image``; ``patch``: the tower's patch size;
            ``merge``: patches per token side (``image_size / patch / sqrt(tokens)``).
    """

    def __init__(self, processor: Any, image_token_id: int, texts: tuple[str, str, str],
                 tokens: int, patch: int, merge: int):
        super().__init__(processor, image_token_id)
        boi, image, eoi = texts
        self.boi, self.tokens, self.patch, self.merge = boi, tokens, patch, merge
        self.sequence = f"\n\n{boi}{image * tokens}{eoi}\n\n"

    def expand_text(self, text: str) -> str:
        """The prompt text with each ``<start_of_image>`` replaced by the image's sequence."""
        return text.replace(self.boi, self.sequence)

    def process(self, ids: list[int], images: list) -> tuple[list[int], list[ImageData]]:
        """The expanded prompt ``ids`` and its PIL ``images`` -> the ids and the engine's
        ``ImageData``.

        Raises:
            ImageError: an image the processor rejects, or image tokens that do not match.
        """
        spans = image_runs(ids, self.image_token_id, self.tokens, len(images))
        data = []
        for k, (img, (offset, length)) in enumerate(zip(images, spans)):
            try:
                out = self.processor(images=[img], return_tensors="pt")
            except Exception as exc:  # noqa: BLE001 - PIL/numpy errors of a strange image
                raise ImageError(f"the image could not be processed: {exc}", k) from None
            pixels, grid = patchify(out["pixel_values"][0].float(), self.patch)
            raw = pixels.numpy().astype("<f4").tobytes()
            data.append(ImageData(pixel_values=raw, pixel_shape=list(pixels.shape),
                                  grid_thw=grid, merge=self.merge,
                                  content_hash=content_hash(raw, grid), offset=offset,
                                  length=length))
        return ids, data


def _gemma3_processor(model_path: str, cfg: dict, proc: Any, log) -> ImageProcessor | None:
    """Gemma 3's :class:`Gemma3ImageProcessor`, or None (logged) for a processor
    configured with pan-and-scan, which ferry does not support."""
    if getattr(proc, "do_pan_and_scan", False):
        log.warning("Gemma3ForConditionalGeneration: the image processor has do_pan_and_scan "
                    "on, which ferry does not support: image parts will be refused (turn it "
                    "off in preprocessor_config.json)")
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    ids = [int(cfg.get("boi_token_index", 255999)), int(cfg.get("image_token_index", 262144)),
           int(cfg.get("eoi_token_index", 256000))]
    texts = tuple(tok.convert_ids_to_tokens(ids))
    vision = cfg.get("vision_config") or {}
    patch, size = int(vision.get("patch_size", 14)), int(vision.get("image_size", 896))
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    merge = max(1, size // patch // int(round(tokens ** 0.5)))
    return Gemma3ImageProcessor(proc, ids[1], texts, tokens, patch, merge)


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
    if cfg.get("model_type") == "gemma3":
        images = _gemma3_processor(model_path, cfg, proc, log)
    else:
        images = ImageProcessor(proc, int(cfg["image_token_id"]))
    if images is not None:
        log.info("image input on: %s (%s)", arch, type(proc).__name__)
    return images
