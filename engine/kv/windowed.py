"""The windowed KV pool: the K/V of sliding-window layers in a pool of their own.

A layer whose ``LayerSpec`` is ``SLIDING`` (window W, W keys per query, its own included) never
reads a key more than W - 1 positions behind the query, so a request needs about W of its
slots however long it runs. With the windowed pool on (``--swa-full-tokens-ratio`` > 0 and a
model with windowed ``PAGED_KV`` layers) the layers split in two groups:

- the full-attention layers keep the paged pool (:class:`engine.kv.pool.KVPool`) and
  ``req_to_token``, as a model without windows does;
- the windowed layers keep their K/V in a :class:`WindowedKVPool` of their own, addressed by
  a second table ``req_to_token`` of the same shape (:class:`engine.kv.pool.ReqToTokenPool`,
  the same rows). Its pages run parallel to the full pool's: a request's ``swa_pages[i]``
  holds the windowed K/V of the positions of its full page ``pages[i]`` (0: freed, the
  positions are behind the window; page 0 is the padding sink that nothing reads).

As a request advances, its own windowed pages that lie wholly behind ``kv_len - W + 1``
(the first key its next token sees) go back to the windowed pool
(``KVCacheManager.grow``). The radix tree keeps a windowed page list beside each node's full
pages; a cached prefix is only reused up to where the tree still holds the windowed keys the
next token needs (:func:`usable_prefix_pages`).

``page_map[f]`` is the windowed page that runs parallel to full page ``f`` while a request
writes it: the step builder turns the step's full slots into windowed slots through it
(:meth:`WindowedKVPool.translate`), so the scheduler's batches carry one slot list.

Sizing (:func:`split_tokens`): the undivided pool's byte budget goes to the two pools by
their bytes per token, the windowed pool holding ``ratio`` windowed slots per full slot
(and at least enough for one request's window plus a prefill chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv.pool import KVPool, build_kv_pool, kv_bytes_per_token, share_kv_buffers
from engine.layer_spec import AttentionKind, CacheKind, LayerSpec

#: windowed slots per full-attention slot when ``--swa-full-tokens-ratio`` is not given:
#: a 5:1 local:global model (Gemma 3) then holds 2.7x the tokens of the undivided pool in
#: its full-attention layers, and every request still finds its window
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.25


def windowed_layers(specs: Sequence[LayerSpec]) -> list[int]:
    """Indices of the layers that keep a paged K/V of a sliding window."""
    return [i for i, s in enumerate(specs)
            if s.attention == AttentionKind.SLIDING and s.cache == CacheKind.PAGED_KV]


def max_window(specs: Sequence[LayerSpec]) -> int:
    """The widest window of the windowed layers (0 without any)."""
    return max((specs[i].sliding_window or 0 for i in windowed_layers(specs)), default=0)


@dataclass(frozen=True)
class PoolSplit:
    """Token capacities of the two pools (``swa_tokens`` 0: no windowed pool)."""

    full_tokens: int
    swa_tokens: int


def split_tokens(specs: Sequence[LayerSpec], total_tokens: int, ratio: float,
                 dtype: torch.dtype, min_swa_tokens: int = 0) -> PoolSplit:
    """Split the byte budget of an undivided pool of ``total_tokens`` between the pools.

    Args:
        specs: the model's layers (this rank's).
        total_tokens: tokens the undivided pool of every layer would hold (its bytes are the
            budget).
        ratio: windowed slots per full slot (> 0).
        min_swa_tokens: the least windowed slots (one request's window plus a chunk).
    Returns:
        the capacities; ``PoolSplit(total_tokens, 0)`` (one pool) for a model without
        windowed layers, and where the split would leave the full-attention layers no more
        tokens than the undivided pool has (a small budget that the windowed layers' least
        size eats: the windowed pool would only shrink the context).
    """
    swa = windowed_layers(specs)
    if not swa or ratio <= 0:
        return PoolSplit(total_tokens, 0)
    full = [s for i, s in enumerate(specs) if i not in set(swa)]
    budget = total_tokens * kv_bytes_per_token(specs, dtype)
    b_full = kv_bytes_per_token(full, dtype) if full else 0
    b_swa = kv_bytes_per_token([specs[i] for i in swa], dtype)
    n_full = budget / (b_full + ratio * b_swa)
    n_swa = max(ratio * n_full, min(min_swa_tokens, budget // b_swa))
    if b_full:
        n_full = (budget - n_swa * b_swa) / b_full
        if n_full <= total_tokens:
            return PoolSplit(total_tokens, 0)
    return PoolSplit(int(n_full), int(n_swa))


class WindowedKVPool(KVPool):
    """The K/V buffers of the windowed layers (indexed by their place among them) and their
    page allocator, plus ``page_map`` (full page -> windowed page, host ints).

    Args:
        num_full_pages: pages of the full pool (``page_map`` covers them and the sink).
        layer_shapes: per-layer ``(kv heads, head_dim)`` where they differ (see
            :class:`KVPool`).
        window: the widest window W of the windowed layers (tokens).
        the rest: as :class:`KVPool`.
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device, *,
                 num_full_pages: int, window: int,
                 layer_shapes: Sequence[tuple[int, int]] | None = None):
        super().__init__(num_tokens, page_size, num_layers, num_kv_heads, head_dim, dtype,
                         device, layer_shapes=layer_shapes)
        self.window = window
        self.page_map = [0] * (num_full_pages + 1)

    def translate(self, full_slots: Sequence[int]) -> list[int]:
        """The windowed slots of the positions whose full slots are ``full_slots``."""
        ps, m = self.page_size, self.page_map
        if ps == 1:
            return [m[s] for s in full_slots]
        return [m[s // ps] * ps + s % ps for s in full_slots]


def usable_prefix_pages(swa_pages: Sequence[int], page_size: int, window: int) -> int:
    """Leading pages of a cached prefix whose reuse leaves the windowed layers every key the
    next token needs: the largest ``j <= len(swa_pages)`` such that the windowed pages of
    positions ``max(0, j * page_size - window + 1) .. j * page_size - 1`` are all held
    (non-zero). 0 when none is."""
    j = len(swa_pages)
    while j > 0:
        lo = max(0, j * page_size - window + 1) // page_size
        gap = next((i for i in range(j - 1, lo - 1, -1) if not swa_pages[i]), None)
        if gap is None:
            return j
        j = gap  # a prefix ending at the hole needs nothing past it
    return 0


def combine_buffers(full: KVPool, swa: WindowedKVPool, num_layers: int,
                    swa_layers: Sequence[int]) -> None:
    """Make ``full.k_buffers`` / ``v_buffers`` the per-layer lists of the whole model (a
    windowed layer's entry is its buffer in ``swa``), so every reader indexes by layer id."""
    fi = si = 0
    ks, vs = [], []
    in_swa = set(swa_layers)
    for i in range(num_layers):
        if i in in_swa:
            ks.append(swa.k_buffers[si])
            vs.append(swa.v_buffers[si])
            si += 1
        else:
            ks.append(full.k_buffers[fi])
            vs.append(full.v_buffers[fi])
            fi += 1
    full.k_buffers, full.v_buffers = ks, vs


def build_pools(specs: Sequence[LayerSpec], split: PoolSplit, page_size: int,
                dtype: torch.dtype, device: str | torch.device
                ) -> tuple[KVPool, WindowedKVPool | None]:
    """The full pool (its ``k_buffers`` / ``v_buffers`` indexed by layer id over the whole
    model) and the windowed pool, or ``(build_kv_pool(...), None)`` when ``split`` has no
    windowed slots.

    Raises:
        NotImplementedError: as :func:`engine.kv.pool.build_kv_pool`.
    """

    if not split.swa_tokens:
        return build_kv_pool(specs, split.full_tokens, page_size, dtype, device), None
    kv_bytes_per_token(specs, dtype)  # the checks of the undivided pool
    # the layers with K/V of their own; a kv_source_layer reader gets its source's at the end
    own = [s for s in specs if s.kv_source_layer is None]
    swa = windowed_layers(own)
    full_specs = [s for i, s in enumerate(own) if i not in set(swa)]
    full = build_kv_pool(full_specs, split.full_tokens, page_size, dtype, device)
    shapes = [(own[i].num_kv_heads, own[i].head_dim) for i in swa]
    win = WindowedKVPool(split.swa_tokens, page_size, len(swa), *shapes[0],
                         dtype, device, num_full_pages=full.num_pages,
                         window=max_window(specs),
                         layer_shapes=shapes if len(set(shapes)) > 1 else None)
    combine_buffers(full, win, len(own), swa)
    share_kv_buffers(full, specs)
    return full, win
