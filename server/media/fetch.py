"""Reading the images of a request: ``load_image`` (a URL -> a decoded RGB PIL image).

Sources, each refused unless the server allows it:

- ``data:image/...;base64,...``: always (the image travels in the body, whose size
  ``--max-request-bytes`` bounds);
- ``file://`` paths: only under ``--allowed-local-media-path`` (resolved, so ``..`` and
  links cannot leave it);
- ``http(s)://``: only when ``--allowed-media-domains`` lists the host (or ``*``), fetched
  with httpx within ``--media-fetch-timeout`` seconds, no redirects, at most
  ``--max-image-bytes`` bytes (streamed: a larger body is cut off, not read).

Every image is at most ``--max-image-bytes`` encoded and ``--max-image-pixels`` decoded
(checked from the header before the pixels are decoded; a JPEG decodes at a reduced scale
when the model's processor would downsize it anyway: ``decode_image``), and decoded fully
here, so a
truncated or corrupt file is the client's 400 (naming the part, e.g.
``messages[1].content[0].image_url``) and never a 500 later.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import urllib.parse
from dataclasses import dataclass

from server.http.errors import APIError, bad_request


@dataclass(frozen=True)
class MediaLimits:
    """Where images may come from and how big they may be (the server's flags)."""

    local_path: str | None = None
    domains: tuple[str, ...] = ()
    max_bytes: int = 20 << 20
    max_pixels: int = 4096 * 4096  # Qwen3-VL's processor resizes to at most this
    timeout: float = 10.0
    max_images: int = 4

    @classmethod
    def from_args(cls, args) -> MediaLimits:
        """The limits of a ``ServerArgs``."""
        from engine.args import image_limit

        d = cls()
        return cls(getattr(args, "allowed_local_media_path", None),
                   tuple(getattr(args, "allowed_media_domains", None) or ()),
                   getattr(args, "max_image_bytes", d.max_bytes),
                   getattr(args, "max_image_pixels", d.max_pixels),
                   getattr(args, "media_fetch_timeout", d.timeout),
                   image_limit(getattr(args, "limit_mm_per_prompt", "image=4")))


def _data_url(url: str, where: str, limits: MediaLimits) -> bytes:
    head, sep, payload = url.partition(",")
    head = head.lower()  # RFC 2397: the scheme and the media type are case-insensitive
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise bad_request("a data URL image must be data:image/<type>;base64,<data>", where)
    # base64 as tools write it: wrapped lines (RFC 2045) and, at times, without its padding
    payload = "".join(payload.split())
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise bad_request(f"the image is larger than {limits.max_bytes} bytes", where)
    payload += "=" * (-len(payload) % 4)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data URL's base64 payload is malformed", where) from None


def _local_file(url: str, where: str, limits: MediaLimits) -> bytes:
    if not limits.local_path:
        raise bad_request("file:// image URLs are not allowed on this server (start it with "
                          "--allowed-local-media-path)", where)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise bad_request("a file:// image URL must name a local path", where)
    raw = urllib.parse.unquote(parsed.path)
    if "\x00" in raw:
        raise bad_request("a file:// image path may not hold a NUL byte", where)
    root = os.path.realpath(limits.local_path)
    path = os.path.realpath(raw)
    if os.path.commonpath([root, path]) != root:
        raise bad_request("the file:// image is outside --allowed-local-media-path", where)
    try:
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise bad_request(f"the image is larger than {limits.max_bytes} bytes", where)
        with open(path, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError:
        raise bad_request("the file:// image could not be read", where) from None


def _host_allowed(host: str, domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(d == "*" or host == d.lower().rstrip(".") for d in domains)


async def _http(url: str, where: str, limits: MediaLimits) -> bytes:
    import httpx

    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        # urllib drops tabs and newlines before the host check; httpx refuses them
        raise bad_request("an image URL may not hold spaces or control characters", where)
    try:
        parsed = urllib.parse.urlparse(url)
        host, _ = parsed.hostname or "", parsed.port  # .port raises on a bad port
    except ValueError:
        raise bad_request("the image URL is malformed (host or port)", where) from None
    if not _host_allowed(host, limits.domains):
        raise bad_request(f"image URLs of host {host!r} are not allowed on this server "
                          "(--allowed-media-domains)", where)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.timeout), httpx.AsyncClient(
                timeout=limits.timeout, follow_redirects=False) as client, \
                client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise bad_request(f"fetching the image answered HTTP {resp.status_code}", where)
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise bad_request(f"the image is larger than {limits.max_bytes} bytes",
                                      where)
    except (TimeoutError, httpx.TimeoutException):
        raise bad_request(f"fetching the image took longer than {limits.timeout:g} s",
                          where) from None
    except (httpx.HTTPError, httpx.InvalidURL, OverflowError, ValueError, OSError) as exc:
        raise bad_request(f"the image could not be fetched ({type(exc).__name__})",
                          where) from None
    except ExceptionGroup as group:  # anyio's connect wraps errors (a port out of range)
        ours = [e for e in group.exceptions if isinstance(e, APIError)]
        if ours:
            raise ours[0] from None
        raise bad_request(f"the image could not be fetched "
                          f"({type(group.exceptions[0]).__name__})", where) from None
    return bytes(body)


def _jpeg_scale(w: int, h: int, target: int | None, cap: int) -> int:
    """The JPEG decoding reduction (1, 2, 4 or 8) for a ``w`` x ``h`` image: the largest
    that keeps at least ``target`` pixels (the processor downsizes to that anyway), then
    doubled while the result is over ``cap``."""
    s = next((s for s in (8, 4, 2) if target and (w // s) * (h // s) >= target), 1)
    while s < 8 and -(-w // s) * -(-h // s) > cap:
        s *= 2
    return s


def decode_image(data: bytes, where: str, limits: MediaLimits, target_pixels: int | None = None):
    """Encoded image bytes -> an RGB PIL image, fully decoded, no bigger than needed.

    The pixel count is read from the header before any pixel is decoded. A JPEG larger than
    ``target_pixels`` (the most the model's processor resizes to) or than the limit is
    decoded at a reduced scale (PIL's ``draft``: DCT scaling, 1/2 to 1/8, at the largest
    reduction still meeting the target), so its decoded size is what counts against the
    limit; another format is decoded whole (its header size counts), then box-reduced by
    an integer factor while it stays at least ``target_pixels``.

    Raises:
        APIError: 400 naming ``where`` for too many bytes or (decoded) pixels, or data PIL
            cannot decode."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise bad_request(f"the image is larger than {limits.max_bytes} bytes", where)
    try:
        # ferry's pixel limit, not PIL's decompression-bomb guess, decides (checked below
        # from the header, before any pixel is decoded)
        Image.MAX_IMAGE_PIXELS = None
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if img.format == "JPEG":
            s = _jpeg_scale(w, h, target_pixels, limits.max_pixels)
            if s > 1:
                img.draft("RGB", (w // s, h // s))
        dw, dh = img.size
        if dw * dh > limits.max_pixels:
            raise bad_request(f"the image has {w}x{h} pixels; at most {limits.max_pixels} "
                              "are allowed (--max-image-pixels)", where)
        img.load()
        img = img if img.mode == "RGB" else img.convert("RGB")  # convert copies even RGB
        f = int((dw * dh / target_pixels) ** 0.5) if target_pixels else 1
        return img.reduce(f) if f >= 2 else img
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError,
            SyntaxError):
        raise bad_request("the image could not be decoded (expected PNG, JPEG, GIF, WebP "
                          "or another format PIL reads)", where) from None


async def load_image(url: str, where: str, limits: MediaLimits,
                     target_pixels: int | None = None):
    """The RGB PIL image at ``url`` (module docstring for the sources and limits).

    Args:
        url: a ``data:``, ``file://`` or ``http(s)://`` URL.
        where: the request part to name in errors (``messages[1].content[0].image_url``).
        limits: the server's :class:`MediaLimits`.
        target_pixels: the most pixels the model's processor resizes an image to (None:
            not known): ``decode_image`` decodes no more than it needs.
    Raises:
        APIError: 400 naming ``where`` for a source the server does not allow, a fetch that
            fails, or an image that is too big or does not decode.
    """
    if not isinstance(url, str) or not url:
        raise bad_request("an image needs a URL string", where)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        data = _data_url(url, where, limits)
    elif scheme == "file":
        data = await asyncio.to_thread(_local_file, url, where, limits)
    elif scheme in ("http", "https"):
        data = await _http(url, where, limits)
    else:
        raise bad_request("an image URL must be a data:, file:// or http(s):// URL", where)
    kw = {} if target_pixels is None else {"target_pixels": target_pixels}
    return await asyncio.to_thread(decode_image, data, where, limits, **kw)
