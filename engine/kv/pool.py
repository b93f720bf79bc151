"""The paged KV cache, SGLang-style two levels.

Level 1, ``ReqToTokenPool``: ``req_to_token[max_running_requests + 1, max_context_len]`` int32
maps (request row, position) to a token slot. Row 0 is never handed out (padding rows of a
graph batch point at it).

Level 2, ``KVPool``: the per-layer K and V tensors ``[num_slots, num_kv_heads, head_dim]``
and a free list of pages of ``page_size`` consecutive slots. Page 0 (slots 0..page_size-1)
is reserved as the padding sink: padded tokens write there and nothing reads it.

Kernels read K/V only through ``req_to_token``, so prefix sharing needs no kernel change.

Which layers get K/V buffers comes from the model's per-layer description
(:class:`engine.layer_spec.LayerSpec`): :func:`build_kv_pool` groups the layers by cache kind
and builds the paged pool for the ``PAGED_KV`` ones, or the latent pool
(:class:`LatentKVPool`: one ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` tensor per
layer, DeepSeek's MLA) for the ``LATENT_KV`` ones; :func:`kv_bytes_per_token` sizes it. Both
share the slots, pages, ``req_to_token`` and radix cache (only the per-layer tensors differ).
A cache kind without a store yet (a recurrent state), or two kinds in one model, is refused
by name. Paged layers may differ in shape (Gemma 4's global layers: other head sizes and
K/V heads; each layer's buffers have its own), and a layer whose spec names a
``kv_source_layer`` (Gemma 4's KV sharing) gets no buffers: its entry in ``k_buffers`` /
``v_buffers`` is its source's (:func:`share_kv_buffers`), and it is not counted in the
bytes per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import device as dev
from engine.layer_spec import CacheKind, LayerSpec, cache_groups


class ReqToTokenPool:
    """Rows of ``req_to_token``; row 0 is reserved for padding."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32,
                                        device=device)
        self._free = list(range(size, 0, -1))
        # tensor parallelism: rank 0 keeps its writes for the workers (engine.executor.tp_worker)
        self.record_writes = False
        self.pending_writes: list[tuple[int, int, list[int]]] = []

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        """``req_to_token[row, start:start + len(slots)] = slots`` (a request's cached
        prefix, or the tree's copy of pages it computed twice)."""
        if slots:
            if self.record_writes:
                self.pending_writes.append((row, start, list(slots)))
            t = dev.host_to_device(torch.tensor(slots, dtype=torch.int32),
                                   self.req_to_token.device)  # no wait on the stream
            self.req_to_token[row, start:start + len(slots)] = t


class KVPool:
    """K/V buffers per layer plus a page allocator.

    Args:
        num_tokens: usable KV capacity in tokens (rounded down to whole pages); one more
            page is added for the padding sink.
        page_size: slots per page (>= 1).
        layer_shapes: ``(num_kv_heads, head_dim)`` of each layer where they differ between
            layers (then ``num_layers`` of them; the two arguments are ignored); None: every
            layer ``(num_kv_heads, head_dim)``.
    Memory: ``2 * num_layers * (num_tokens + page_size) * num_kv_heads * head_dim * itemsize``
    bytes (summed over ``layer_shapes``).
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device, *,
                 layer_shapes: Sequence[tuple[int, int]] | None = None):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.num_pages = max(num_tokens // page_size, 1)
        self.num_slots = (self.num_pages + 1) * page_size
        self.num_layers = num_layers
        self.dtype = dtype
        self._free_pages = list(range(self.num_pages, 0, -1))  # page 0 is the padding sink
        self.layer_shapes = list(layer_shapes) if layer_shapes is not None else None
        self._make_buffers(num_kv_heads, head_dim, device)

    def _make_buffers(self, num_kv_heads: int, head_dim: int, device) -> None:
        shapes = self.layer_shapes or [(num_kv_heads, head_dim)] * self.num_layers
        self.k_buffers = [torch.zeros((self.num_slots, h, d), dtype=self.dtype, device=device)
                          for h, d in shapes]
        self.v_buffers = [torch.zeros((self.num_slots, h, d), dtype=self.dtype, device=device)
                          for h, d in shapes]

    @property
    def nbytes(self) -> int:
        """Bytes of the per-layer cache tensors (a buffer that layers share counted once)."""
        bufs = {id(b): b for b in self.k_buffers + self.v_buffers if b is not None}
        return sum(b.numel() * b.element_size() for b in bufs.values())

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def free_page_list(self) -> list[int]:
        """A copy of the free list (for accounting checks)."""
        return list(self._free_pages)

    def used_tokens(self) -> int:
        return self.capacity_tokens - self.free_tokens()

    def pages_needed(self, cur_len: int, num_pages_held: int, extra: int) -> int:
        """Pages to add so a request holding ``num_pages_held`` grows to ``cur_len + extra``."""
        need = -(-(cur_len + extra) // self.page_size)
        return max(need - num_pages_held, 0)

    def alloc_pages(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or None (nothing taken) when fewer are free."""
        if n > len(self._free_pages):
            return None
        if n == 0:
            return []
        out = self._free_pages[-n:]
        del self._free_pages[-n:]
        return out

    def free_pages(self, pages: list[int]) -> None:
        self._free_pages.extend(pages)

    def grow(self, pages: list[int], cur_len: int, n: int) -> list[int] | None:
        """Extend a request holding ``pages`` (``cur_len`` tokens) by ``n`` tokens.

        Appends the new pages to ``pages`` in place and returns the slots of positions
        ``cur_len .. cur_len + n - 1``; None, with nothing taken, when the pool is short.
        """
        new = self.alloc_pages(self.pages_needed(cur_len, len(pages), n))
        if new is None:
            return None
        pages.extend(new)
        return self.slots_for(pages, cur_len, cur_len + n)

    def slots_for(self, pages: list[int], start: int, end: int) -> list[int]:
        """Slots of positions ``start..end-1`` of a request that holds ``pages`` in order."""
        ps = self.page_size
        if ps == 1:
            return pages[start:end]
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]


class LatentKVPool(KVPool):
    """The latent cache of multi-head latent attention (DeepSeek-V2/V3) plus the page
    allocator of :class:`KVPool` (same slots, pages and padding sink).

    ``k_buffers[layer]`` is ``[num_slots, 1, latent_dim]`` (the normed compressed K/V of
    ``kv_lora_rank`` values, then the roped key part of ``qk_rope_head_dim``; one head shared
    by every query head); ``v_buffers[layer]`` is None (the values are read from the latent).

    Args:
        num_tokens, page_size, num_layers, dtype, device: as :class:`KVPool`.
        latent_dim: values per token per layer (``kv_lora_rank + qk_rope_head_dim``).
    Memory: ``num_layers * (num_tokens + page_size) * latent_dim * itemsize`` bytes.
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, latent_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        super().__init__(num_tokens, page_size, num_layers, 1, latent_dim, dtype, device)
        self.latent_dim = latent_dim

    def _make_buffers(self, num_kv_heads: int, head_dim: int, device) -> None:
        shape = (self.num_slots, 1, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=self.dtype, device=device)
                          for _ in range(self.num_layers)]
        self.v_buffers = [None] * self.num_layers

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        return num_layers * latent_dim * torch.empty((), dtype=dtype).element_size()


def _latent_dim(specs: Sequence[LayerSpec]) -> int:
    """The one ``latent_dim`` of the ``LATENT_KV`` layers ``specs``.

    Raises:
        NotImplementedError: latent widths that differ between layers, or a zero width.
    """
    dims = {s.latent_dim for s in specs}
    if len(dims) > 1 or 0 in dims:
        raise NotImplementedError(f"latent_kv layers of widths {sorted(dims)} (kv_lora_rank + "
                                  "qk_rope_head_dim): the latent pool has one width >= 1")
    return dims.pop()


def _cache_kind(specs: Sequence[LayerSpec]) -> CacheKind:
    """The one cache kind of ``specs`` the pools build.

    Raises:
        NotImplementedError: a kind without a store yet, or two kinds in one model.
    """
    groups = cache_groups(specs)
    built = (CacheKind.PAGED_KV, CacheKind.LATENT_KV)
    other = [k for k in groups if k not in built]
    if other:
        kind = other[0]
        raise NotImplementedError(
            f"layers {groups[kind]} keep a {kind.value} cache, which ferry's KV pool does not "
            f"build yet (it builds {CacheKind.PAGED_KV.value} and {CacheKind.LATENT_KV.value} "
            "caches)")
    if len(groups) > 1:
        kind = list(groups)[1]
        raise NotImplementedError(
            f"layers {groups[kind]} keep a {kind.value} cache beside {list(groups)[0].value} "
            "layers: ferry's pool builds one cache kind per model")
    return next(iter(groups), CacheKind.PAGED_KV)


def _paged_shapes(specs: Sequence[LayerSpec]) -> list[tuple[int, int]]:
    """``(kv_heads, head_dim)`` of each layer of ``specs`` (this rank's) that keeps K/V of its
    own (a ``kv_source_layer`` reader keeps none).

    Raises:
        NotImplementedError: a V head size other than the K head size.
    """
    owners = [s for s in specs if s.kv_source_layer is None]
    for s in owners:
        if s.v_head_dim != s.head_dim:
            raise NotImplementedError(f"v_head_dim {s.v_head_dim} differs from head_dim "
                                      f"{s.head_dim}: the paged pool keeps K and V at one "
                                      "head size")
    return [(s.num_kv_heads, s.head_dim) for s in owners]


def share_kv_buffers(pool: KVPool, specs: Sequence[LayerSpec]) -> None:
    """Turn ``pool.k_buffers`` / ``v_buffers`` (one entry per layer of ``specs`` that keeps its
    own K/V, in order) into one entry per layer of ``specs``: a layer with a
    ``kv_source_layer`` gets its source's tensors (the same objects, no memory).

    Raises:
        ValueError: a source that is not an earlier layer, or of another shape.
    """
    if all(s.kv_source_layer is None for s in specs):
        return
    own_k, own_v = iter(pool.k_buffers), iter(pool.v_buffers)
    ks, vs = [], []
    for i, s in enumerate(specs):
        src = s.kv_source_layer
        if src is None:
            ks.append(next(own_k))
            vs.append(next(own_v))
            continue
        if not 0 <= src < i or (specs[src].num_kv_heads, specs[src].head_dim) != (
                s.num_kv_heads, s.head_dim):
            raise ValueError(f"layer {i} reads the K/V of layer {src}: the source must be an "
                             "earlier layer of the same K/V shape")
        ks.append(ks[src])
        vs.append(vs[src])
    pool.k_buffers, pool.v_buffers = ks, vs


def kv_bytes_per_token(specs: Sequence[LayerSpec], dtype: torch.dtype) -> int:
    """Bytes one token takes in the paged or latent pool of the layers ``specs`` (this
    rank's).

    Raises:
        NotImplementedError: as :func:`build_kv_pool`.
    """
    if _cache_kind(specs) == CacheKind.LATENT_KV:
        return LatentKVPool.bytes_per_token(len(specs), _latent_dim(specs), dtype)
    return sum(KVPool.bytes_per_token(1, h, d, dtype) for h, d in _paged_shapes(specs))


def build_kv_pool(specs: Sequence[LayerSpec], num_tokens: int, page_size: int,
                  dtype: torch.dtype, device: str | torch.device) -> KVPool:
    """The paged K/V pool of a model's ``PAGED_KV`` layers (one buffer pair per layer,
    indexed by layer id; each at its layer's shape; a ``kv_source_layer`` reader's pair is
    its source's), or the :class:`LatentKVPool` of its ``LATENT_KV`` layers.

    Args:
        specs: the model's layers, this rank's (``LayerSpec.per_rank``).
        num_tokens, page_size, dtype, device: as :class:`KVPool`.
    Raises:
        NotImplementedError: a layer whose cache kind has no store yet
            (``RECURRENT_STATE``, ``NONE``) or two cache kinds in one model, named with
            their layers; K/V shapes (latent widths) that differ between layers.
    """
    if _cache_kind(specs) == CacheKind.LATENT_KV:
        return LatentKVPool(num_tokens, page_size, len(specs), _latent_dim(specs), dtype,
                            device)
    shapes = _paged_shapes(specs)
    heads, d = shapes[0] if shapes else (1, 1)
    pool = KVPool(num_tokens, page_size, len(shapes), heads, d, dtype, device,
                  layer_shapes=shapes if len(set(shapes)) > 1 else None)
    share_kv_buffers(pool, specs)
    return pool
