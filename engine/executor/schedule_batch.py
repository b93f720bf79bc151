"""``ScheduleBatch``: the host-side batch of one step (a list of requests plus what each does).

The scheduler builds it after allocating KV slots; the model runner turns it into a
``ForwardBatch`` of device tensors. It is the executor's input, so it lives here, below the
scheduler: the runner reads a request only through :class:`StepRequest`, which the
scheduler's ``Req`` (``engine/scheduler/request.py``) and the tensor-parallel workers'
stand-ins (``engine/executor/tp_messages.py``) both provide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.forward_batch import ForwardMode


class StepRequest(Protocol):
    """What the model runner reads of a request: its ``req_to_token`` row and token ids."""

    req_pool_idx: int

    def tokens(self, start: int, count: int) -> list[int]:
        """The token ids at positions ``[start, start + count)``."""
        ...

    def token_at(self, pos: int) -> int:
        """The token id at position ``pos``."""
        ...


class PadRow:
    """A padding row of a hybrid model's verify step (every request has ``verify_n`` rows;
    :func:`padded_verify_batch`): ``req_to_token`` row 0,
    position 0, KV slot 0 and state slot 0, the padding sinks a graph's padding rows use;
    token 0. Its logits are dropped."""

    __slots__ = ()
    req_pool_idx = 0
    state_slot = 0
    mm = None

    def token_at(self, pos: int) -> int:
        return 0

    def tokens(self, start: int, count: int) -> list[int]:
        return [0] * count


@dataclass
class ScheduleBatch:
    """One step's work.

    For EXTEND, request i computes ``extend_lens[i]`` new tokens starting at position
    ``prefix_lens[i]`` (= its ``kv_len`` before the step); a decode request inside a mixed
    batch is an extend of length 1. ``sample[i]`` is False for a prefill chunk that does not
    reach the end of the request's tokens (chunked prefill): its logits are not sampled.
    ``out_cache_loc`` holds the pool slot of every new token, in batch order.
    """

    mode: ForwardMode
    reqs: list[StepRequest]  # the scheduler's Req objects
    prefix_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]
    out_cache_loc: list[int] = field(default_factory=list)
    # per request: return logits for every new token (prompt logprobs), not just the last
    all_rows: list[bool] = field(default_factory=list)
    # EXTEND only: the last ``num_decodes`` requests are running decodes mixed into the step
    # (one token each); attention runs them through the decode kernel
    num_decodes: int = 0
    # LoRA (engine/lora/): each request's adapter slot (-1 the base model; empty: no request
    # uses an adapter), and the adapters rank 0 copied into slots for this step, as
    # ``(slot, id, name, path)`` (the tensor-parallel workers repeat the copies); set by the
    # model runner
    lora_slots: list[int] = field(default_factory=list)
    lora_copies: list[tuple] = field(default_factory=list)
    # a speculative verify step of a model with linear-attention layers: a DECODE batch of
    # ``verify_n`` rows a request (its last token, its drafts, padding rows after them);
    # the layers leave each request's state as it was and keep the state after each row in
    # the pool's scratch slots; the runner's ``commit_verify`` then copies the one after the
    # last accepted token (0: not such a step)
    verify_n: int = 0
    # a hybrid model's prefix cache: ``(state slot, snapshot)`` copies of the prefill rows'
    # states, which the model runner makes right after launching the forward (set by the
    # scheduler; ``engine/kv/state_snapshots.py``)
    snap_takes: list[tuple[int, int]] = field(default_factory=list)

    def logits_rows(self) -> list[tuple[int, int]]:
        """Per request, ``(first row, row count)`` in the step's logits."""
        out, r = [], 0
        for i, n in enumerate(self.extend_lens):
            k = n if (self.all_rows and self.all_rows[i]) else 1
            out.append((r, k))
            r += k
        return out

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


def padded_verify_batch(reqs: list, prefix: list[int], ext: list[int], locs: list[int],
                        n: int) -> tuple[ScheduleBatch, list[int]]:
    """A hybrid model's verify step (``engine/speculative/worker.py``; the start-up graph
    check's too): the speculative worker's ``verify_batch`` DECODE rows, each request's
    ``ext[i]`` rows followed by ``n - ext[i]`` :class:`PadRow` rows (KV slot 0), so every
    request has ``n`` rows (``ScheduleBatch.verify_n``: the linear layers' verify mode).
    Returns the batch and the indices of its requests' own rows, in order."""
    rows, pos, out, own, pad = [], [], [], [], PadRow()
    it = iter(locs)
    for r, p, e in zip(reqs, prefix, ext):
        if not 1 <= e <= n:  # the rows of every request after it would shift
            raise ValueError(f"a verify step of {n} rows a request got {e} for one")
        own.extend(range(len(rows), len(rows) + e))
        rows += [r] * e + [pad] * (n - e)
        pos += [p + j for j in range(e)] + [0] * (n - e)
        out += [next(it) for _ in range(e)] + [0] * (n - e)
    return ScheduleBatch(ForwardMode.DECODE, rows, pos, [1] * len(rows), [True] * len(rows),
                         out, verify_n=n), own
