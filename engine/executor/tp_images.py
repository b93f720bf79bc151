"""Image requests under tensor parallelism: what rank 0 sends the workers, what they keep.

Design: the vision tower is replicated (every rank loads it whole: it is ~0.4-1 B
parameters, ``ReplicatedLinear`` layers, beside a language model of 7 B and more, and
sharding it would add two all-reduces per tower block and image for little memory back),
and the language model is split as for text. Each rank encodes the images of its steps
itself: the models' ``inject`` hooks (``engine/models/qwen2_5_vl.py``,
``engine/models/gemma3_vl.py``) run on every rank from the step's
``ForwardBatch.mm_segments``, so no rank waits for another's embeddings and the residual
stream stays identical on every rank.

A worker therefore needs each image request's ``MMInputs`` (``engine/mm_inputs.py``): the
grids and spans (for its M-RoPE positions, its decode ``delta``, Gemma 3's key limits) and,
in the steps that prefill an image's tokens, its pixels. Rank 0's :class:`ImageSender`
adds to every ``StepMsg`` (``engine/executor/tp_messages.py``):

- ``mm_reqs``: the places of the step's requests with images;
- ``mm_new``: a request's images without pixels (``StepImages``), the first time its
  ``req_to_token`` row carries that ``MMInputs`` (rank 0 remembers, per row, the last one
  sent, by identity; a worker keeps, per row, the last one received: the two agree);
- ``pixels``: the patches of every image that a prefill row of the step covers
  (``StepPixels``, float32 bytes), each time: a worker encodes an image whose embeddings it
  does not hold (an image cut by a chunk boundary is encoded once, by the first chunk, and
  its pixels sent again with the next: simple and always right, whatever the preemptions
  and prefix hits did to rank 0's kept embeddings). The worker drops them after the
  forward.

The worker's :class:`ImageReceiver` rebuilds the ``MMInputs`` and hangs them on its
stand-in requests before the forward, so ``build_forward_batch`` makes the same M-RoPE
positions and segments as rank 0's, and the graph replay is skipped on every rank alike.
"""

from __future__ import annotations

import weakref

import torch

from engine.executor.schedule_batch import ScheduleBatch
from engine.executor.tp_messages import StepImages, StepMsg, StepPixels
from engine.forward_batch import ForwardMode
from engine.mm_inputs import ImageItem, MMInputs, mrope_positions

#: an image's pixels on a worker outside the steps that need them
_NO_PIXELS = torch.empty(0, 0)


class ImageSender:
    """Rank 0's side: the image fields of each step's ``StepMsg`` (module docstring)."""

    def __init__(self):
        # req_to_token row -> the MMInputs last sent for it (weak: the Req owns it)
        self._sent: dict[int, weakref.ref] = {}

    def fields(self, batch: ScheduleBatch
               ) -> tuple[list[int], list[StepImages], list[StepPixels]] | None:
        """``(mm_reqs, mm_new, pixels)`` of ``batch``, or None when no request has images."""
        if not any(getattr(r, "mm", None) is not None for r in batch.reqs):
            return None
        places: list[int] = []
        new: list[StepImages] = []
        pixels: list[StepPixels] = []
        extend = batch.mode == ForwardMode.EXTEND
        for i, (req, p, n) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
            mm = getattr(req, "mm", None)
            if mm is None:
                continue
            places.append(i)
            ref = self._sent.get(req.req_pool_idx)
            if ref is None or ref() is not mm:
                self._sent[req.req_pool_idx] = weakref.ref(mm)
                new.append(StepImages(i, int(mm.positions.shape[1]), mm.bidirectional, [
                    (tuple(it.grid_thw), it.merge, it.content_hash, it.offset, it.length)
                    for it in mm.items]))
            if not extend:
                continue
            for j, it in enumerate(mm.items):
                if it.offset < p + n and it.end > p:
                    pv = it.pixel_values.contiguous()
                    pixels.append(StepPixels(i, j, tuple(pv.shape),
                                             memoryview(pv.numpy()).cast("B")))
        return places, new, pixels


class ImageReceiver:
    """A worker's side: the ``MMInputs`` of its rows (module docstring)."""

    def __init__(self):
        #: req_to_token row -> the MMInputs last received for it
        self.by_row: dict[int, MMInputs] = {}

    def attach(self, msg: StepMsg, batch: ScheduleBatch) -> None:
        """Before the forward of ``msg``: keep its new images, set the pixels it carries,
        and give each image request of ``batch`` (the stand-ins of ``step_batch(msg)``)
        its ``mm``."""
        for s in msg.mm_new:
            items = [ImageItem(_NO_PIXELS, tuple(grid), merge, h, off, length)
                     for grid, merge, h, off, length in s.items]
            pos, delta = mrope_positions(s.n_tokens, items)
            self.by_row[msg.rows[s.index]] = MMInputs(items, pos, delta,
                                                      bidirectional=s.bidirectional)
        for px in msg.pixels:
            item = self.by_row[msg.rows[px.index]].items[px.image]
            item.pixel_values = torch.frombuffer(bytearray(px.data),
                                                 dtype=torch.float32).view(tuple(px.shape))
        for i in msg.mm_reqs:
            batch.reqs[i].mm = self.by_row[msg.rows[i]]

    def release(self, msg: StepMsg) -> None:
        """After the forward of ``msg``: drop the pixels it carried (encoded by now)."""
        for px in msg.pixels:
            self.by_row[msg.rows[px.index]].items[px.image].pixel_values = _NO_PIXELS
