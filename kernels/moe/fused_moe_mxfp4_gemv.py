"""gpt-oss's MXFP4 MoE experts at decode batch sizes as two GEMV-shaped Triton launches
(CUDA, XPU; the interpreter on the CPU): no alignment, no ``tl.dot``, the activation in the
gate/up epilogue and the top-k sum in the down kernel.

The grouped GEMM of :mod:`kernels.moe.fused_moe_mxfp4` pads each expert's rows to a 16-row
``tl.dot`` tile: at M = 1 (four routed pairs) it computes 16 rows to keep one and runs six
launches (two alignment, two GEMMs, the activation, the top-k sum). At
``M <= GEMV_MAX_M`` :func:`fused_moe_oai_gemv` runs instead:

1. :func:`_gemv_gate_up_kernel`, one program per ``(pair t, block of BLOCK_N of I)``: the
   pair's expert (its id, or routed from the token's router logits), the token row
   ``x[t // top_k]``, and the ``BLOCK_N`` gate rows ``n`` and up rows ``I + n`` of the
   expert's ``w13`` (ferry's layout: the checkpoint's interleaved gate/up rows are
   de-interleaved at load, :func:`engine.models.gpt_oss.load_gptoss_expert`), as one
   ``[2, BLOCK_N]`` row tile. Per K step of ``BLOCK_K`` (:func:`_gemv_rows`) it loads each
   row's ``BLOCK_K / 2`` packed e2m1 bytes as a ``[2, BLOCK_N, BLOCK_K/32, 16]`` tile
   (16-byte vectors, K-contiguous) and its ``[2, BLOCK_N, BLOCK_K/32]`` e8m0 scales, the
   next step's bytes before this step's math (a register double buffer), decodes the
   nibbles in registers (:func:`e2m1_halves`, the bit arithmetic of the grouped kernel),
   multiplies them by the even / odd activations, sums each group of 32 in fp32, scales the
   group sum by its power of two, and sums the groups (no ``tl.dot``). Then the
   bias (``[E, 2I]``), the activation (gpt-oss's clamped SwiGLU, or SwiGLU / GeGLU) in
   fp32, and one store of ``act[t]`` in the activations' dtype. A pair whose id is outside
   ``[0, E)`` (another rank's expert) returns at once.
2. :func:`_gemv_down_kernel`, one program per ``(token m, block of BLOCK_N of H)``: per K
   step the tiles of all ``top_k`` pairs as one ``[BLOCK_P, BLOCK_N]`` row tile (each pair
   with its own row of ``act``), each pair's row sums plus its
   down bias times its routed weight, summed in k order in fp32 (deterministic, no
   atomics), stored once. A dropped pair reads nothing.

The arithmetic is the grouped path's except for rounding (gate/up and each routed down term
stay fp32 here; the grouped path rounds them to the activations' dtype). The only workspace
is ``act [M * top_k, I]``; no host sync: graph capturable. No split-K: at M = 1 the rows
alone give 720 programs a launch at gpt-oss's shape (:func:`gemv_tiles`).

``FERRY_MXFP4_GEMV_MAX_M`` (default 4; 0 turns the path off) is the largest M that takes
it; ``FERRY_MXFP4_GEMV_TILES`` = ``target_programs,block_k`` (default ``528,256``) sets the
tile choice (528,256 measured best on the H200 at M = 1, 2, 4: 61.6 / 112.7 / 222.0 us at
the 120b shape against 83.6 / 160.7 / 299.9 with 528,512). ``FERRY_MXFP4_GEMV_ROUTE=1``
makes the engine's layer route inside the GEMV programs (two launches) instead of with
``fused_topk`` first (three; the default: routing in every program measured 1.1-1.2x
slower on the H200, 97.1 against 87.1 us at M = 1; :func:`gemv_self_routes`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.moe.routing import pair_expert, route_row

#: the largest batch that runs the GEMV path (environment override; 0: never)
GEMV_MAX_M = max(0, int(os.environ.get("FERRY_MXFP4_GEMV_MAX_M", "4")))

#: whether the engine's layer routes inside the GEMV kernels (two launches) rather than
#: with ``fused_topk`` first (three, the default; environment override, 1: the former)
GEMV_SELF_ROUTE = os.environ.get("FERRY_MXFP4_GEMV_ROUTE", "0") == "1"

#: tiles: aim for this many programs a launch (4 per SM of an H200's 132), and this K step
TARGET_PROGRAMS, BLOCK_K = (int(v) for v in os.environ.get(
    "FERRY_MXFP4_GEMV_TILES", "528,256").split(","))

#: the largest weight tile a program loads per K step (bytes): 8 warps x 32 bytes a thread
#: (wider tiles cost registers: on sm_90 the down kernel's 16 x 4 pairs x 256 bytes took 215)
MAX_STEP_BYTES = 8192

#: the activation codes of the gate/up kernel
_ACTS = {"silu": 0, "swiglu_oai": 1, "gelu_tanh": 2}


def use_gemv_path(m: int) -> bool:
    """Whether :func:`kernels.moe.fused_moe_mxfp4.fused_moe_oai` runs M rows of MXFP4 experts
    on the GEMV path."""
    return 0 < m <= GEMV_MAX_M


def gemv_self_routes(m: int) -> bool:
    """Whether the engine's MoE layer (``route_and_run``) runs M rows of MXFP4 experts with
    :func:`fused_moe_oai_gemv_routed` (the GEMV path, routing in its programs: each
    program's softmax and top-k over the E logits precede its first weight load); else
    ``fused_topk`` and then :func:`kernels.moe.fused_moe_mxfp4.fused_moe_oai`."""
    return GEMV_SELF_ROUTE and use_gemv_path(m)


@triton.jit
def e2m1_halves(byte):
    """MXFP4 bytes (any int tensor, 0..255) -> ``(low nibble, high nibble)`` as fp32
    ``value * 2^-14``, exact: the nibble ``s e1 e0 m`` moved to fp16's sign bit and the top
    three mantissa bits is that fp16 number (e == 0: a subnormal). Both nibbles at once,
    one fp16 pattern per 16-bit half of a 32-bit word (the shifted copies of a byte do not
    overlap, so each product is the two shifts at once)."""
    b = byte.to(tl.uint32)
    word = ((b * 0x200200) & 0x0E000E00) | ((b * 0x1001000) & 0x80008000)
    lo = (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (word >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def e8m0_times_2_14(scale_byte):
    """e8m0 scale bytes -> the fp32 ``2^(s - 127) * 2^14`` (undoes :func:`e2m1_halves`'
    2^-14), built from its exponent field; exact for bytes 0..240, inf above."""
    return (tl.minimum(scale_byte.to(tl.int32) + 14, 255) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _tile_load(b_rows, s_rows, ok, g_left, BLOCK_K: tl.constexpr):
    """One K step's MXFP4 bytes ``[P, BLOCK_N, BLOCK_K/32, 16]`` (16-byte vectors along K)
    and e8m0 scales ``[P, BLOCK_N, BLOCK_K/32]`` of ``[P, BLOCK_N]`` rows (``b_rows`` /
    ``s_rows``: each row's first byte / scale of the step): the rows where ``ok`` is false
    and the groups from ``g_left`` on read nothing (zero bytes)."""
    offs_g = tl.arange(0, BLOCK_K // 32)
    offs_j = tl.arange(0, 16)
    b_ptrs = b_rows[:, :, None, None] \
        + (offs_g[:, None] * 16 + offs_j[None, :])[None, None, :, :]
    s_ptrs = s_rows[:, :, None] + offs_g[None, None, :]
    g_ok = offs_g < g_left
    byte = tl.load(b_ptrs, mask=ok[:, :, None, None] & g_ok[None, None, :, None], other=0)
    sc = tl.load(s_ptrs, mask=ok[:, :, None] & g_ok[None, None, :], other=0)
    return byte, sc


@triton.jit
def _tile_math(byte, sc, xe, xo):
    """:func:`_tile_load`'s tile against the even / odd activations ``[P or 1, BLOCK_K/32,
    16]`` fp32 -> ``[P, BLOCK_N]`` fp32: each group of 32 summed unscaled, then times its
    power of two (exact), then the groups summed."""
    lo, hi = e2m1_halves(byte)
    part = tl.sum(lo * xe[:, None, :, :] + hi * xo[:, None, :, :], 3)     # [P, BLOCK_N, G]
    return tl.sum(part * e8m0_times_2_14(sc), 2)


@triton.jit
def _x_halves(x_rows, row_ok, g_left, P: tl.constexpr, BLOCK_K: tl.constexpr):
    """``BLOCK_K`` activations from each of ``P`` rows (``x_rows [P]`` pointers; contiguous
    along K: vector loads) -> their even and odd elements, ``[P, BLOCK_K/32, 16]`` fp32
    each; zero where ``row_ok [P]`` is false (a dropped pair's row is never written: it may
    hold NaN) and in the groups from ``g_left`` on."""
    offs_g = tl.arange(0, BLOCK_K // 32)
    offs = offs_g[:, None] * 32 + tl.arange(0, 32)[None, :]                # [G, 32]
    mask = row_ok[:, None, None] & (offs_g < g_left)[None, :, None]
    x = tl.load(x_rows[:, None, None] + offs[None, :, :], mask=mask, other=0.0)
    return tl.split(tl.reshape(x.to(tl.float32), (P, BLOCK_K // 32, 16, 2)))


@triton.jit
def _gemv_rows(b_rows, s_rows, ok, x_rows, x_ok, K, P_X: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """``[P, BLOCK_N]`` MXFP4 rows of K elements (``b_rows`` / ``s_rows``: their first byte /
    scale) dotted with the activation rows ``x_rows [P_X]`` (P_X = P: row p with x row p;
    P_X = 1: all with one) -> ``[P, BLOCK_N]`` fp32, over the whole K in ``BLOCK_K`` steps.

    The next step's bytes are loaded before this step's math (a register double buffer:
    two steps of weight bytes in flight per program, for the price of the raw bytes'
    registers, not of the decoded floats'); every step is masked by groups of 32 (K is a
    multiple of 32, the tail step partial), a mask constant along each 16-byte vector."""
    G: tl.constexpr = BLOCK_K // 32
    g_total = K // 32
    n_steps = tl.cdiv(K, BLOCK_K)
    byte, sc = _tile_load(b_rows, s_rows, ok, g_total, BLOCK_K)
    acc = tl.zeros(b_rows.shape, dtype=tl.float32)
    for i in range(1, n_steps):
        nbyte, nsc = _tile_load(b_rows + i * (BLOCK_K // 2), s_rows + i * G, ok,
                                g_total - i * G, BLOCK_K)
        xe, xo = _x_halves(x_rows + (i - 1) * BLOCK_K, x_ok, g_total - (i - 1) * G, P_X,
                           BLOCK_K)
        acc += _tile_math(byte, sc, xe, xo)
        byte, sc = nbyte, nsc
    xe, xo = _x_halves(x_rows + (n_steps - 1) * BLOCK_K, x_ok, g_total - (n_steps - 1) * G,
                       P_X, BLOCK_K)
    return acc + _tile_math(byte, sc, xe, xo)


@triton.jit
def _gemv_gate_up_kernel(x_ptr, b_ptr, s_ptr, bias_ptr, ids_ptr, logits_ptr, act_ptr, H,
                         INTER, num_experts, stride_xm, stride_be, stride_bn, stride_se,
                         stride_sn, stride_am, stride_lm, alpha, limit,
                         TOP_K: tl.constexpr, ROUTE: tl.constexpr, RENORM: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, ACT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    e = pair_expert(t, ids_ptr, logits_ptr, stride_lm, num_experts, TOP_K, ROUTE, RENORM,
                    BLOCK_E, BLOCK_P)
    if (e < 0) | (e >= num_experts):
        return                                   # another rank's expert: no row here
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = (offs_n % INTER).to(tl.int64)    # in-bounds rows; masked at the store
    # [2, BLOCK_N] rows: gate rows n, up rows I + n (ferry's de-interleaved w13)
    rows = tl.arange(0, 2)[:, None].to(tl.int64) * INTER + offs_n_ld[None, :]
    ok = rows >= 0                               # all true: the loads' uniform mask
    x_ok = tl.arange(0, 1) == 0
    b_rows = b_ptr + e * stride_be + rows * stride_bn
    s_rows = s_ptr + e * stride_se + rows * stride_sn
    x_rows = x_ptr + (t // TOP_K).to(tl.int64) * stride_xm + tl.zeros((1,), dtype=tl.int64)
    acc = _gemv_rows(b_rows, s_rows, ok, x_rows, x_ok, H, 1, BLOCK_K)          # [2, N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * 2 * INTER + rows).to(tl.float32)
    is_gate = (tl.arange(0, 2) == 0)[:, None]
    gate = tl.sum(tl.where(is_gate, acc, 0.0), 0)
    up = tl.sum(tl.where(is_gate, 0.0, acc), 0)
    if ACT == 1:    # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        act = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    elif ACT == 2:  # GeGLU, tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z)) * up
    else:           # SwiGLU
        act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + t.to(tl.int64) * stride_am + offs_n,
             act.to(act_ptr.dtype.element_ty), mask=offs_n < INTER)


@triton.jit
def _gemv_down_kernel(act_ptr, b_ptr, s_ptr, bias_ptr, ids_ptr, tw_ptr, logits_ptr, out_ptr,
                      H, INTER, num_experts, stride_am, stride_be, stride_bn, stride_se,
                      stride_sn, stride_om, stride_lm, TOP_K: tl.constexpr,
                      ROUTE: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    # all top_k pairs of the token in one [BLOCK_P, BLOCK_N] row tile a step, summed over
    # the pairs in a fixed order at the end
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = (offs_n % H).to(tl.int64)
    kp = tl.arange(0, BLOCK_P)
    if ROUTE:  # the token's experts and weights from its router logits
        wt, e = route_row(logits_ptr, m, stride_lm, num_experts, TOP_K, RENORM, BLOCK_E,
                          BLOCK_P)
    else:
        e = tl.load(ids_ptr + m * TOP_K + kp, mask=kp < TOP_K, other=-1)
        wt = tl.load(tw_ptr + m * TOP_K + kp, mask=kp < TOP_K, other=0.0)
    e = e.to(tl.int64)
    ok_p = (kp < TOP_K) & (e >= 0) & (e < num_experts)  # a dropped pair reads nothing
    wt = tl.where(ok_p, wt, 0.0)
    ok = ok_p[:, None] & (offs_n_ld >= 0)[None, :]                         # [P, N]
    b_rows = b_ptr + tl.where(ok_p, e, 0)[:, None] * stride_be \
        + offs_n_ld[None, :] * stride_bn
    s_rows = s_ptr + tl.where(ok_p, e, 0)[:, None] * stride_se \
        + offs_n_ld[None, :] * stride_sn
    a_rows = act_ptr + (m * TOP_K + kp) * stride_am
    acc = _gemv_rows(b_rows, s_rows, ok, a_rows, ok_p, INTER, BLOCK_P, BLOCK_K)  # [P, N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + tl.where(ok_p, e, 0)[:, None] * H + offs_n_ld[None, :],
                       mask=ok, other=0.0).to(tl.float32)
    out = tl.sum(acc * wt[:, None], 0)
    tl.store(out_ptr + m * stride_om + offs_n, out.to(out_ptr.dtype.element_ty),
             mask=offs_n < H)


def gemv_tiles(m: int, top_k: int, h: int, inter: int, target_programs: int | None = None,
               block_k: int | None = None) -> dict:
    """The GEMV kernels' tiles for M tokens: ``{"up": (BLOCK_N, BLOCK_K, num_warps), "down":
    (BLOCK_N, BLOCK_K, num_warps)}``.

    BLOCK_K is ``block_k`` (default :data:`BLOCK_K`, 512: a row moves 256 bytes a step)
    capped at the reduced dimension's power of two, at least 32. The programs of a launch
    are all resident at once at decode sizes (gpt-oss-120b, M = 1: 720 of them), so the
    bytes in flight are about the rows times ``BLOCK_K / 2``: a wide K step, not split-K,
    is what keeps HBM busy. BLOCK_N is the widest power of two in [2, 16] that still gives
    ``target_programs`` programs (default :data:`TARGET_PROGRAMS`, 528: four per SM of an
    H200; the narrowest when none does) and keeps a step's tile (gate + up rows, or the
    ``top_k`` pairs' rows) within :data:`MAX_STEP_BYTES`. num_warps gives each thread about
    32 bytes of weights a step (1..8: two 16-byte loads, and two more in flight for the
    next step; sm_90, default tiles: 110-150 registers, no spills)."""
    target = TARGET_PROGRAMS if target_programs is None else target_programs
    bk_max = BLOCK_K if block_k is None else block_k

    def pick(programs_per_row: int, n: int, tiles_per_step: int, k: int) -> tuple:
        bk = max(32, min(bk_max, triton.next_power_of_2(k)))
        bn = 2
        for cand in (16, 8, 4):
            if cand * tiles_per_step * bk // 2 <= MAX_STEP_BYTES \
                    and programs_per_row * triton.cdiv(n, cand) >= target:
                bn = cand
                break
        step_bytes = tiles_per_step * bn * bk // 2
        warps = max(1, min(8, triton.next_power_of_2(max(1, step_bytes // 1024))))
        return bn, bk, warps

    return {"up": pick(m * top_k, inter, 2, h),
            "down": pick(m, h, triton.next_power_of_2(top_k), inter)}


def fused_moe_oai_gemv(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       w13_scales: torch.Tensor, w2_scales: torch.Tensor,
                       topk_weights: torch.Tensor | None, topk_ids: torch.Tensor | None, *,
                       w13_bias: torch.Tensor | None = None,
                       w2_bias: torch.Tensor | None = None, activation: str = "swiglu_oai",
                       swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                       out: torch.Tensor | None = None, tiles: dict | None = None,
                       route: tuple | None = None) -> torch.Tensor:
    """The GEMV path of :func:`kernels.moe.fused_moe_mxfp4.fused_moe_oai` for MXFP4 experts
    (shapes already checked there): ``out[m] = sum_k w[m, k] * (w2[e] @ act + b2[e])`` with
    ``act = activation(w13[e] @ x_m + b13[e])``, ``e = topk_ids[m, k]``.

    Args:
        hidden_states: ``[M, H]`` fp16/bf16/fp32, unit last stride.
        w13: ``[E, 2I, H/32, 16]`` uint8 (gate rows, then up rows); w2: ``[E, H, I/32, 16]``.
        w13_scales: ``[E, 2I, H/32]`` uint8; w2_scales: ``[E, H, I/32]`` uint8.
        topk_weights: ``[M, top_k]`` fp32 contiguous; topk_ids: ``[M, top_k]`` int32/int64
            contiguous (ids outside ``[0, E)`` contribute nothing); both None with ``route``.
        w13_bias: ``[E, 2I]``, w2_bias: ``[E, H]`` contiguous, or None.
        activation: ``"swiglu_oai"`` (with ``swiglu_alpha``, ``swiglu_limit``), ``"silu"``
            or ``"gelu_tanh"``.
        out: ``[M, H]`` in the activations' dtype, unit last stride (default: new).
        tiles: :func:`gemv_tiles`'s dict (default: its choice for these shapes).
        route: ``(router_logits [M, E], top_k, renormalize)``: the kernels route each token
            themselves (``kernels.moe.routing.route_row``) instead of reading the ids.

    Returns:
        ``out``. Two launches, one ``[M * top_k, I]`` workspace, no host sync.

    Raises:
        ValueError: non-contiguous weights, scales or biases, or a strided activation row.
    """
    if any(t is not None and not t.is_contiguous()
           for t in (w13, w2, w13_scales, w2_scales, w13_bias, w2_bias)) \
            or hidden_states.stride(-1) != 1:
        raise ValueError("fused_moe_oai_gemv: weights, scales and biases must be contiguous "
                         "and the activations' last axis unit-stride")
    m, h = hidden_states.shape
    num_experts, two_i = w13.shape[0], w13.shape[1]
    inter = two_i // 2
    top_k = route[1] if route is not None else topk_ids.shape[1]
    dev = hidden_states.device
    if out is None:
        out = torch.empty((m, h), dtype=hidden_states.dtype, device=dev)
    if m == 0:
        return out
    act = torch.empty((m * top_k, inter), dtype=hidden_states.dtype, device=dev)
    t = tiles or gemv_tiles(m, top_k, h, inter)
    if route is None:
        logits, renorm, stride_lm = topk_ids, False, 0                # logits unused
    else:
        logits, renorm, stride_lm = route[0], bool(route[2]), route[0].stride(0)
        topk_ids = topk_weights = logits                             # unused
    w13v, w2v = w13.flatten(2), w2.flatten(2)
    common = dict(TOP_K=top_k, ROUTE=route is not None, RENORM=renorm,
                  BLOCK_E=triton.next_power_of_2(num_experts),
                  BLOCK_P=triton.next_power_of_2(top_k))
    bn, bk, warps = t["up"]
    _gemv_gate_up_kernel[(m * top_k, triton.cdiv(inter, bn))](
        hidden_states, w13v, w13_scales, w13_bias if w13_bias is not None else act, topk_ids,
        logits, act, h, inter, num_experts, hidden_states.stride(0), w13v.stride(0),
        w13v.stride(1), w13_scales.stride(0), w13_scales.stride(1), act.stride(0), stride_lm,
        float(swiglu_alpha), float(swiglu_limit), ACT=_ACTS[activation],
        HAS_BIAS=w13_bias is not None, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, **common)
    bn, bk, warps = t["down"]
    _gemv_down_kernel[(m, triton.cdiv(h, bn))](
        act, w2v, w2_scales, w2_bias if w2_bias is not None else act, topk_ids, topk_weights,
        logits, out, h, inter, num_experts, act.stride(0), w2v.stride(0), w2v.stride(1),
        w2_scales.stride(0), w2_scales.stride(1), out.stride(0), stride_lm,
        HAS_BIAS=w2_bias is not None, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, **common)
    return out


def fused_moe_oai_gemv_routed(hidden_states: torch.Tensor, w13: torch.Tensor,
                              w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                              renormalize: bool, *, w13_scales: torch.Tensor,
                              w2_scales: torch.Tensor, **kwargs) -> torch.Tensor:
    """:func:`kernels.moe.routing.fused_topk` and :func:`fused_moe_oai_gemv` in two
    launches: each program routes its token from the router logits itself (softmax, top-k
    with ties to the lower id, optional renormalisation: ``fused_topk``'s arithmetic).

    Args:
        hidden_states, w13, w2, w13_scales, w2_scales: as :func:`fused_moe_oai_gemv` (all E
            experts on this rank).
        router_logits: ``[M, E]`` any float dtype, unit last stride, ``E <= 4096``.
        top_k: ``1 <= top_k <= E``.  renormalize: divide the top-k weights by their sum.
        kwargs: :func:`fused_moe_oai_gemv`'s keywords (biases, activation, out, tiles).

    Returns:
        ``[M, H]`` in the activations' dtype.

    Raises:
        ValueError: logits not ``[M, E]`` for the weights' E, a strided last axis, E > 4096,
            a bad ``top_k``, or as :func:`fused_moe_oai_gemv`.
    """
    m, num_experts = hidden_states.shape[0], w13.shape[0]
    if tuple(router_logits.shape) != (m, num_experts) or router_logits.stride(1) != 1 \
            or num_experts > 4096:
        raise ValueError(f"router_logits must be [{m}, {num_experts}] with a unit-stride last "
                         f"axis and E <= 4096, got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    return fused_moe_oai_gemv(hidden_states, w13, w2, w13_scales, w2_scales, None, None,
                              route=(router_logits, top_k, renormalize), **kwargs)


__all__ = ["BLOCK_K", "GEMV_MAX_M", "GEMV_SELF_ROUTE", "MAX_STEP_BYTES", "TARGET_PROGRAMS",
           "e2m1_halves", "e8m0_times_2_14", "fused_moe_oai_gemv", "fused_moe_oai_gemv_routed",
           "gemv_self_routes", "gemv_tiles", "use_gemv_path"]
