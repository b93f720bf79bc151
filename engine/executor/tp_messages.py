"""The step messages rank 0 sends the tensor-parallel workers (ranks 1..N-1).

The messages travel over a ZMQ PUSH/PULL channel per worker
(``engine.distributed.StepChannel``, msgspec-encoded; rank 0 never waits for a worker to read
them; a gloo broadcast per step, tried first, cost rank 0 about 1.5 ms per step on the H200s):

- ``StepMsg``: run this forward (the batch's host lists: per request its ``req_to_token`` row
  and the new token ids, which may be placeholders for the previous step's sampled ids; the
  prefix and extend lengths; the KV slots; the ``req_to_token`` writes rank 0 made since the
  last step, for cached prefixes; a hybrid model's recurrent-state slots and those that
  start from the zero state, and its prefix cache's state-snapshot copies: those rank 0 made
  since the last step, in order, which a worker makes before the forward, and the takes of
  the step's prefill rows, which it makes right after launching it, as rank 0 does; the
  step's image requests: their images' grids and spans the first time a row carries them,
  and the pixels of every image the step's prefill rows cover, which every rank encodes
  with its own copy of the vision tower: ``engine/executor/tp_images.py``);
- ``IdsMsg(n)``: receive rank 0's ``n`` sampled ids on the device group (they resolve the
  next step's placeholders);
- ``StopMsg``: exit.

Rank 0 sends them from ``RankRunner.forward`` and ``RankRunner.sample``
(``engine/executor/rank_runner.py``), so every caller of the runner (the scheduler, the
benchmarks, ``ferry parity``) drives the workers without knowing they exist; a worker's loop
(``engine/executor/tp_worker.py``) receives them.
"""

from __future__ import annotations

import msgspec

from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardMode


class StepMsg(msgspec.Struct, tag=True, array_like=True):
    """One forward, as rank 0 scheduled it (host lists only)."""

    mode: int
    rows: list[int]              # req_to_token row of each request
    tokens: list[list[int]]      # each request's new token ids (negative: placeholders)
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: list[int]
    num_decodes: int
    all_rows: list[bool]
    has_future: bool             # placeholders refer to the last ids broadcast
    writes: list[tuple[int, int, list[int]]]  # req_to_token writes (row, start, slots)
    lora_slots: list[int] = []   # each request's LoRA slot (empty: none uses an adapter)
    lora_copies: list[tuple[int, int, str, str]] = []  # adapters copied into slots now
    state_slots: list[int] = []  # each request's recurrent-state slot (empty: none kept)
    state_resets: list[int] = []  # slots that start from the zero state in this step
    # state-snapshot copies rank 0 made since the last step, (TAKE | RESTORE, slot, snap) in
    # order (engine/kv/state_snapshots.py): made before the resets and the forward
    snap_copies: list[tuple[int, int, int]] = []
    snap_takes: list[tuple[int, int]] = []  # (slot, snap) right after the forward's launch
    # image requests (engine/executor/tp_images.py): the places of the step's requests with
    # images, the images of those the worker does not hold yet, the pixels of each image
    # the step's prefill rows cover
    mm_reqs: list[int] = []
    mm_new: list[StepImages] = []
    pixels: list[StepPixels] = []
    # a hybrid model's speculative decoding: the verify commits rank 0 made since the last
    # step, as (slots, scratch sources) (``RecurrentStatePool.commit``; made first), and
    # this step's rows per request when it is a verify step (``ScheduleBatch.verify_n``)
    commits: list[tuple[list[int], list[int]]] = []
    verify_n: int = 0


class StepImages(msgspec.Struct, array_like=True):
    """A request's images as a worker keeps them (no pixels): what rebuilds its
    ``engine.mm_inputs.MMInputs``."""

    index: int           # the request's place in the step
    n_tokens: int        # its prompt's length
    bidirectional: bool  # MMInputs.bidirectional
    # per image: (grid (t, h, w), merge, content hash, first token, tokens)
    items: list[tuple[tuple[int, int, int], int, int, int, int]]


class StepPixels(msgspec.Struct, array_like=True):
    """One image's patches, float32 ``shape`` row-major (``ImageItem.pixel_values``)."""

    index: int               # the request's place in the step
    image: int               # the image's index among the request's
    shape: tuple[int, int]
    data: bytes


class IdsMsg(msgspec.Struct, tag=True, array_like=True):
    """Rank 0 broadcasts ``n`` sampled ids on the device group next."""

    n: int


class StopMsg(msgspec.Struct, tag=True, array_like=True):
    """Leave the group and exit."""


TPMessage = StepMsg | IdsMsg | StopMsg


def step_msg(batch: ScheduleBatch, has_future: bool, writes,
             snap_copies: list[tuple[int, int, int]] | None = None,
             images: tuple[list[int], list[StepImages], list[StepPixels]] | None = None,
             commits: list[tuple[list[int], list[int]]] | None = None) -> StepMsg:
    """The ``StepMsg`` of a ``ScheduleBatch`` about to run on rank 0; ``writes``: its
    ``req_to_token`` writes since the last step; ``snap_copies``: its state-snapshot copies
    since the last step (``StateSnapshotPool.take_pending``); ``images``: its image
    requests' fields (``engine.executor.tp_images.ImageSender.fields``), or None;
    ``commits``: its verify commits since the last step."""
    slots, resets = _state_slots(batch)
    return StepMsg(int(batch.mode), [r.req_pool_idx for r in batch.reqs],
                   [r.tokens(p, n) for r, p, n in zip(batch.reqs, batch.prefix_lens,
                                                        batch.extend_lens)],
                   list(batch.prefix_lens), list(batch.extend_lens), list(batch.out_cache_loc),
                   batch.num_decodes, list(batch.all_rows), has_future, writes,
                   list(batch.lora_slots), [tuple(c) for c in batch.lora_copies],
                   slots, resets, list(snap_copies or []),
                   [tuple(t) for t in batch.snap_takes], *(images or ([], [], [])),
                   [(list(a), list(b)) for a, b in commits or ()], batch.verify_n)


def _state_slots(batch: ScheduleBatch) -> tuple[list[int], list[int]]:
    """Each request's recurrent-state slot (a model with linear-attention layers; else
    ``[]``) and the slots whose request starts from token 0 in this step: rank 0 zeroed
    those when it took them (``RecurrentStatePool.alloc``), and a worker zeroes its own
    copy before the forward."""
    slots = [getattr(r, "state_slot", None) or 0 for r in batch.reqs]
    if not any(slots):
        return [], []
    return slots, [s for s, p in zip(slots, batch.prefix_lens) if s and p == 0]


class _StepReq:
    """A worker's stand-in for a ``Req`` (a ``StepRequest``): its row, the ids of the
    step's new tokens and its images (set by ``engine.executor.tp_images.ImageReceiver``)."""

    __slots__ = ("req_pool_idx", "_start", "_ids", "state_slot", "mm")

    def __init__(self, row: int, start: int, ids: list[int], state_slot: int | None = None):
        self.req_pool_idx = row
        self._start = start
        self._ids = ids
        self.state_slot = state_slot
        #: the request's images (``engine.mm_inputs.MMInputs``, the worker's copy), or None
        self.mm = None

    def tokens(self, start: int, count: int) -> list[int]:
        return self._ids[start - self._start: start - self._start + count]

    def token_at(self, pos: int) -> int:
        return self._ids[pos - self._start]


def step_batch(msg: StepMsg) -> ScheduleBatch:
    """A ``ScheduleBatch`` equivalent to rank 0's, built from ``msg``."""
    slots = msg.state_slots or [None] * len(msg.rows)
    reqs = [_StepReq(r, p, ids, s) for r, p, ids, s in zip(msg.rows, msg.prefix_lens,
                                                           msg.tokens, slots)]
    return ScheduleBatch(mode=ForwardMode(msg.mode), reqs=reqs, prefix_lens=msg.prefix_lens,
                         extend_lens=msg.extend_lens, sample=[True] * len(reqs),
                         out_cache_loc=msg.out_cache_loc, all_rows=msg.all_rows,
                         num_decodes=msg.num_decodes, lora_slots=list(msg.lora_slots),
                         lora_copies=[tuple(c) for c in msg.lora_copies],
                         snap_takes=[tuple(t) for t in msg.snap_takes],
                         verify_n=msg.verify_n)
