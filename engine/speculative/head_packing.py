"""The host side of an EAGLE head's graph rounds (``engine/speculative/head_graphs.py``):
the positions, ``seq_lens``, slots and ``req_to_token`` entries of a catch-up's rows and of a
chain's steps, packed as python lists (a few us; torch ops per entry cost ~100x that) that
the runner writes into its pinned host buffer and copies to the device in one copy.

Layout of one row (a catch-up row, or a request's chain step): the six fields ``ID`` (the
input id), ``POS`` (the rotary position ``base + c``), ``ROW`` (the ``req_to_token`` row),
``LOC`` (the pool slot), ``LEN`` (the head's ``seq_len`` ``c + 1``) and ``KV`` (the
``req_to_token`` column ``c``), each a row of ``width`` entries. A padding entry is
``(0, 0, 0, 0, 1, 0)``: ``req_to_token`` row 0 and slot 0 (the padding sink), one token.
"""

from __future__ import annotations

import torch

#: the fields of a packed step (the rows of :func:`pack_chain`'s and :func:`pack_rows`'s)
ID, POS, ROW, LOC, LEN, KV = range(6)


def _pad(width: int, steps: int = 1) -> list[int]:
    return ([0] * (LEN * width) + [1] * width + [0] * width) * steps


def chain_flat(rows: list[tuple[int, int, int, list[int], int]], steps: int,
               width: int) -> list[int]:
    """:func:`pack_chain` as a flat python list (``steps * 6 * width`` ints)."""
    if len(rows) > width or any(len(r[3]) > steps for r in rows):
        raise ValueError(f"{len(rows)} rows for a batch of {width}, or more slots than the "
                         f"chain's {steps} steps")
    flat = _pad(width, steps)
    for j, (row, base, start, slots, first) in enumerate(rows):
        if slots:
            flat[ID * width + j] = first
        for s, loc in enumerate(slots):
            o, c = s * 6 * width + j, start + s
            for f, v in ((POS, base + c), (ROW, row), (LOC, loc), (LEN, c + 1), (KV, c)):
                flat[o + f * width] = v
    return flat


def rows_flat(reqs: list[tuple[int, int, int, list[int], list[int]]], width: int,
              nlast: int) -> tuple[list[int], list[int]]:
    """:func:`pack_rows` as flat python lists (``6 * width`` and ``nlast`` ints)."""
    n = sum(len(r[4]) for r in reqs)
    if n > width or len(reqs) > nlast or any(len(r[3]) != len(r[4]) for r in reqs):
        raise ValueError(f"{n} rows of {len(reqs)} requests for {width} rows and {nlast} "
                         "requests, or slots and ids of different lengths")
    flat, last, off = _pad(width), [0] * nlast, 0
    for j, (row, base, start, slots, ids) in enumerate(reqs):
        for t, (loc, tok) in enumerate(zip(slots, ids)):
            o, c = off + t, start + t
            for f, v in ((ID, tok), (POS, base + c), (ROW, row), (LOC, loc), (LEN, c + 1),
                         (KV, c)):
                flat[o + f * width] = v
        off += len(ids)
        last[j] = off - 1
    return flat, last


def pack_chain(rows: list[tuple[int, int, int, list[int], int]], steps: int,
               gbs: int) -> torch.Tensor:
    """The host side of a chain of ``steps`` head DECODE steps over a batch padded to ``gbs``.

    Args:
        rows: per request ``(req_pool_idx, base, kv_start, slots, first_id)``: its draft
            ``req_to_token`` row, ``DraftSeq.base``, its KV length before the chain, the pool
            slots of its steps (``len(slots) <= steps``: it runs that many), the input id of
            its first step.
        steps: the chain's length; gbs: the padded batch size (``>= len(rows)``).
    Returns:
        int64 ``[steps, 6, gbs]``; row ``r`` of step ``s`` holds at ``[s, :, r]``: ``ID`` the
        input id (step 0 only; later steps read the previous step's output), ``POS`` the
        rotary position ``base + kv_start + s``, ``ROW`` the ``req_to_token`` row, ``LOC`` the
        slot, ``LEN`` the head's ``seq_len`` ``kv_start + s + 1``, ``KV`` the ``req_to_token``
        column ``kv_start + s``. A padding entry (past ``len(rows)``, or past a request's
        slots) is ``(0, 0, 0, 0, 1, 0)``: row 0, slot 0, one token.
    Raises:
        ValueError: more rows than ``gbs``, or a request with more slots than ``steps``.
    """
    return torch.tensor(chain_flat(rows, steps, gbs), dtype=torch.int64).view(steps, 6, gbs)


def pack_rows(reqs: list[tuple[int, int, int, list[int], list[int]]], rb: int,
              nlast: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The host side of a catch-up run as DECODE rows, padded to ``rb`` rows.

    Args:
        reqs: per request ``(req_pool_idx, base, kv_start, slots, ids)``: its rows are
            ``ids[j]`` at KV index ``kv_start + j`` in slot ``slots[j]``.
        rb: the padded row count (``>=`` the rows); nlast: the length of the last-row index
            (``>= len(reqs)``).
    Returns:
        ``rows`` int64 ``[6, rb]`` laid out as one step of :func:`pack_chain` (``ID``,
        ``POS`` = ``base + kv_start + j``, ``ROW``, ``LOC``, ``LEN`` = ``kv_start + j + 1``,
        ``KV``; padding ``(0, 0, 0, 0, 1, 0)``), and ``last`` int64 ``[nlast]``: each
        request's last row (0 past ``len(reqs)``).
    Raises:
        ValueError: more rows than ``rb``, more requests than ``nlast``, or a request whose
            slots and ids differ in number.
    """
    flat, last = rows_flat(reqs, rb, nlast)
    return (torch.tensor(flat, dtype=torch.int64).view(6, rb),
            torch.tensor(last, dtype=torch.int64))
