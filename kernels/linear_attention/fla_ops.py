"""The gated delta rule on GPUs: flash-linear-attention's Triton kernels (``fla-core``).

Same signatures and semantics as :mod:`kernels.linear_attention.reference` (packed varlen
batches [T, H, D], per-request initial states [B, Hv, K, V] in float32, q scaled by
K ** -0.5 after the L2 norm of q and k; FLA's grouped value heads are the reference's
``repeat_interleave`` of the key heads), so :mod:`kernels.linear_attention` picks one or
the other by device. ``fla`` is imported on first use: the CPU engine never needs it (nor
Triton). ``cu_seqlens`` may be a device tensor (the step's, uploaded once) or host ints;
``cu_seqlens_cpu``, its int64 CPU twin, goes to FLA where its functions take it (FLA then
computes its chunk indices without reading the device tensor back: no host sync).

FLA autotunes its chunked kernels (each a dozen launch configurations, compiled by ptxas)
on first use: on a fresh H200 a cold start spent several minutes there (the server's
warm-up prefill takes it before serving; the GPU tests of 2026-12-03 read it as a hang).
``TRITON_CACHE_AUTOTUNING`` defaults to 1 here, so Triton keeps the chosen configurations
beside its compile cache and a later process on the machine skips the benchmarking.

Raises ImportError (naming the package) on first use where ``fla-core`` is not installed.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence

import torch


def fla_available() -> bool:
    """Whether ``fla-core``'s gated delta rule imports here (it needs Triton)."""
    try:
        _fla()
    except ImportError:
        return False
    return True


def _fla():
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # see the module's docstring
    try:
        from fla.ops.gated_delta_rule import (  # noqa: PLC0415 (lazy: GPU only)
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("the GPU gated delta rule needs fla-core (pip install fla-core)") from exc
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def causal_conv1d_fla(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    activation: str | None = "silu",
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's varlen causal conv1d; as :func:`reference.causal_conv1d_ref` (FLA keeps W
    columns of state where ferry keeps the last W - 1: a zero column goes in front of the
    initial states, and the last W - 1 columns of FLA's final states come back).

    Raises: ImportError without ``fla-core``.
    """
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: PLC0415 (lazy: GPU only)
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("the GPU causal conv1d needs fla-core (pip install fla-core)") from exc
    cu = _cu(cu_seqlens, x.shape[0], x.device)
    channels, width = weight.shape
    n = cu.numel() - 1
    prior = (conv_state.to(x.dtype) if conv_state is not None
             else x.new_zeros(n, channels, width - 1))
    init = torch.cat([prior.new_zeros(n, channels, 1), prior], dim=-1)
    out, final = causal_conv1d(x[None], weight, bias, initial_state=init,
                               output_final_state=True, activation=activation, cu_seqlens=cu,
                               **_twin(causal_conv1d, cu_seqlens_cpu))
    return out[0], final[..., 1:].to(weight.dtype)


@functools.cache
def _takes_cpu_twin(fn) -> bool:
    """Whether FLA's ``fn`` takes ``cu_seqlens_cpu`` (newer fla-core releases do)."""
    try:
        return "cu_seqlens_cpu" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _twin(fn, cu_seqlens_cpu) -> dict:
    return {"cu_seqlens_cpu": cu_seqlens_cpu} \
        if cu_seqlens_cpu is not None and _takes_cpu_twin(fn) else {}


def _cu(cu_seqlens, total: int, device) -> torch.Tensor:
    if cu_seqlens is None:
        return torch.tensor([0, total], dtype=torch.long, device=device)
    if torch.is_tensor(cu_seqlens):
        return cu_seqlens.to(device=device, dtype=torch.long)
    return torch.tensor(list(cu_seqlens), dtype=torch.long, device=device)


def _initial(initial_state, cu: torch.Tensor, hv: int, dk: int, dv: int, device):
    if initial_state is not None:
        return initial_state.float().contiguous()
    return torch.zeros(cu.numel() - 1, hv, dk, dv, dtype=torch.float32, device=device)


def chunk_gated_delta_rule_fla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's chunked gated delta rule; as :func:`reference.chunk_gated_delta_rule_ref`
    (``chunk_size`` is FLA's own, 64, and only 64 is accepted).

    Raises: ValueError for another ``chunk_size``; ImportError without ``fla-core``.
    """
    if chunk_size != 64:
        raise ValueError(f"FLA's chunked gated delta rule runs chunks of 64, not {chunk_size}")
    chunk, _ = _fla()
    cu = _cu(cu_seqlens, v.shape[0], v.device)
    state = _initial(initial_state, cu, v.shape[1], k.shape[-1], v.shape[-1], v.device)
    out, final = chunk(q[None], k[None], v[None], g[None].float(), beta[None].to(q.dtype),
                       initial_state=state, output_final_state=True,
                       use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu,
                       **_twin(chunk, cu_seqlens_cpu))
    return out[0], final.float()


def recurrent_gated_delta_rule_fla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's fused recurrent gated delta rule; as
    :func:`reference.recurrent_gated_delta_rule_ref` (decode: ``cu_seqlens`` None with one
    token per row of ``initial_state``: the B tokens run as B sequences of length 1).

    Raises: ImportError without ``fla-core``.
    """
    _, recurrent = _fla()
    if cu_seqlens is None and initial_state is not None and initial_state.shape[0] == v.shape[0]:
        # one token per request: a batch of B length-1 sequences (no varlen bookkeeping)
        out, final = recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None].float(),
                               beta=beta[:, None].to(q.dtype),
                               initial_state=initial_state.float().contiguous(),
                               output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
        return out[:, 0], final.float()
    cu = _cu(cu_seqlens, v.shape[0], v.device)
    state = _initial(initial_state, cu, v.shape[1], k.shape[-1], v.shape[-1], v.device)
    out, final = recurrent(q[None], k[None], v[None], g=g[None].float(),
                           beta=beta[None].to(q.dtype), initial_state=state,
                           output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                           cu_seqlens=cu)
    return out[0], final.float()
