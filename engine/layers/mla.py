"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the latent KV cache.

Projections (HF ``DeepseekV2Attention`` / ``DeepseekV3Attention`` names, so checkpoints load
by name):

- queries: ``q_proj`` (``q_lora_rank`` None), or the low-rank ``q_a_proj`` ->
  ``q_a_layernorm`` -> ``q_b_proj``; each head is ``[q_nope (N) | q_rope (P)]``;
- the latent: ``kv_a_proj_with_mqa`` -> ``[c (R) | k_rope (P)]``, ``kv_a_layernorm`` on
  ``c``; ``kv_b_proj`` (``[H * (N + V), R]``) holds ``W_UK`` (the heads' N rows) and
  ``W_UV`` (their V rows);
- ``o_proj`` over the heads' values.

Rotary applies to the rope parts only. DeepSeek's checkpoints lay those out in interleaved
pairs ``(x0, x1), (x2, x3), ...`` (V2 always, V3 with ``rope_interleave``): the layer
de-interleaves them (evens then odds) and rotates in ferry's rotate-half layout, which
rotates every pair by the same angle as HF; queries and keys get the same permutation, so
the scores are HF's.

The cache keeps ``[kv_a_layernorm(c) | rotated k_rope]`` per token
(:class:`engine.kv.pool.LatentKVPool`, ``fb.k_buffers[layer_id]``). An FP8 cache
(``--kv-cache-dtype fp8_e4m3``: 1 byte a value) holds ``latent / kv_scale`` rounded to e4m3
(:func:`store_latent`) with the paged pool's convention (a per-tensor scale, 1.0: a plain
cast, saturating at +-448); every reader takes the rows as stored, the new tokens' too (they
are stored before the layer attends), so a prompt's result does not depend on where chunked
prefill cut it: the torch path dequantizes in fp32, the Triton decode converts the tiles in
registers (``kernels/mla/decode.py``), the extend gathers its sequences' rows in the run
dtype (:func:`latent_rows`) before decompressing them. On the CPU attention
runs in the absorbed form for extend and decode alike: ``q_latent = q_nope @ W_UK`` per head, scores
``q_latent . c + q_rope . k_rope``, the weighted sum of the ``c`` rows mapped through
``W_UV`` (:func:`kernels.mla.reference.mla_attention_ref`, the torch path of the CPU; it
reads the step's host lengths, so it is not captured in device graphs).

On a GPU the Triton MLA backend (``engine/attention/triton_mla.py``, ``runs_latent``) runs
the kernels of ``kernels/mla/`` instead: the decode rows in the absorbed form (split-KV
over the latent pool, each tile read once per 16 heads), the extending requests in the MHA
form (their sequences' latent rows gathered and decompressed through ``kv_b_proj``, then
flash attention with ``N + P`` query/key and ``V`` value heads); batched through the step's
tensors, with no host sync and no loop over requests, so decode is captured in graphs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.distributed import get_tp
from engine.forward_batch import ForwardBatch
from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RotarySpec
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from kernels.mla.reference import mla_attention_ref


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude ``0.1 * mscale * ln(factor) + 1`` (1.0 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_params: dict | None) -> float:
    """``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` for a
    scaled rope with ``mscale_all_dim`` (HF's ``yarn_apply_mscale``)."""
    scale = qk_head_dim ** -0.5
    params = rope_params or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., P]`` pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ... | x1, x3, ...]``."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    """One layer's MLA: hidden states in, the attention output (after ``o_proj``) out.

    Under tensor parallelism a rank holds ``H / tp_size`` heads (``self.num_heads``): its
    rows of ``q_proj``/``q_b_proj`` and ``kv_b_proj`` (column-parallel: each head's rows are
    contiguous) and its columns of ``o_proj`` (row-parallel, one all-reduce); ``q_a_proj``,
    ``kv_a_proj_with_mqa`` and their norms are replicated, so every rank computes the same
    latent row and keeps it in its own latent pool. The absorbed form reads the rank's heads
    of ``W_UK``/``W_UV`` (:meth:`absorbed_weights`).

    Args:
        hidden_size: model width.
        num_heads: query heads H (the whole model's).
        q_lora_rank: rank of the low-rank query path, or None for ``q_proj``.
        kv_lora_rank: R; qk_nope_head_dim: N; qk_rope_head_dim: P; v_head_dim: V.
        layer_id: index of the layer's latent buffer in the pool.
        rotary: the rope of the P rotated dimensions (``rotate(q, k, positions)``).
        eps: the RMSNorms' epsilon.
        dtype: the weights' dtype.
        scaling: the softmax scale (:func:`mla_softmax_scale`).
        interleaved: the checkpoint's rope dimensions are interleaved pairs.
        bias: bias on ``q_a_proj``/``q_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``
            (``attention_bias``).
        spec: the layer's description (default: a ``LATENT`` spec of these sizes), kept as
            ``self.spec``.

    Raises:
        ValueError: ``H`` not divisible by the tensor-parallel size.
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, layer_id: int, rotary: nn.Module, eps: float,
                 dtype: torch.dtype, scaling: float, interleaved: bool = True,
                 bias: bool = False, spec: LayerSpec | None = None):
        super().__init__()
        tp = get_tp().size
        if num_heads % tp:
            raise ValueError(f"--tp-size {tp} does not divide the model's {num_heads} "
                             "attention heads")
        self.num_heads, self.layer_id = num_heads // tp, layer_id   # this rank's heads
        self.kv_lora_rank, self.nope, self.rope, self.v_dim = (
            kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
        self.scaling, self.interleaved, self.rotary = scaling, interleaved, rotary
        #: an FP8 cache's per-tensor scale (ferry's KV convention: 1.0, a plain cast)
        self.kv_scale = 1.0
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        # by head over the ranks: the query projection's and kv_b_proj's rows (each head's
        # rows contiguous), o_proj's columns; the latent's projections and norms replicated
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk, bias, dtype)
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk, False, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                                   bias, dtype)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank,
                                              num_heads * (qk_nope_head_dim + v_head_dim),
                                              False, dtype)
        self.kv_b_proj.packable = False   # read as W_UK / W_UV views by the absorbed form
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias, dtype)
        self.spec = spec or LayerSpec(attention=AttentionKind.LATENT, cache=CacheKind.LATENT_KV,
                              head_dim=qk, v_head_dim=v_head_dim, num_kv_heads=1,
                              scale=scaling, rotary=RotarySpec(), kv_lora_rank=kv_lora_rank,
                              qk_rope_head_dim=qk_rope_head_dim)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, H, N + P]."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope)

    def latent(self, positions: torch.Tensor, x: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_nope [T, H, N], q_rope [T, H, P], latent [T, R + P])`` of the new tokens
        (the rope parts rotated, ``c`` normed): the latent row is what the cache keeps."""
        t = x.shape[0]
        q = self._queries(x)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary.rotate(q_pe.reshape(t, -1).contiguous(), k_pe.contiguous(),
                                        positions)
        return q_nope, q_pe.view(t, self.num_heads, self.rope), torch.cat([c, k_pe], dim=-1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [H, N, R], W_UV [H, V, R])`` views of ``kv_b_proj``'s weight (H: this
        rank's heads)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim,
                                       self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """positions [T] int64, x [T, hidden] -> [T, hidden]; stores the new tokens' latent
        rows at ``fb.out_cache_loc`` of ``fb.k_buffers[layer_id]`` first. The kernels of the
        step's backend when it runs latent layers (``runs_latent``: the Triton MLA backend,
        no host sync, decode capturable), else the torch path."""
        q_nope, q_pe, lat = self.latent(positions, x)
        buf = fb.k_buffers[self.layer_id]
        store_latent(buf, fb.out_cache_loc, lat, self.kv_scale)
        if getattr(fb.attn_backend, "runs_latent", False):
            o = self._attend_kernels(q_nope, q_pe, buf, fb)
        else:
            o = self._attend_reference(q_nope, q_pe, buf, fb)
        return self.o_proj(o.reshape(x.shape[0], -1))

    def _attend_reference(self, q_nope: torch.Tensor, q_pe: torch.Tensor, buf: torch.Tensor,
                          fb: ForwardBatch) -> torch.Tensor:
        """The torch path, absorbed for every row: ``[T, H, V]``."""
        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q_abs = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)
        rows, seq_lens, ext_lens = step_requests(fb)
        o_lat = mla_attention_ref(q_abs, buf, fb.req_to_token, rows, seq_lens, ext_lens,
                                  self.scaling, self.kv_lora_rank, self.kv_scale)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def _attend_kernels(self, q_nope: torch.Tensor, q_pe: torch.Tensor, buf: torch.Tensor,
                        fb: ForwardBatch) -> torch.Tensor:
        """The backend's kernels: the extending requests in the MHA form (their sequences'
        latent rows decompressed through ``kv_b_proj``), the decode rows absorbed (``q_nope``
        through ``W_UK`` into the latent space, the result out through ``W_UV``); ``[T, H,
        V]``. Why each form where: ``kernels/mla/prefill.py``."""
        be, t, h = fb.attn_backend, q_nope.shape[0], self.num_heads
        o = q_nope.new_empty(t, h, self.v_dim)
        te = 0 if fb.is_decode else t - fb.num_decodes
        if te:
            rows = latent_rows(buf, be.extend_slots(fb), q_nope.dtype, self.kv_scale)
            kv = self.kv_b_proj(rows[:, :self.kv_lora_rank])
            k_nope, v = kv.view(-1, h, self.nope + self.v_dim).split([self.nope, self.v_dim],
                                                                      dim=-1)
            be.mla_extend(q_nope[:te], q_pe[:te].to(q_nope.dtype), k_nope,
                          rows[:, self.kv_lora_rank:], v, o[:te], fb, self.scaling)
        if te < t:
            w_uk, w_uv = self.absorbed_weights()
            q_lat = torch.bmm(q_nope[te:].transpose(0, 1), w_uk).transpose(0, 1)  # [Bd, H, R]
            # the tail of a mixed step gets its own copy (pointer alignment: TritonAttnBackend)
            q_pe_d = q_pe[te:].to(q_lat.dtype).clone() if te else q_pe.to(q_lat.dtype)
            o_lat = q_lat.new_empty(t - te, h, self.kv_lora_rank)
            be.mla_decode(q_lat, q_pe_d, o_lat, buf, fb, self.scaling, self.kv_scale)
            o[te:] = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return o


def store_latent(buf: torch.Tensor, loc: torch.Tensor, lat: torch.Tensor,
                 kv_scale: float = 1.0) -> None:
    """``buf[loc, 0] = lat``: the new tokens' latent rows ``[T, R + P]`` into one layer's cache
    ``[S, 1, R + P]`` at slots ``loc`` ``[T]`` int64, cast to the cache's dtype; an FP8 cache
    gets ``lat / kv_scale`` clamped to the format's range (+-448 for e4m3: a value past it
    saturates, as the paged pool's Triton store does, instead of becoming NaN) and rounded
    to nearest."""
    if buf.element_size() == 1:
        if kv_scale != 1.0:
            lat = lat.float() * (1.0 / kv_scale)
        top = torch.finfo(buf.dtype).max
        lat = lat.clamp(-top, top)
    buf[loc, 0] = lat.to(buf.dtype)


def latent_rows(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
                kv_scale: float = 1.0) -> torch.Tensor:
    """The cache rows at ``slots`` ``[S]`` int64 as ``[S, R + P]`` in ``dtype``, an FP8 cache's
    dequantized (``stored * kv_scale``)."""
    rows = buf.index_select(0, slots)[:, 0]
    if buf.element_size() == 1 and kv_scale != 1.0:
        return (rows.float() * kv_scale).to(dtype)
    return rows.to(dtype)


def step_requests(fb: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
    """``(rows, seq_lens, ext_lens)`` of the step's requests as host ints (a decode request
    extends by one token)."""
    rows = fb.req_pool_indices.tolist()
    seq = fb.seq_lens_cpu if len(fb.seq_lens_cpu) == fb.batch_size else fb.seq_lens.tolist()
    if fb.is_decode:
        return rows, list(seq), [1] * fb.batch_size
    ext = list(fb.extend_seq_lens_cpu) if fb.extend_seq_lens_cpu \
        else fb.extend_seq_lens.tolist()
    return rows, list(seq), ext + [1] * (fb.batch_size - len(ext))


__all__ = ["MLAttention", "deinterleave", "latent_rows", "mla_softmax_scale", "step_requests",
           "store_latent", "yarn_mscale"]
