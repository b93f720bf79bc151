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
