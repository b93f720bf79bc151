"""Linear-attention ops: the gated delta rule (Qwen3-Next's Gated DeltaNet) and its short conv.

``reference`` holds the pure-torch versions (the CPU path and the semantics): the chunked
gated delta rule for prefill, the per-token recurrence for decode (one batched step when
every request has one token), and the depthwise causal conv1d with its per-request state
(prefill and one-step update), all over packed varlen batches with per-request initial
states. ``fla_ops`` wraps flash-linear-attention's Triton kernels (``fla-core``) behind the
same signatures.

ferry's interface is :func:`chunk_gated_delta_rule` and :func:`recurrent_gated_delta_rule`:
on a CUDA or XPU tensor they run FLA's kernels when ``fla-core`` imports, else (the CPU, or
a GPU without ``fla-core``) the torch reference; :func:`gated_delta_rule_backend` says which.
The decode step over the state pool, :func:`recurrent_gated_delta_rule_update`, runs ferry's
own Triton kernel on CUDA/XPU (``decode_triton``: it updates each request's slot in place,
which FLA's kernels, taking dense states, cannot), the torch reference on the CPU.
:func:`causal_conv1d` (prefill) likewise runs FLA's varlen conv where the rule runs FLA's.
:func:`causal_conv1d_update` (the one-token conv update over gathered states) is the torch
reference everywhere; the layer's decode step on CUDA/XPU instead runs
:func:`gdn_decode_prologue` (``decode_prologue``: one Triton launch for the conv update of
each request's pool slot in place, its SiLU and the gates ``g`` and ``beta``), the torch
reference and gate formulas on the CPU or with ``FERRY_GDN_FUSED_PROLOGUE=0``.

A speculative verify step (n tokens a request: the last token and its drafts) runs the same
two Triton kernels with ``verify_n`` = n: each request's tokens in order from its slot, which
stays as it was, writing the state after each token to a scratch slot of its own
(:func:`recurrent_gated_delta_rule_verify`; the references
:func:`reference.recurrent_gated_delta_rule_verify_ref` and
:func:`reference.causal_conv1d_verify_ref` on the CPU). The commit then copies the state
after the last accepted token into the request's slot (``RecurrentStatePool.commit``).
"""

from __future__ import annotations

import functools

import torch

from kernels.linear_attention.reference import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    causal_conv1d_verify_ref,
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
    recurrent_gated_delta_rule_update_ref,
    recurrent_gated_delta_rule_verify_ref,
)

causal_conv1d_update = causal_conv1d_update_ref


@functools.cache
def _fla_ok() -> bool:
    from kernels.linear_attention.fla_ops import fla_available

    return fla_available()


def gated_delta_rule_backend(device: torch.device | str) -> str:
    """``"fla"`` (fla-core's Triton kernels) on a CUDA/XPU device where fla-core imports,
    else ``"torch"`` (the reference)."""
    kind = torch.device(device).type
    return "fla" if kind in ("cuda", "xpu") and _fla_ok() else "torch"


def causal_conv1d(x, weight, bias=None, **kwargs):
    """The depthwise causal conv1d of a packed varlen batch (prefill); as
    :func:`reference.causal_conv1d_ref`, on FLA's kernel where :func:`gated_delta_rule_backend`
    picks FLA."""
    if gated_delta_rule_backend(x.device) == "fla":
        from kernels.linear_attention.fla_ops import causal_conv1d_fla

        return causal_conv1d_fla(x, weight, bias, **kwargs)
    return causal_conv1d_ref(x, weight, bias, **kwargs)


def chunk_gated_delta_rule(q, k, v, g, beta, **kwargs):
    """The chunked gated delta rule (prefill); arguments and results as
    :func:`reference.chunk_gated_delta_rule_ref`, run by :func:`gated_delta_rule_backend`."""
    if gated_delta_rule_backend(q.device) == "fla":
        from kernels.linear_attention.fla_ops import chunk_gated_delta_rule_fla

        return chunk_gated_delta_rule_fla(q, k, v, g, beta, **kwargs)
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, **kwargs)


def recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs):
    """The token-by-token gated delta rule (decode); as
    :func:`reference.recurrent_gated_delta_rule_ref`, run by :func:`gated_delta_rule_backend`."""
    if gated_delta_rule_backend(q.device) == "fla":
        from kernels.linear_attention.fla_ops import recurrent_gated_delta_rule_fla

        return recurrent_gated_delta_rule_fla(q, k, v, g, beta, **kwargs)
    return recurrent_gated_delta_rule_ref(q, k, v, g, beta, **kwargs)


def recurrent_gated_delta_rule_update(q, k, v, g, beta, states, slots, use_qk_l2norm=True):
    """One decode step of B requests over the state pool, in place; as
    :func:`reference.recurrent_gated_delta_rule_update_ref` (Triton on CUDA/XPU)."""
    if q.device.type in ("cuda", "xpu"):
        from kernels.linear_attention.decode_triton import (
            recurrent_gated_delta_rule_update_triton,
        )

        return recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, states, slots,
                                                        use_qk_l2norm)
    return recurrent_gated_delta_rule_update_ref(q, k, v, g, beta, states, slots, use_qk_l2norm)


def recurrent_gated_delta_rule_verify(q, k, v, g, beta, states, slots, n, dst_base,
                                      use_qk_l2norm=True):
    """A verify step's gated delta rule over the state pool: requests of ``n`` rows each,
    the state after each row into scratch slot ``dst_base + row``; as
    :func:`reference.recurrent_gated_delta_rule_verify_ref` (Triton on CUDA/XPU)."""
    if q.device.type in ("cuda", "xpu"):
        from kernels.linear_attention.decode_triton import (
            recurrent_gated_delta_rule_update_triton,
        )

        return recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, states, slots,
                                                        use_qk_l2norm, n, dst_base)
    return recurrent_gated_delta_rule_verify_ref(q, k, v, g, beta, states, slots, n, dst_base,
                                                 use_qk_l2norm)


def gdn_decode_prologue(x, conv_states, slots, weight, a, b, A_log, dt_bias, verify_n=0,
                        dst_base=0):
    """One decode token's conv update (in place at ``slots``), SiLU and gates in one Triton
    launch; arguments and results as :func:`decode_prologue.gdn_decode_prologue` (no torch
    fallback: the layer keeps the references where Triton does not run)."""
    from kernels.linear_attention.decode_prologue import gdn_decode_prologue as prologue

    return prologue(x, conv_states, slots, weight, a, b, A_log, dt_bias, verify_n, dst_base)


__all__ = [
    "causal_conv1d",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "causal_conv1d_verify_ref",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "gated_delta_rule_backend",
    "gdn_decode_prologue",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_ref",
    "recurrent_gated_delta_rule_update",
    "recurrent_gated_delta_rule_update_ref",
    "recurrent_gated_delta_rule_verify",
    "recurrent_gated_delta_rule_verify_ref",
]
