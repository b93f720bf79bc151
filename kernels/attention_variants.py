"""The optional attention variants shared by every attention path, host side (torch only).

One definition of what the variants mean, matching HF transformers:

- ``sliding_window`` W >= 1: the query at position p sees keys ``p - W + 1 .. p``, W keys
  with its own (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``);
- ``logit_softcap`` cap > 0: scores ``cap * tanh(s / cap)`` after the scale and before the
  mask (Gemma 2's eager attention);
- ``sinks``: ``[Hq]`` float32, a logit per query head that joins the softmax denominator
  and has no value (gpt-oss: a column appended to the scores, dropped after the softmax);
- a custom scale is the ``sm_scale`` every path already takes (Gemma:
  ``query_pre_attn_scalar ** -0.5``).

Here: their validation (:func:`check_variants`), the references' softmax
(:func:`variant_softmax`, for :mod:`kernels.reference`) and their translation to Triton
launch arguments (:func:`variant_launch_args`, for :mod:`kernels.decode_attention` and
:mod:`kernels.extend_attention`, whose ``@triton.jit`` helpers apply them).
"""

from __future__ import annotations

import torch

_LOG2E = 1.4426950408889634


def check_variants(num_q_heads: int, sliding_window: int | None = None,
                   logit_softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> None:
    """Validate the optional attention variants shared by the references and the kernels.

    Args:
        num_q_heads: Hq of the call.
        sliding_window: W >= 1 keys per query (its own token included), or None.
        logit_softcap: cap > 0, or None.
        sinks: ``[Hq]`` float32 logits, or None.

    Raises:
        ValueError: a window below 1, a non-positive cap, or sinks of another shape/dtype.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0, got {logit_softcap}")
    if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be float32 [{num_q_heads}], got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")


def variant_softmax(s: torch.Tensor, logit_softcap: float | None,
                    hidden: torch.Tensor | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of the scaled fp32 scores ``s``, with the variants in HF's
    order (Gemma 2's eager attention: cap after the scale, then the mask; gpt-oss: the sink
    a last column of the softmax, dropped after it).

    hidden: bool, broadcast to ``s``, True where a key is masked. sinks: fp32 logits shaped
    to broadcast against ``s[..., :1]``.
    """
    if logit_softcap is not None:
        s = torch.tanh(s / logit_softcap) * logit_softcap
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1)
    sink_col = sinks.to(s.dtype).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)[..., :-1]


def variant_launch_args(num_q_heads: int, sm_scale: float, sliding_window: int | None,
                        logit_softcap: float | None,
                        sinks: torch.Tensor | None) -> tuple[tuple, dict]:
    """The attention variants as kernel arguments, shared by the decode and extend kernels.

    Returns ``((qk_scale, window, cap_log2, sinks), constexprs)``: ``qk_scale`` multiplies
    the raw ``q . k`` products (``sm_scale * log2(e)``, or ``sm_scale / cap`` with a
    soft-cap: :func:`kernels.decode_attention.scale_scores`), ``window`` is the window or
    0, ``cap_log2`` the cap in log2 units or 0.0, ``sinks`` the tensor or None; the
    constexprs ``SLIDING``, ``SOFTCAP`` and ``HAS_SINKS`` switch the code in (all off: the
    plain kernel's code).

    Raises:
        ValueError: :func:`check_variants`; sinks must also be
            contiguous.
    """
    check_variants(num_q_heads, sliding_window, logit_softcap, sinks)
    if sinks is not None and sinks.stride(0) != 1:
        raise ValueError("sinks must be contiguous")
    if logit_softcap is None:
        qk_scale, cap_log2 = sm_scale * _LOG2E, 0.0
    else:
        qk_scale, cap_log2 = sm_scale / logit_softcap, logit_softcap * _LOG2E
    constexprs = {"SLIDING": sliding_window is not None, "SOFTCAP": logit_softcap is not None,
                  "HAS_SINKS": sinks is not None}
    return (qk_scale, sliding_window or 0, cap_log2, sinks), constexprs
