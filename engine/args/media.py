"""Image input's flags (``server/media/``): where images may come from and how big they may
be; ``ServerArgs`` takes them flat (``engine/args/fields.py``'s ``take_fields``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.args.fields import flag


@dataclass(frozen=True)
class MediaArgs:
    """The image-input group of ``ServerArgs`` (its fields' ``help`` is the flags')."""

    allowed_local_media_path: str | None = flag(
        None, "directory under which file:// image URLs may be read (default: none may)")
    allowed_media_domains: tuple[str, ...] | None = flag(
        None, "host names whose http(s) image URLs the server may fetch (default: none; "
              "'*' for any)")
    limit_mm_per_prompt: str = flag("image=4", "most images per prompt, as image=N (or JSON "
                                               "{\"image\": N})")
    max_image_bytes: int = flag(20 << 20, "most bytes of one image (encoded, as sent or "
                                          "fetched)", ge=1)
    max_image_pixels: int = flag(4096 * 4096, "most pixels (width x height) of one decoded "
                                              "image (a JPEG decodes at a reduced scale when "
                                              "the model's processor downsizes it anyway)",
                                 ge=1)
    media_fetch_timeout: float = flag(10.0, "seconds an http(s) image may take to download",
                                      gt=0)


def image_limit(spec: str) -> int:
    """The images per prompt that ``--limit-mm-per-prompt`` allows (``image=N`` or JSON
    ``{"image": N}``; other modalities are refused).

    Raises:
        ValueError: a malformed value, another modality, a negative count."""
    spec = spec.strip()
    try:
        pairs = json.loads(spec) if spec.startswith("{") else dict(
            (k.strip(), int(v)) for k, v in (p.split("=", 1) for p in spec.split(",") if p))
    except (ValueError, TypeError):
        raise ValueError(f"must be image=N or {{\"image\": N}}, got {spec!r}") from None
    if not isinstance(pairs, dict) or set(pairs) - {"image"} or \
            not all(isinstance(v, int) and v >= 0 for v in pairs.values()):
        raise ValueError(f"takes image=N (N >= 0; only images are read), got {spec!r}")
    return int(pairs.get("image", 0))


def media_error(a) -> str | None:
    """What is wrong with the image flags of ``a`` (a ``ServerArgs``), or None."""
    try:
        image_limit(a.limit_mm_per_prompt)
    except ValueError as exc:
        return f"--limit-mm-per-prompt {exc}"
    return None
