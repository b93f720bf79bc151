"""A request's images inside the engine: ``ImageItem`` (one image's pixels, grid, content
hash and place in the prompt) and ``MMInputs`` (a request's images, its M-RoPE positions and
the vision embeddings kept between prefill chunks).

The server (``server/media/``) runs the image processor and sends, per image, the pixel
patches as float32 bytes, the patch grid ``(t, h, w)``, the spatial merge factor, a 64-bit
hash of the content and the span of the prompt's image tokens that the image's embeddings
fill (``engine/io_struct.py``'s ``ImageData``). This module turns them into tensors, checks
them, and derives what the scheduler and the model read:

- the prefix-cache key (:func:`key_ids`): the prompt with every image token replaced by a
  value derived from its image's hash (:func:`pad_value`, at or above ``2**40``, beyond any
  vocabulary), so the radix tree shares KV between equal images and never between different
  ones, whatever the surrounding text; the ids the model embeds stay the real ones;
- for a model whose language model attends bidirectionally within an image (Gemma 3,
  ``MMInputs.bidirectional``): where a prefill chunk may end (:meth:`MMInputs.image_cut`:
  never inside an image) and each extend row's key limit (:func:`key_limits`: an image
  token sees its whole image);
- the 3D (temporal, height, width) positions of multimodal RoPE (:func:`mrope_positions`):
  text tokens count on from the last position, an image's tokens take ``start + (0, row,
  col)`` over its merged grid and the next text starts at ``start + max(rows, cols)``; the
  decode positions are ``position + delta`` (``delta = max + 1 - prompt length``).

It sits at the bottom of engine/ (beside ``forward_batch``): the scheduler's ``Req``, the
forward-batch builder and the models read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: the first value an image token takes in the prefix-cache key (above any vocabulary)
PAD_BASE = 1 << 40
#: values per image hash in the key: ``PAD_BASE + hash % PAD_SPAN``
PAD_SPAN = 1 << 40


def pad_value(content_hash: int) -> int:
    """The prefix-cache key value of every token of an image with ``content_hash`` (int)."""
    return PAD_BASE + content_hash % PAD_SPAN


@dataclass
class ImageItem:
    """One image of a request.

    Attributes:
        pixel_values: ``[patches, C * temporal_patch * patch * patch]`` float32 (CPU) the
            image processor's flattened patches (``patches = t * h * w``; Gemma 3's:
            ``C * patch * patch`` wide, row-major).
        grid_thw: the patch grid ``(t, h, w)``.
        merge: the spatial merge factor (each ``merge x merge`` patches make one token;
            Gemma 3: its average pooling).
        content_hash: a 64-bit hash of the pixels and grid (equal images, equal hashes).
        offset: index of the image's first token in the prompt.
        length: its tokens, ``t * (h / merge) * (w / merge)``.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    merge: int
    content_hash: int
    offset: int
    length: int

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """The merged grid ``(t, h / merge, w / merge)`` of the image's tokens."""
        t, h, w = self.grid_thw
        return t, h // self.merge, w // self.merge

    @property
    def end(self) -> int:
        """One past the image's last token in the prompt."""
        return self.offset + self.length


@dataclass
class MMInputs:
    """A request's images and what the engine derives from them (module docstring).

    Attributes:
        items: the images, in prompt order, their spans disjoint.
        positions: ``[3, prompt length]`` int64 (CPU) M-RoPE positions of the prompt.
        delta: ``positions.max() + 1 - prompt length`` (<= 0): a generated token at sequence
            position ``p`` has M-RoPE position ``p + delta`` on all three axes.
        embeds: image index -> its vision embeddings ``[length, hidden]`` on the model's
            device, from the prefill chunk that first needs them until the chunk that
            prefills the image's last token (chunked prefill never recomputes part of an
            image; :meth:`drop_done`).
    """

    items: list[ImageItem]
    positions: torch.Tensor
    delta: int
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    #: whether the language model attends bidirectionally among one image's tokens (Gemma
    #: 3): each image's tokens then go to one prefill chunk (``image_cut``) and the extend
    #: step gets per-row key limits (:func:`key_limits`)
    bidirectional: bool = False

    def image_cut(self, start: int, end: int) -> int:
        """Where a prefill chunk ``[start, end)`` of a bidirectional request may end: ``end``
        when no image's span crosses it, else the start of the crossed image, or (the chunk
        starts inside or at that image: it cannot end before it) the image's end, which may
        run past ``end``. A request without bidirectional images: ``end``."""
        if not self.bidirectional:
            return end
        for it in self.items:
            if it.offset < end < it.end:
                return it.offset if it.offset > start else it.end
        return end

    def drop_done(self, upto: int) -> None:
        """Forget the embeddings of the images whose tokens all lie before ``upto``."""
        for i in [i for i in self.embeds if self.items[i].end <= upto]:
            del self.embeds[i]


def mrope_positions(n_tokens: int, items: list[ImageItem]) -> tuple[torch.Tensor, int]:
    """The M-RoPE positions ``[3, n_tokens]`` int64 of a prompt with ``items`` (in order,
    disjoint spans), and its ``delta`` (see :class:`MMInputs`)."""
    pos = torch.empty(3, n_tokens, dtype=torch.int64)
    cur = 0   # the next text position
    at = 0    # the next prompt index
    for it in items:
        if it.offset > at:
            pos[:, at:it.offset] = torch.arange(cur, cur + it.offset - at)
            cur += it.offset - at
        t, h, w = it.token_grid
        tt = torch.arange(t).view(t, 1, 1).expand(t, h, w)
        hh = torch.arange(h).view(1, h, 1).expand(t, h, w)
        ww = torch.arange(w).view(1, 1, w).expand(t, h, w)
        pos[:, it.offset:it.end] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur += max(h, w)
        at = it.end
    if n_tokens > at:
        pos[:, at:] = torch.arange(cur, cur + n_tokens - at)
    delta = int(pos.max()) + 1 - n_tokens if n_tokens else 0
    return pos, delta


def key_ids(input_ids: list[int], items: list[ImageItem]) -> list[int]:
    """``input_ids`` with each image's tokens replaced by its :func:`pad_value`: the prompt
    as the prefix cache keys it."""
    out = list(input_ids)
    for it in items:
        out[it.offset:it.end] = [pad_value(it.content_hash)] * it.length
    return out


def build_mm_inputs(images, n_tokens: int) -> MMInputs:
    """``MMInputs`` from the wire form (``engine.io_struct.ImageData``: ``pixel_values``
    bytes, ``pixel_shape``, ``grid_thw``, ``merge``, ``content_hash``, ``offset``,
    ``length``), checked against a prompt of ``n_tokens`` tokens.

    Raises:
        ValueError: (param ``images``) a pixel buffer of the wrong size, a grid that does not
            match the patches or the merge, a span outside the prompt or overlapping
            another, a token count that is not the merged grid's.
    """
    items = []
    at = 0
    for i, im in enumerate(images):
        shape = tuple(int(x) for x in im.pixel_shape)
        t, h, w = (int(x) for x in im.grid_thw)
        merge = int(im.merge)
        if len(shape) != 2 or len(im.pixel_values) != 4 * shape[0] * shape[1]:
            raise ValueError(f"images[{i}]: {len(im.pixel_values)} bytes of pixels for a "
                             f"float32 shape {shape}", "images")
        if merge < 1 or t * h * w != shape[0] or h % merge or w % merge:
            raise ValueError(f"images[{i}]: grid {(t, h, w)} (merge {merge}) does not match "
                             f"{shape[0]} patches", "images")
        length = t * (h // merge) * (w // merge)
        if im.length != length or im.offset < at or im.offset + length > n_tokens:
            raise ValueError(f"images[{i}]: tokens [{im.offset}, {im.offset + im.length}) "
                             f"are not {length} tokens inside the {n_tokens}-token prompt "
                             "after the previous image", "images")
        pixels = torch.frombuffer(bytearray(im.pixel_values), dtype=torch.float32)
        items.append(ImageItem(pixels.view(shape), (t, h, w), merge,
                               int(im.content_hash), int(im.offset), length))
        at = im.offset + length
    pos, delta = mrope_positions(n_tokens, items)
    return MMInputs(items, pos, delta)


def key_limits(segments, starts: list[int], lens: list[int]) -> list[int] | None:
    """Per extend row of a step, the new keys of its request that its query sees: ``i + 1``
    for new token ``i`` (causal), the end of its image span (counted in the request's new
    tokens) for a token of an image of a bidirectional request; None when no such image is
    in the step (the attention stays causal: the kernels' plain path).

    Args:
        segments: ``ForwardBatch.mm_segments`` (``(MMInputs, prefix, new tokens, first
            row)``), or None.
        starts, lens: the extend requests' first rows and new tokens (not the decode tail).
    """
    spans = []
    for mm, p, n, row in segments or ():
        if mm.bidirectional:
            for it in mm.items:
                lo, hi = max(p, it.offset), min(p + n, it.end)
                if lo < hi:
                    spans.append((row + lo - p, row + hi - p, hi - p))
    if not spans:
        return None
    out = [0] * (starts[-1] + lens[-1] if starts else 0)
    for s0, n in zip(starts, lens):
        out[s0:s0 + n] = range(1, n + 1)
    for r0, r1, limit in spans:
        out[r0:r1] = [limit] * (r1 - r0)
    return out
