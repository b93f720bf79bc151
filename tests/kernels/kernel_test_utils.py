"""Shared helpers for the kernel tests: random ragged paged-KV batches and error metrics.

Batches are built the way the engine builds them, but hostile: pages are handed out in a
shuffled order (slots are non-contiguous), request rows of ``req_to_token`` are shuffled,
every pool slot that no request owns is NaN, and ``req_to_token`` entries past a request's
length point at such a NaN slot. A kernel that reads a slot it should not (or forgets a
load mask) therefore produces NaN instead of a plausible number. Page 0, the padding sink,
holds finite garbage as in the engine (the batched torch reference reads slot 0 for its
padding positions and masks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.device import is_accelerator, resolve_device

DEVICE = resolve_device("auto")
ON_GPU = is_accelerator(DEVICE)

#: marks for tests that need a real accelerator (bf16 tl.dot, graphs, larger sizes)
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA/XPU device")]

#: relative error-norm tolerances: output rounding plus P cast to 16 bits before P @ V
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def gpu_only(fn):
    """Decorator: mark ``gpu`` and skip unless an accelerator is present."""
    for mark in GPU_MARKS:
        fn = mark(fn)
    return fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64 (NaN if ``out`` has NaN)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten rows or bad reads)"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]:.3g}"


@dataclass
class PagedBatch:
    k_buffer: torch.Tensor          # [S, Hkv, D]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor      # [R, max_context] int32
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor          # [B] int32, prefix + extend
    prefix_lens: list[int]
    extend_lens: list[int]


def make_paged_batch(prefix_lens: list[int], extend_lens: list[int] | None, *,
                     num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                     seed: int, device: str = DEVICE) -> PagedBatch:
    """A pool holding each request's prefix at shuffled pages; extend slots stay NaN.

    Slots for the extend tokens are allocated (as the engine would) but left NaN, so a
    kernel must take the new tokens' K/V from k_extend/v_extend, as the reference does.
    """
    extend_lens = extend_lens or [0] * len(prefix_lens)
    g = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    bs = len(lens)
    pages_per_req = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_req) + 3                       # a few never-used pages
    num_slots = (num_pages + 1) * page_size                  # + page 0, the padding sink
    shape = (num_slots, num_kv_heads, head_dim)
    k_buffer = torch.full(shape, float("nan"), dtype=dtype)
    v_buffer = torch.full(shape, float("nan"), dtype=dtype)
    k_buffer[:page_size] = 100 * torch.randn((page_size,) + shape[1:], generator=g).to(dtype)
    v_buffer[:page_size] = 100 * torch.randn((page_size,) + shape[1:], generator=g).to(dtype)
    page_ids = (torch.randperm(num_pages, generator=g) + 1).tolist()
    poison_slot = page_ids[-1] * page_size     # a page no request gets: NaN
    num_rows = bs + 3
    rows = (torch.randperm(num_rows - 1, generator=g)[:bs] + 1).tolist()
    max_ctx = max(lens + [1]) + 19                           # not a multiple of any block
    req_to_token = torch.full((num_rows, max_ctx), poison_slot, dtype=torch.int32)
    for b in range(bs):
        pages, page_ids = page_ids[: pages_per_req[b]], page_ids[pages_per_req[b]:]
        pos = torch.arange(lens[b])
        slots = torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size \
            + pos % page_size
        req_to_token[rows[b], : lens[b]] = slots.int()
        pre = slots[: prefix_lens[b]]
        k_buffer[pre] = torch.randn((len(pre), num_kv_heads, head_dim), generator=g).to(dtype)
        v_buffer[pre] = torch.randn((len(pre), num_kv_heads, head_dim), generator=g).to(dtype)
    return PagedBatch(
        k_buffer=k_buffer.to(device), v_buffer=v_buffer.to(device),
        req_to_token=req_to_token.to(device),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        prefix_lens=list(prefix_lens), extend_lens=list(extend_lens))


def randn(shape, dtype: torch.dtype, seed: int, device: str = DEVICE,
          scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def make_extend_inputs(group: int, hkv: int, d: int, page: int, dtype: torch.dtype,
                       prefix_lens: list[int], extend_lens: list[int], seed: int):
    """A paged batch plus the new tokens' q [T, Hq, D], k/v [T, Hkv, D], extend lengths and
    start offsets [B] int32: ``(batch, q, k, v, ext, starts)``."""
    batch = make_paged_batch(prefix_lens, extend_lens, num_kv_heads=hkv, head_dim=d,
                             page_size=page, dtype=dtype, seed=seed)
    t, hq = sum(extend_lens), group * hkv
    q = randn((t, hq, d), dtype, seed + 1, scale=2.0)
    k = randn((t, hkv, d), dtype, seed + 2)
    v = randn((t, hkv, d), dtype, seed + 3)
    ext = torch.tensor(extend_lens, dtype=torch.int32, device=DEVICE)
    starts = (torch.cumsum(ext, 0) - ext).to(torch.int32)
    return batch, q, k, v, ext, starts


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int],
                    scale: float, *, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain masked-softmax attention in float64, written from the model definitions (not
    from the code under test): q ``[n, Hq, D]`` at positions ``q_pos``, k/v ``[m, Hkv, D]``
    at positions ``0..m-1``. Scores ``q.k * scale``, then ``softcap * tanh(s / softcap)``
    (Gemma 2), then the causal mask and HF's sliding window (key ``j`` visible to the query
    at ``p`` iff ``p - window < j <= p``), then a softmax with the per-head sink logit as
    one more column that is dropped afterwards (gpt-oss). Returns ``[n, Hq, D]`` float64."""
    hq, hkv = q.shape[1], k.shape[1]
    kf = k.double().cpu().repeat_interleave(hq // hkv, 1)          # [m, Hq, D]
    vf = v.double().cpu().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("nhd,mhd->hnm", q.double().cpu(), kf) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qp = torch.tensor(q_pos, dtype=torch.long)[:, None]
    kp = torch.arange(k.shape[0])[None, :]
    hidden = kp > qp
    if window is not None:
        hidden |= kp <= qp - window
    s = s.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        col = sinks.double().cpu().view(hq, 1, 1).expand(hq, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.einsum("hnm,mhd->nhd", p, vf)


def request_kv(batch: PagedBatch, b: int, k_new: torch.Tensor | None = None,
               v_new: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``b``'s keys and values in position order: its pooled prefix (its whole KV for
    a decode batch), then ``k_new``/``v_new`` (its new tokens' rows, extend)."""
    row = int(batch.req_pool_indices[b])
    n = batch.prefix_lens[b] if k_new is not None else int(batch.seq_lens[b])
    slots = batch.req_to_token[row, :n].long()
    k, v = batch.k_buffer[slots], batch.v_buffer[slots]
    if k_new is not None:
        k, v = torch.cat([k, k_new.to(k.dtype)]), torch.cat([v, v_new.to(v.dtype)])
    return k, v


def poison_outside_window(batch: PagedBatch, window: int, queries_from: list[int]) -> None:
    """NaN the pool slots of the keys that no query sees under ``window`` (request b's
    queries start at position ``queries_from[b]``): a kernel that reads them, even to mask
    them, turns its output NaN (``0 * NaN`` in ``p @ v``)."""
    for b, p0 in enumerate(queries_from):
        row = int(batch.req_pool_indices[b])
        lo = max(0, p0 - window + 1)
        slots = batch.req_to_token[row, :lo].long()
        batch.k_buffer[slots] = float("nan")
        batch.v_buffer[slots] = float("nan")


def backend_mixed_step(name: str, dtype: torch.dtype, scale: float, **variants):
    """One layer call of attention backend ``name`` (on the CPU) on a mixed step: a chunk
    whose prefix (40) crosses a window, a prefill, three decodes; ``variants`` are passed to
    ``AttentionBackend.forward``. Returns ``(out, dense float64 reference)``."""
    from engine.attention import ATTENTION_BACKENDS
    from engine.forward_batch import ForwardBatch, ForwardMode

    group, hkv, d = 2, 2, 32
    prefix, extend = [40, 0, 70, 5, 33], [25, 20, 1, 1, 1]
    batch, q, k, v, ext, starts = make_extend_inputs(group, hkv, d, 16, dtype, prefix,
                                                     extend, seed=13)
    refs = []
    for b, (p, n) in enumerate(zip(prefix, extend)):
        s0 = int(starts[b])
        kk, vv = request_kv(batch, b, k[s0:s0 + n], v[s0:s0 + n])
        refs.append(dense_attention(q[s0:s0 + n], kk, vv, list(range(p, p + n)), scale,
                                    window=variants.get("sliding_window"),
                                    softcap=variants.get("logit_softcap"),
                                    sinks=variants.get("sinks")))
    loc = torch.cat([batch.req_to_token[r, p:p + n].long()
                     for r, p, n in zip(batch.req_pool_indices.tolist(), prefix, extend)])
    backend = ATTENTION_BACKENDS[name](group * hkv, hkv, d, num_sms=8, device="cpu")
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, batch_size=len(extend), positions=None,
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, out_cache_loc=loc,
        req_to_token=batch.req_to_token, k_buffers=[batch.k_buffer],
        v_buffers=[batch.v_buffer], attn_backend=backend, extend_seq_lens=ext,
        extend_start_loc=starts, max_extend_len=max(extend), num_decodes=3)
    backend.init_forward(fb)
    out = backend.forward(q, k, v, 0, scale, fb, **variants)
    return out, torch.cat(refs)
