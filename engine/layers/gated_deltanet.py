"""Qwen3-Next's Gated DeltaNet layer (a linear-attention token mixer with a recurrent state).

Matches HF ``Qwen3NextGatedDeltaNet``: ``in_proj_qkvz`` and ``in_proj_ba`` project the hidden
states (grouped per key head: q, k, v, z and b, a of its value heads; with
``split_projections``, Qwen3.5's ``Qwen3_5GatedDeltaNet``: ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b`` and ``in_proj_a``, each flat), a depthwise causal
conv1d (width W, SiLU) runs over the concatenated q|k|v, the gated delta rule mixes the
tokens (q and k L2-normed; ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta =
sigmoid(b)``), a gated RMSNorm per value head (gate z) and ``out_proj`` give the output.

Per request the layer keeps a conv state [C, W - 1] and a recurrent state [Hv, K, V] in
the recurrent-state pool (``engine.kv.state_pool``); :class:`LinearStateBatch` tells the
layer which slot each request of the step owns. Prefill (or a prefill chunk) continues from
the slot's state and writes the final state back; decode advances one token per request.
The ops come from ``kernels.linear_attention`` (fla-core's Triton kernels on CUDA/XPU where
it imports, the torch references otherwise). On CUDA/XPU a decode step's prologue (the
conv update of each slot's conv state in place, its SiLU, and the gates) is one Triton
launch, :func:`kernels.linear_attention.gdn_decode_prologue` (``FERRY_GDN_FUSED_PROLOGUE=0``
keeps the torch gather, conv update, scatter and gate ops, as on the CPU). A mixed step
(prefill chunks followed by ``num_decodes`` one-token decodes) runs its prefill part through
the chunked rule and its decode tail through one batched recurrent step that updates each
request's slot in place.

Tensor parallelism splits the heads: rank r of N holds key heads ``[r Hk/N, (r+1) Hk/N)``
and the ``Hv/Hk`` value heads grouped with each (value head j reads key head
``j // (Hv/Hk)``, so a rank's value heads are ``[r Hv/N, (r+1) Hv/N)``). Qwen3-Next's
``in_proj_qkvz``/``in_proj_ba`` rows are grouped per key head, so a rank's rows are one
contiguous block (:class:`ColumnParallelLinear`); Qwen3.5's flat ``in_proj_qkv`` packs
``[q | k | v]``, each part split (:class:`PackedColumnLinear`), its ``in_proj_z``/``_b``/``_a``
are split by value head; ``conv1d`` keeps the channels of the rank's q, k and v,
``A_log``/``dt_bias`` its value heads; the gated norm's weight (one head's) is replicated;
``out_proj`` is row-parallel (one all-reduce). The rank's pool slots hold only its heads'
states (``RecurrentStateSpec.per_rank``). Head counts that ``tp_size`` does not divide are
refused (:func:`check_tp_heads`).

Speculative verify steps (``LinearStateBatch.verify_n`` = n): a verify step scores ``[last
token, d1..dk]`` (and padding rows up to n) per request as DECODE rows, but the state a
request must keep is the one after its last ACCEPTED token, known only after the step. The
layer runs each request's n rows in order from its slot, which it leaves as it is, and
writes the conv and recurrent states after each row r to the pool's scratch slot
``scratch_base + r`` (the decode kernels with ``verify_n``: one launch each for the whole
step, so a decode graph captures it); ``RecurrentStatePool.commit`` then copies the state
after each request's last accepted row into its slot. Scratch memory: a state per row of the
largest verify step (``Hv * K * V`` float32: 2 MiB per layer and row at Qwen3.5-35B-A3B's
32 x 128 x 128, 60 MiB per row over its 30 linear layers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp
from engine.layers.linear import (
    ColumnParallelLinear,
    PackedColumnLinear,
    RowParallelLinear,
    full_tensor,
    narrow_parts,
)
from engine.layers.norm import GatedRMSNorm
from kernels.linear_attention import (
    causal_conv1d,
    causal_conv1d_update,
    causal_conv1d_verify_ref,
    chunk_gated_delta_rule,
    gated_delta_rule_backend,
    gdn_decode_prologue,
    recurrent_gated_delta_rule_update,
    recurrent_gated_delta_rule_verify,
)

#: ``FERRY_GDN_FUSED_PROLOGUE=0`` keeps the torch decode prologue (gather, conv update,
#: scatter, gates) on CUDA/XPU too; by default a decode step there runs
#: :func:`kernels.linear_attention.gdn_decode_prologue` (one launch).
FUSED_PROLOGUE = os.environ.get("FERRY_GDN_FUSED_PROLOGUE", "1") != "0"

def fused_prologue(device: torch.device) -> bool:
    """Whether a decode step on ``device`` runs the fused Triton prologue (CUDA/XPU, switch
    on); the CPU keeps the torch references."""
    return FUSED_PROLOGUE and device.type in ("cuda", "xpu")


@dataclass
class LinearStateBatch:
    """One step's view of the recurrent-state pool for a linear layer.

    Attributes:
        conv_states: the layer's pool tensor [slots + 1, C, W - 1] (updated in place).
        recurrent_states: the layer's pool tensor [slots + 1, Hv, K, V] float32 (in place).
        slots: [B] int64, each request's slot (requests in batch order).
        cu_seqlens: B + 1 cumulative token counts of the step's requests (host ints).
        decode: every request has exactly one new token (the recurrent kernels run).
        num_decodes: with ``decode`` False, the last ``num_decodes`` requests are one-token
            decodes (a mixed step): they run the recurrent step, the others the chunked rule.
        cu_seqlens_dev: ``cu_seqlens`` as an int64 device tensor (for the GPU kernels), or None.
        verify_n: a speculative verify step's rows per request (module docstring; ``slots``
            then holds one slot per row, the request's on each of its rows), 0 otherwise.
        scratch_base: the pool's first scratch slot (a verify step's per-row states).
        prefill_cu: the prefill rows' cumulative counts as (int64 device tensor, int64 CPU
            tensor), the same objects in every layer of the step
            (``RecurrentStateView.prefill_cu``), or None.
    """

    conv_states: torch.Tensor
    recurrent_states: torch.Tensor
    slots: torch.Tensor
    cu_seqlens: list[int]
    decode: bool
    num_decodes: int = 0
    cu_seqlens_dev: torch.Tensor | None = None
    verify_n: int = 0
    scratch_base: int = 0
    prefill_cu: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """Head counts and sizes of a Gated DeltaNet layer (HF's ``linear_*`` config fields)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_width: int
    eps: float

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def conv_parts(self) -> list[int]:
        """The conv's channels of q, k and v (``[Hk*K, Hk*K, Hv*V]``)."""
        key_dim = self.num_k_heads * self.k_head_dim
        return [key_dim, key_dim, self.num_v_heads * self.v_head_dim]

    def per_rank(self, tp_size: int) -> GatedDeltaNetDims:
        """One of ``tp_size`` ranks' heads (:func:`check_tp_heads` first)."""
        return replace(self, num_k_heads=self.num_k_heads // tp_size,
                       num_v_heads=self.num_v_heads // tp_size)


def check_tp_heads(dims: GatedDeltaNetDims, tp_size: int) -> None:
    """Refuse linear-attention head counts that ``tp_size`` ranks cannot split.

    Raises:
        ValueError: one line naming ``--tp-size`` and the config field.
    """
    for n, field in ((dims.num_k_heads, "linear_num_key_heads"),
                     (dims.num_v_heads, "linear_num_value_heads")):
        if n % tp_size:
            raise ValueError(f"--tp-size {tp_size} does not divide the model's {n} "
                             f"linear-attention heads ({field}): each rank holds whole "
                             "Gated DeltaNet heads")


def checkpoint_shapes(dims: GatedDeltaNetDims, split_projections: bool
                      ) -> dict[str, tuple[int, ...]]:
    """The full (unsplit) checkpoint shape of each Gated DeltaNet tensor, by its name under
    ``linear_attn.`` (dummy weights are drawn at these, the same model at every TP size)."""
    d, h = dims, dims.hidden_size
    key_dim, value_dim = d.num_k_heads * d.k_head_dim, d.num_v_heads * d.v_head_dim
    if split_projections:
        proj = {"in_proj_qkv.weight": (2 * key_dim + value_dim, h),
                "in_proj_z.weight": (value_dim, h), "in_proj_b.weight": (d.num_v_heads, h),
                "in_proj_a.weight": (d.num_v_heads, h)}
    else:
        proj = {"in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, h),
                "in_proj_ba.weight": (2 * d.num_v_heads, h)}
    return {**proj, "conv1d.weight": (d.conv_dim, 1, d.conv_width),
            "dt_bias": (d.num_v_heads,), "A_log": (d.num_v_heads,),
            "norm.weight": (d.v_head_dim,), "out_proj.weight": (h, value_dim)}


def _rank_param(shape: tuple[int, ...], dtype: torch.dtype, fill: float, loader
                ) -> nn.Parameter:
    p = nn.Parameter(torch.full(shape, fill, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class _Conv(nn.Module):
    """Holds the rank's channels of the checkpoint's ``conv1d.weight`` [C, 1, W] (no bias in
    Qwen3-Next): its share of the q, k and v channels (``parts``: their full counts)."""

    def __init__(self, parts: list[int], width: int, dtype: torch.dtype, tp_size: int,
                 tp_rank: int):
        super().__init__()
        self.parts, self.tp_size, self.tp_rank = parts, tp_size, tp_rank
        self.weight = _rank_param((sum(parts) // tp_size, 1, width), dtype, 0.0,
                                  self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """``loaded`` [C, 1, W] (full) -> this rank's channels. Raises ValueError: a shape
        other than the full conv's."""
        want = (sum(self.parts), *param.shape[1:])
        if tuple(loaded.shape) != want:
            raise ValueError(f"conv1d: checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected {want}")
        param.data.copy_(narrow_parts(loaded, self.parts, self.tp_size, self.tp_rank))


class GatedDeltaNet(nn.Module):
    """``forward(x [T, hidden], state: LinearStateBatch) -> [T, hidden]`` in x's dtype.

    Args:
        dims: the whole layer's heads (the config's); ``self.dims`` is this rank's.
        dtype: the weights' dtype.
        split_projections: Qwen3.5's four projections (else Qwen3-Next's two grouped ones).
        tp_size, tp_rank: the tensor-parallel group (default :func:`get_tp`'s).

    Raises:
        ValueError: value heads not a multiple of key heads, or head counts ``tp_size``
            does not divide (:func:`check_tp_heads`).
    """

    def __init__(self, dims: GatedDeltaNetDims, dtype: torch.dtype,
                 split_projections: bool = False, tp_size: int | None = None,
                 tp_rank: int | None = None):
        super().__init__()
        if dims.num_v_heads % dims.num_k_heads:
            raise ValueError(f"Gated DeltaNet: {dims.num_v_heads} value heads are not a "
                             f"multiple of {dims.num_k_heads} key heads")
        g = get_tp()
        tp = self.tp_size = g.size if tp_size is None else tp_size
        self.tp_rank = rank = g.rank if tp_rank is None else tp_rank
        check_tp_heads(dims, tp)
        self.dims = d = dims.per_rank(tp)     # this rank's heads
        h, (key_dim, _, value_dim) = dims.hidden_size, dims.conv_parts   # the whole layer's
        self.split_projections = split_projections
        if split_projections:   # Qwen3.5: q|k|v, z, b and a each from their own projection
            self.in_proj_qkv = PackedColumnLinear(h, dims.conv_parts, False, dtype, tp, rank)
            self.in_proj_z = ColumnParallelLinear(h, value_dim, False, dtype, tp, rank)
            self.in_proj_b = ColumnParallelLinear(h, dims.num_v_heads, False, dtype, tp, rank)
            self.in_proj_a = ColumnParallelLinear(h, dims.num_v_heads, False, dtype, tp, rank)
        else:                   # Qwen3-Next: grouped per key head in two projections
            self.in_proj_qkvz = ColumnParallelLinear(h, 2 * key_dim + 2 * value_dim, False,
                                                     dtype, tp, rank)
            self.in_proj_ba = ColumnParallelLinear(h, 2 * dims.num_v_heads, False, dtype, tp,
                                                   rank)
        self.conv1d = _Conv(dims.conv_parts, d.conv_width, dtype, tp, rank)
        self.dt_bias = _rank_param((d.num_v_heads,), dtype, 1.0, self._head_loader)
        self.A_log = _rank_param((d.num_v_heads,), dtype, 0.0, self._head_loader)
        self.norm = GatedRMSNorm(d.v_head_dim, d.eps, dtype)
        self.out_proj = RowParallelLinear(value_dim, h, False, dtype, tp, rank)

    def _head_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """A per-value-head tensor (``A_log``, ``dt_bias``: [Hv] full) -> this rank's
        heads. Raises ValueError: a shape other than [Hv]."""
        n = param.shape[0]
        if tuple(loaded.shape) != (n * self.tp_size,):
            raise ValueError(f"per-head tensor has shape {tuple(loaded.shape)}, expected "
                             f"{(n * self.tp_size,)}")
        param.data.copy_(full_tensor(loaded.narrow(0, self.tp_rank * n, n)))

    def _split(self, x: torch.Tensor):
        """HF's per-key-head grouping -> q|k|v [T, C], z [T, Hv, V], b and a [T, Hv]."""
        d, t = self.dims, x.shape[0]
        if self.split_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, d.num_v_heads, d.v_head_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        per = d.num_v_heads // d.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, d.num_k_heads, -1)
        ba = self.in_proj_ba(x).view(t, d.num_k_heads, 2 * per)
        q, k, v, z = torch.split(
            qkvz, [d.k_head_dim, d.k_head_dim, per * d.v_head_dim, per * d.v_head_dim], dim=2)
        b, a = torch.split(ba, [per, per], dim=2)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (mixed, z.reshape(t, d.num_v_heads, d.v_head_dim),
                b.reshape(t, d.num_v_heads), a.reshape(t, d.num_v_heads))

    def forward(self, x: torch.Tensor, state: LinearStateBatch) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self._split(x)
        if state.verify_n:  # rows of n per request: per-row states into the scratch slots
            return self.out_proj(self.norm(self._verify(mixed, a, b, state), z).reshape(t, -1))
        n = len(state.cu_seqlens) - 1
        n_dec = n if state.decode else state.num_decodes
        n_ext = n - n_dec
        cut = state.cu_seqlens[n_ext]          # the decode tail's first token
        fused = n_dec > 0 and fused_prologue(x.device)   # the tail's gates come from the kernel
        gate_rows = cut if fused else t
        g, beta = self._gates(a[:gate_rows], b[:gate_rows]) if gate_rows else (None, None)
        parts = []
        if n_ext:
            cu, cu_cpu = self._prefill_cu(state, n_ext, x.device)
            parts.append(self._mix(mixed[:cut], g[:cut], beta[:cut], state, state.slots[:n_ext],
                                   cu, cu_cpu=cu_cpu))
        if fused:
            slots = state.slots[n_ext:]
            conv, g_dec, beta_dec = gdn_decode_prologue(
                mixed[cut:], state.conv_states, slots, self.conv1d.weight.squeeze(1), a[cut:],
                b[cut:], self.A_log, self.dt_bias)
            parts.append(self._rule(conv, g_dec, beta_dec, state, slots, None))
        elif n_dec:
            parts.append(self._mix(mixed[cut:], g[cut:], beta[cut:], state, state.slots[n_ext:],
                                   None))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(t, -1))

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g [T, Hv] float32, beta [T, Hv] in b's dtype)`` from ``a``, ``b`` [T, Hv]:
        ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (torch)."""
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return g, beta

    @staticmethod
    def _prefill_cu(state: LinearStateBatch, n_ext: int, device: torch.device):
        """``(cu, cu_cpu)`` of the step's first ``n_ext`` requests (its prefill rows): host
        ints and None for the torch reference; for FLA's kernels the step's device tensor and
        its CPU twin, the same objects in every layer, so FLA computes its chunk indices
        once a step (it caches them by tensor identity) and, given the CPU twin, without a
        host sync (one in each kernel of each layer otherwise, which also stalls the
        overlap scheduler's next step)."""
        if gated_delta_rule_backend(device) != "fla":
            return state.cu_seqlens[:n_ext + 1], None
        if state.prefill_cu is not None:
            return state.prefill_cu
        cu_dev = state.cu_seqlens_dev
        return (cu_dev[:n_ext + 1] if cu_dev is not None else state.cu_seqlens[:n_ext + 1],
                None)

    def _verify(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                state: LinearStateBatch) -> torch.Tensor:
        """A verify step's conv and gated delta rule (module docstring): each request's
        ``state.verify_n`` rows from its slot, the states after each row into the scratch
        slots; returns [T, Hv, V]."""
        n, base, weight = state.verify_n, state.scratch_base, self.conv1d.weight.squeeze(1)
        if fused_prologue(mixed.device):
            conv, g, beta = gdn_decode_prologue(mixed, state.conv_states, state.slots, weight,
                                                a, b, self.A_log, self.dt_bias, n, base)
        else:
            g, beta = self._gates(a, b)
            conv = causal_conv1d_verify_ref(mixed, state.conv_states, state.slots, weight, n,
                                            base)
        q, k, v = self._heads(conv)
        return recurrent_gated_delta_rule_verify(q, k, v, g, beta, state.recurrent_states,
                                                 state.slots, n, base)

    def _mix(self, mixed, g, beta, state: LinearStateBatch, slots: torch.Tensor,
             cu, cu_cpu: torch.Tensor | None = None) -> torch.Tensor:
        """Conv and gated delta rule of one part of the step from the ``slots``' states,
        which are written back: prefills (``cu``: the part's cumulative token counts, host
        ints or, for FLA's kernels, a device tensor, with ``cu_cpu`` its CPU twin or None) or
        one-token decodes (``cu`` None: nothing here reads the host, so a decode graph
        captures it); returns [T', Hv, V]."""
        weight = self.conv1d.weight.squeeze(1)
        conv_state = state.conv_states[slots]
        twin = {} if cu_cpu is None else {"cu_seqlens_cpu": cu_cpu}
        if cu is None:
            mixed = causal_conv1d_update(mixed, conv_state, weight, None, "silu")
        else:
            mixed, conv_state = causal_conv1d(mixed, weight, None, conv_state=conv_state,
                                              cu_seqlens=cu, **twin)
        state.conv_states[slots] = conv_state.to(state.conv_states.dtype)
        return self._rule(mixed, g, beta, state, slots, cu, twin)

    def _heads(self, conv: torch.Tensor):
        """The conv output [T, C] as q, k [T, Hk, K] and v [T, Hv, V] (views)."""
        d, t = self.dims, conv.shape[0]
        key_dim = d.num_k_heads * d.k_head_dim
        q, k, v = torch.split(conv, [key_dim, key_dim, d.num_v_heads * d.v_head_dim], dim=-1)
        return (q.reshape(t, d.num_k_heads, d.k_head_dim),
                k.reshape(t, d.num_k_heads, d.k_head_dim),
                v.reshape(t, d.num_v_heads, d.v_head_dim))

    def _rule(self, mixed, g, beta, state: LinearStateBatch, slots: torch.Tensor, cu,
              twin: dict | None = None) -> torch.Tensor:
        """The gated delta rule of :meth:`_mix` from the conv output ``mixed`` [T', C]:
        one batched recurrent step (``cu`` None, each slot updated in place) or the chunked
        rule from the slots' states, written back (``twin``: the chunked kernels' extra
        keywords); returns [T', Hv, V]."""
        q, k, v = self._heads(mixed)
        if cu is None:  # each request's slot updated in place (no gather/scatter on GPUs)
            return recurrent_gated_delta_rule_update(q, k, v, g, beta, state.recurrent_states,
                                                     slots)
        out, final = chunk_gated_delta_rule(q, k, v, g, beta,
                                            initial_state=state.recurrent_states[slots],
                                            cu_seqlens=cu, **(twin or {}))
        state.recurrent_states[slots] = final
        return out
