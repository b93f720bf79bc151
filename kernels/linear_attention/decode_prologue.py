"""The Gated DeltaNet decode prologue in one Triton launch: the short conv's one-token update
over the state pool, its SiLU, and the gates ``g`` and ``beta``.

A decode step of a Gated DeltaNet layer (``engine/layers/gated_deltanet.py``) needs, before
the recurrent update (``decode_triton``), the conv output of each request's new q|k|v input
and its gates. In torch that is a dozen small kernels per layer: the gather of the B conv
states by slot, the depthwise conv (``F.conv1d``), the concatenation, the SiLU, the state
shift, the scatter back, and five or six elementwise ops for the gates. This kernel does all
of it in one launch, reading and writing each request's slot of the pool in place.

Semantics: :func:`kernels.linear_attention.reference.causal_conv1d_update_ref` (no bias,
activation SiLU) on ``conv_states[slots]`` written back, ``beta = sigmoid(b)`` and
``g = -exp(A_log) * softplus(a + dt_bias)`` (float32; softplus is ``x`` above 20, as
torch's). Arithmetic is float32; the conv output is rounded once to x's dtype (the reference
rounds the conv in the weight's dtype before the SiLU, so bf16 results differ by an ulp).

Grid ``(B, cdiv(C, BLOCK_C))``: program (b, j) shifts channels ``[j BLOCK_C, (j+1) BLOCK_C)``
of slot ``slots[b]`` and writes their outputs; the programs with j == 0 also write row b's
gates. Each channel's W - 1 state taps are loaded as 1-D vectors of one layout, so every
element is read and rewritten by the same thread (no race between the shift's loads and
stores); BLOCK_C is at least the program's thread count so no element is replicated.
Shapes come from the tensors only (nothing is read back to the host): a CUDA graph
captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: channels per program (>= 32 * num_warps: see the module docstring)
BLOCK_C = 256
NUM_WARPS = 4


@triton.jit
def _gdn_decode_prologue_kernel(
        x_ptr, state_ptr, slot_ptr, w_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr,
        out_ptr, g_ptr, beta_ptr,
        C, HV, dst_base, stride_x, stride_ss, stride_sc, stride_sw, stride_wc, stride_a,
        stride_b, stride_out, W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
        N: tl.constexpr, VERIFY: tl.constexpr):
    req = tl.program_id(0)
    blk = tl.program_id(1)
    src = tl.load(slot_ptr + req * N).to(tl.int64)
    slot = src
    offs = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < C
    w_row = w_ptr + offs * stride_wc
    for t in tl.static_range(N):
        row = req * N + t
        if VERIFY:  # the state after each of the N tokens goes to its own scratch slot
            dst = (dst_base + row).to(tl.int64)
        else:
            dst = slot
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        acc = x.to(tl.float32) * tl.load(w_row + (W - 1), mask=mask, other=0.0).to(tl.float32)
        s_src = state_ptr + src * stride_ss + offs * stride_sc
        s_dst = state_ptr + dst * stride_ss + offs * stride_sc
        # tap j of the state (oldest first) meets weight j; it moves to tap j - 1 once read
        for j in tl.static_range(W - 1):
            s = tl.load(s_src + j * stride_sw, mask=mask, other=0.0)
            acc += s.to(tl.float32) * tl.load(w_row + j, mask=mask, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(s_dst + (j - 1) * stride_sw, s, mask=mask)
        tl.store(s_dst + (W - 2) * stride_sw, x.to(state_ptr.dtype.element_ty), mask=mask)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty),
                 mask=mask)
        src = dst
    if blk == 0:
        h = tl.arange(0, BLOCK_H)
        hm = h < HV
        dtb = tl.load(dtb_ptr + h, mask=hm, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(alog_ptr + h, mask=hm, other=0.0).to(tl.float32))
        for t in tl.static_range(N):
            row = req * N + t
            bv = tl.load(b_ptr + row * stride_b + h, mask=hm, other=0.0).to(tl.float32)
            beta = 1.0 / (1.0 + tl.exp(-bv))
            tl.store(beta_ptr + row * HV + h, beta.to(beta_ptr.dtype.element_ty), mask=hm)
            av = tl.load(a_ptr + row * stride_a + h, mask=hm, other=0.0).to(tl.float32) + dtb
            soft = tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(tl.minimum(av, 20.0))))
            tl.store(g_ptr + row * HV + h, -decay * soft, mask=hm)


def gdn_decode_prologue(
    x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    verify_n: int = 0, dst_base: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token for each of B requests: conv update in place, SiLU and the gates.

    With ``verify_n`` = n > 0 (a speculative verify step): the B rows are B / n requests of n
    consecutive tokens each; request r starts from ``conv_states[slots[r * n]]`` (left as it
    is) and the state after its token t is written to slot ``dst_base + r * n + t`` (the
    pool's scratch slots, ``RecurrentStatePool.scratch_base``), so that the commit can
    copy the one after the last accepted token.

    Args:
        x: [B, C] each request's new conv input (the q|k|v projection; model dtype; rows
            strided, channels contiguous).
        conv_states: [S, C, W - 1] the pool's conv states (any dtype and strides); the B
            rows ``conv_states[slots]`` advance by one input in place, the others untouched.
        slots: [B] int, each request's slot (distinct, except padded rows, whose slot's
            state becomes garbage as with the reference).
        weight: [C, W] the depthwise taps (W >= 2).
        a, b: [B, Hv] the gate projections (rows strided, heads contiguous).
        A_log, dt_bias: [Hv] per value head (contiguous).
    Returns:
        ``(out [B, C] in x's dtype, g [B, Hv] float32, beta [B, Hv] in b's dtype)``:
        ``out = silu(conv)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta =
        sigmoid(b)``.
    Raises:
        ValueError: mismatched channels, a conv width below 2, state taps not W - 1, or
            rows not a multiple of ``verify_n``.
    """
    batch, channels = x.shape
    width = weight.shape[1]
    if weight.shape[0] != channels or conv_states.shape[1] != channels:
        raise ValueError(f"conv channels disagree: x {channels}, weight {weight.shape[0]}, "
                         f"states {conv_states.shape[1]}")
    if width < 2 or conv_states.shape[2] != width - 1:
        raise ValueError(f"conv width {width} needs states of {width - 1} taps (>= 1), not "
                         f"{conv_states.shape[2]}")
    hv = a.shape[1]
    n = verify_n or 1
    if batch % n:
        raise ValueError(f"{batch} rows are not requests of {n} tokens")
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    g = torch.empty(batch, hv, dtype=torch.float32, device=x.device)
    beta = torch.empty(batch, hv, dtype=b.dtype, device=x.device)
    if batch == 0:
        return out, g, beta
    grid = (batch // n, triton.cdiv(channels, BLOCK_C))
    _gdn_decode_prologue_kernel[grid](
        x, conv_states, slots, weight, a, b, A_log.contiguous(), dt_bias.contiguous(),
        out, g, beta,
        channels, hv, dst_base, x.stride(0), conv_states.stride(0), conv_states.stride(1),
        conv_states.stride(2), weight.stride(0), a.stride(0), b.stride(0), out.stride(0),
        W=width, BLOCK_C=BLOCK_C, BLOCK_H=triton.next_power_of_2(hv), N=n,
        VERIFY=verify_n > 0, num_warps=NUM_WARPS)
    return out, g, beta
