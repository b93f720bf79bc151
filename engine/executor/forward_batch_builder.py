"""``build_forward_batch``: one step's host-side ``ScheduleBatch`` -> device ``ForwardBatch``.

Shared by every forward that runs over a pool of its own: the target's runner
(``RankRunner.build_forward_batch``, the eager and piecewise paths) and the EAGLE head
(``engine/speculative/eagle.py``), each with its own :class:`StepPools` and attention
backend. The host arrays go to the device in two copies (one int64 buffer, one int32
buffer, :func:`_to_device`); the new tokens' slots are written into ``req_to_token``.

LoRA: with a ``LoRAManager`` the builder fills ``ForwardBatch.lora_segments`` (one segment
per request, with its adapter slot) and points the model's shared ``LoRABatch`` at them.

Linear-attention layers: with a recurrent-state pool the builder fills ``ForwardBatch.state``
(each request's ``state_slot`` and the step's cumulative token counts, uploaded with the
other int64 arrays), which the layers index their pool tensors with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine import device as dev
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LoRASegments,
    RecurrentStateView,
    resolve_placeholders,
)
from engine.kv.pool import KVPool, ReqToTokenPool
from engine.kv.state_pool import RecurrentStatePool
from engine.kv.windowed import WindowedKVPool
from engine.mm_inputs import key_limits

if TYPE_CHECKING:
    from engine.lora.manager import LoRAManager


@dataclass(frozen=True)
class StepPools:
    """What a forward's KV lives in: its ``req_to_token`` rows, its K/V buffers, and the
    device the step's tensors go to."""

    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    device: torch.device
    #: the windowed layers' pool and table (engine/kv/windowed.py), or None
    swa_pool: WindowedKVPool | None = None
    swa_req_pool: ReqToTokenPool | None = None
    #: the linear-attention layers' recurrent-state slots, or None
    state_pool: RecurrentStatePool | None = None


def _to_device(arrays: list[list[int]], dtype: torch.dtype, device: torch.device
              ) -> list[torch.Tensor]:
    """Host int lists -> device tensors (views of one buffer), with one non-blocking copy.

    Each array starts at a 16-byte boundary of the buffer, so a view is aligned as a fresh
    allocation is (Triton specialises kernels on 16-byte alignment)."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    flat: list[int] = []
    spans = []
    for a in arrays:
        spans.append((len(flat), len(a)))
        flat.extend(a)
        flat.extend([0] * (-len(flat) % per))
    buf = dev.host_to_device(torch.tensor(flat, dtype=dtype), device)
    return [buf[o:o + n] for o, n in spans]


class _HostStep(NamedTuple):
    """The step's host lists: per token (T) and per request (B)."""

    ids: list[int]          # [T] input ids (negative: placeholders)
    positions: list[int]    # [T]
    token_rows: list[int]   # [T] req_to_token row of each token
    starts: list[int]       # [B] offset of each request's first new token
    seq_lens: list[int]     # [B] KV length after the step
    logits_rows: list[int]  # rows whose logits are sampled (every row of an all_rows request)


def _host_step(batch: ScheduleBatch) -> _HostStep:
    ids: list[int] = []
    pos: list[int] = []
    rows_t: list[int] = []
    starts: list[int] = []
    seq_lens: list[int] = []
    last: list[int] = []
    off = 0
    for req, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        ids.extend(req.tokens(p, n))
        pos.extend(range(p, p + n))
        rows_t.extend([req.req_pool_idx] * n)
        starts.append(off)
        seq_lens.append(p + n)
        off += n
        last.append(off - 1)
    if batch.mode == ForwardMode.EXTEND and any(batch.all_rows):
        last = []
        for s0, n, all_ in zip(starts, batch.extend_lens, batch.all_rows):
            last.extend(range(s0, s0 + n) if all_ else [s0 + n - 1])
    return _HostStep(ids, pos, rows_t, starts, seq_lens, last)


def _state_arrays(batch: ScheduleBatch) -> list[list[int]]:
    """Each request's recurrent-state slot (0, the padding slot, for a request without one)
    and the step's cumulative new-token counts ``[0, n0, n0 + n1, ...]``."""
    cu = [0]
    for n in batch.extend_lens:
        cu.append(cu[-1] + n)
    return [[getattr(r, "state_slot", None) or 0 for r in batch.reqs], cu]


def _state_view(pools: StepPools, batch: ScheduleBatch, arrays: list[list[int]],
                on_device: list[torch.Tensor]) -> RecurrentStateView:
    """The step's view of the recurrent-state pool (``arrays``: :func:`_state_arrays`,
    ``on_device`` the same on the device)."""
    sp = pools.state_pool
    view = RecurrentStateView(sp.conv_states, sp.recurrent_states, on_device[0], arrays[1],
                              on_device[1], batch.verify_n, sp.scratch_base)
    if batch.mode == ForwardMode.EXTEND and pools.device.type != "cpu":
        n = batch.batch_size - batch.num_decodes   # the prefill rows, before the decodes
        cu = on_device[1] if not batch.num_decodes else on_device[1][:n + 1]
        view.prefill_cu = (cu, torch.tensor(arrays[1][:n + 1], dtype=torch.int64))
    return view


def _mm_step(batch: ScheduleBatch, starts: list[int], extend: bool, device: torch.device
             ) -> tuple[torch.Tensor, list[tuple] | None, torch.Tensor | None]:
    """A step with image requests: its M-RoPE positions [3, T] int64 on ``device`` (a text
    request's tokens, and generated ones, ``p + delta`` on all three axes; delta 0 without
    images), the image requests' segments of an EXTEND step and its extend rows' key limits
    ([Te] int32 for bidirectional images, Gemma 3's, else None; ``ForwardBatch``)."""
    parts = []
    segs = []
    for req, p, n, s0 in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, starts):
        mm = getattr(req, "mm", None)
        if mm is None:
            parts.append(torch.arange(p, p + n).expand(3, n))
            continue
        n_prompt = mm.positions.shape[1]
        head = mm.positions[:, p:min(p + n, n_prompt)]
        tail = torch.arange(min(max(p, n_prompt), p + n), p + n) + mm.delta
        parts.append(torch.cat([head, tail.expand(3, tail.numel())], dim=1))
        if extend and p < n_prompt and any(it.end > p and it.offset < p + n
                                           for it in mm.items):
            segs.append((mm, p, n, s0))
    pos = dev.host_to_device(torch.cat(parts, dim=1).contiguous(), device)
    ne = batch.batch_size - batch.num_decodes
    lim = key_limits(segs, starts[:ne], list(batch.extend_lens[:ne])) if segs else None
    if lim is not None:
        lim = dev.host_to_device(torch.tensor(lim, dtype=torch.int32), device)
    return pos, segs or None, lim


def build_forward_batch(pools: StepPools, attn_backend, batch: ScheduleBatch,
                        lora: LoRAManager | None = None,
                        future_ids: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, ForwardBatch]:
    """Host lists -> device tensors, and write the new slots into ``req_to_token``.

    Args:
        pools: the forward's pools and device.
        attn_backend: the forward's ``engine.attention.AttentionBackend`` (stored in the
            batch; its ``init_forward`` is the caller's to run).
        batch: the step (EXTEND or DECODE).
        lora: the model's ``LoRAManager``, or None for a model without adapters; with one,
            its shared ``LoRABatch`` describes this step's segments afterwards.
        future_ids: the in-flight step's sampled ids [B'] int64 on the device, or None. A
            negative input id ``-(k + 1)`` is a placeholder for row k and is resolved there.
    Returns:
        ``(input_ids [T] int64, ForwardBatch)``, on ``pools.device``.
    """
    extend = batch.mode == ForwardMode.EXTEND
    h = _host_step(batch)
    # the step's host arrays in two tensors, each one non-blocking copy from pinned memory
    # (a blocking .to(device) waits for the in-flight step: no overlap)
    swa = pools.swa_pool
    state_arrays = _state_arrays(batch) if pools.state_pool is not None else []
    input_ids, positions, loc, rows, req_rows, *rest = _to_device(
        [h.ids, h.positions, batch.out_cache_loc, h.token_rows,
         [r.req_pool_idx for r in batch.reqs]] + ([h.logits_rows] if extend else [])
        + state_arrays + ([swa.translate(batch.out_cache_loc)] if swa is not None else []),
        torch.int64, pools.device)
    logits_idx = rest[:1] if extend else []
    state_dev = rest[len(logits_idx):len(logits_idx) + len(state_arrays)]
    i32 = {"seq_lens": h.seq_lens}
    if extend:
        i32.update(extend_seq_lens=list(batch.extend_lens),
                   extend_prefix_lens=list(batch.prefix_lens), extend_start_loc=h.starts)
    segs = None
    if lora is not None:  # the LoRA segments: one per request
        segs = LoRASegments(h.starts, list(batch.extend_lens),
                            batch.lora_slots or [-1] * len(h.starts))
        if batch.lora_slots and lora.batch.use_triton:  # the kernels read them on the device
            i32.update(lora_seg_start=segs.starts, lora_seg_len=segs.lens,
                       lora_seg_slot=segs.slots)
    d32 = dict(zip(i32, _to_device(list(i32.values()), torch.int32, pools.device)))
    if segs is not None:
        if "lora_seg_start" in d32:
            segs.tensors = (d32["lora_seg_start"], d32["lora_seg_len"], d32["lora_seg_slot"])
        lora.set_batch(segs.starts, segs.lens, segs.slots, segs.tensors)
    input_ids = resolve_placeholders(input_ids, future_ids)
    r2t = pools.req_to_token_pool.req_to_token
    r2t[rows, positions] = loc.to(torch.int32)
    fb = ForwardBatch(
        mode=batch.mode, batch_size=batch.batch_size, positions=positions,
        req_pool_indices=req_rows, seq_lens=d32["seq_lens"],
        out_cache_loc=loc, req_to_token=r2t, k_buffers=pools.kv_pool.k_buffers,
        v_buffers=pools.kv_pool.v_buffers, attn_backend=attn_backend,
        max_seq_len=max(h.seq_lens), seq_lens_cpu=h.seq_lens,
        extend_seq_lens_cpu=list(batch.extend_lens), lora_segments=segs)
    if extend:
        fb.extend_seq_lens = d32["extend_seq_lens"]
        fb.extend_prefix_lens = d32["extend_prefix_lens"]
        fb.extend_start_loc = d32["extend_start_loc"]
        fb.max_extend_len = max(batch.extend_lens)
        fb.num_decodes = batch.num_decodes
        fb.logits_indices = logits_idx[0]
    if state_dev:
        fb.state = _state_view(pools, batch, state_arrays, state_dev)
    if any(getattr(r, "mm", None) is not None for r in batch.reqs):
        fb.mrope_positions, fb.mm_segments, fb.key_limit = _mm_step(batch, h.starts, extend,
                                                                    pools.device)
    if swa is not None:  # the windowed layers' slots: their own table and locations
        swa_loc = rest[-1]
        swa_r2t = pools.swa_req_pool.req_to_token
        swa_r2t[rows, positions] = swa_loc.to(torch.int32)
        fb.swa = replace(fb, req_to_token=swa_r2t, out_cache_loc=swa_loc)
    return input_ids, fb
