"""Pure-torch gated delta rule and short causal conv1d (the CPU path of Gated DeltaNet).

Semantics are those of transformers' ``qwen3_next`` (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn`` / ``causal_conv1d_update``), on
packed varlen batches. Shapes (T = tokens of the batch, B = requests, Hk/Hv = key and value
heads with Hv % Hk == 0, K/V = key and value head sizes, C = conv channels, W = conv width):

  q, k          : [T, Hk, K]      any float dtype
  v             : [T, Hv, V]
  g             : [T, Hv]         log decay per token (<= 0): the state is scaled by exp(g)
  beta          : [T, Hv]         write strength in (0, 1)
  cu_seqlens    : [B + 1]         int, cumulative token counts (request b owns
                                  tokens cu_seqlens[b]:cu_seqlens[b+1])
  state         : [B, Hv, K, V]   float32 recurrent state per request
  x (conv)      : [T, C]
  conv weight   : [C, W]          depthwise taps (HF's ``conv1d.weight.squeeze(1)``)
  conv_state    : [B, C, W - 1]   the request's last W - 1 conv inputs, oldest first

The recurrence, per value head, with S a [K, V] state and q scaled by K ** -0.5 (after an
optional L2 norm of q and k): ``S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - k_t^T S));
o_t = q_t^T S``. The chunked form computes the same thing ``chunk_size`` tokens at a time
(WY/UT transform within a chunk, a sequential scan across chunks); both accumulate in
float32 and return the output in q's dtype and the final states in float32.

All functions are out-of-place except :func:`causal_conv1d_update_ref`, which advances
``conv_state`` in place (as the decode kernel does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and HF's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _bounds(cu_seqlens: torch.Tensor | Sequence[int] | None, total: int) -> list[int]:
    if cu_seqlens is None:
        return [0, total]
    bounds = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if bounds[0] != 0 or bounds[-1] != total or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} do not cover the {total} tokens in order")
    return bounds


def _prepare(q, k, v, g, beta, use_qk_l2norm):
    """Per-head float32 tensors [H, L, *] with q/k expanded to the value heads and q scaled."""
    hk, hv = k.shape[1], v.shape[1]
    if hv % hk:
        raise ValueError(f"value heads {hv} are not a multiple of key heads {hk}")
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    g, beta = (x.transpose(0, 1).float() for x in (g, beta))
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _initial(initial_state, b, hv, dk, dv, device):
    if initial_state is None:
        return torch.zeros(hv, dk, dv, dtype=torch.float32, device=device)
    return initial_state[b].float()


def _chunk_one(q, k, v, g, beta, state, chunk_size):
    """One request's chunked gated delta rule; tensors as from :func:`_prepare`."""
    h, length, dk = k.shape
    pad = (-length) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (length + pad) // chunk_size
    q, k, v = (x.reshape(h, n, chunk_size, -1) for x in (q, k, v))
    beta = beta.reshape(h, n, chunk_size, 1)
    gc = g.reshape(h, n, chunk_size).cumsum(-1)          # decay from the chunk's start
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta
    # (I + strictly_lower(A)) solves the chunk's delta updates at once (the UT transform)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * gc.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_read = q * gc.exp().unsqueeze(-1)
    k_write = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_read[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i, None, None] + k_write[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, n * chunk_size, -1)[:, :length], state


def _recurrent_one(q, k, v, g, beta, state):
    """One request's gated delta rule, token by token; tensors as from :func:`_prepare`."""
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        k_t = k[:, t].unsqueeze(-1)                                   # [H, K, 1]
        delta = (v[:, t] - (state * k_t).sum(-2)) * beta[:, t].unsqueeze(-1)
        state = state + k_t * delta.unsqueeze(-2)
        out[:, t] = (state * q[:, t].unsqueeze(-1)).sum(-2)
    return out, state


def _decode_step(q, k, v, g, beta, initial_state, use_qk_l2norm):
    """One token for each of B requests at once (no per-request loop): q/k [B, Hk, K],
    v [B, Hv, V], g/beta [B, Hv], initial_state [B, Hv, K, V] (None: zeros)."""
    b, hv, dv = v.shape
    qh, kh, vh, gh, bh = (x.transpose(0, 1) for x in _prepare(q, k, v, g, beta, use_qk_l2norm))
    state = (initial_state.float() if initial_state is not None
             else torch.zeros(b, hv, kh.shape[-1], dv, dtype=torch.float32, device=v.device))
    state = state * gh.exp()[..., None, None]
    k_t = kh.unsqueeze(-1)                                            # [B, H, K, 1]
    delta = (vh - (state * k_t).sum(-2)) * bh.unsqueeze(-1)
    state = state + k_t * delta.unsqueeze(-2)
    out = (state * qh.unsqueeze(-1)).sum(-2)                          # [B, H, V]
    return out.to(q.dtype), state


def recurrent_gated_delta_rule_update_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One decode step of B requests over a state pool, in place: request b reads and writes
    ``states[slots[b]]`` ([Hv, K, V] float32).

    Args: ``q``, ``k`` [B, Hk, K]; ``v`` [B, Hv, V]; ``g``, ``beta`` [B, Hv]; ``states``
    [S, Hv, K, V] float32; ``slots`` [B] int64 (distinct).
    Returns: ``o`` [B, Hv, V] in q's dtype.
    """
    out, final = _decode_step(q, k, v, g, beta, states[slots], use_qk_l2norm)
    states[slots] = final
    return out


def recurrent_gated_delta_rule_verify_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, n: int, dst_base: int,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """A speculative verify step: the B rows are B / n requests of n consecutive tokens;
    request r runs its tokens from ``states[slots[r * n]]`` (left as it is) and the state
    after its token t is written to ``states[dst_base + r * n + t]``.

    Args: as :func:`recurrent_gated_delta_rule_update_ref` (``slots`` [B], one per row; the
    first of each request's rows is read).
    Returns: ``o`` [B, Hv, V] in q's dtype.
    """
    rows = v.shape[0]
    state = states[slots[::n]]
    out = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    for t in range(n):
        at = torch.arange(t, rows, n, device=v.device)
        out[at], state = _decode_step(q[at], k[at], v[at], g[at], beta[at], state,
                                      use_qk_l2norm)
        states[at + dst_base] = state
    return out


def _run(one, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm):
    total, hv, dv = v.shape
    bounds = _bounds(cu_seqlens, total)
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta, use_qk_l2norm)
    dk = kh.shape[-1]
    out = torch.empty(hv, total, dv, dtype=torch.float32, device=v.device)
    finals = []
    for b, (s, e) in enumerate(zip(bounds, bounds[1:])):
        state = _initial(initial_state, b, hv, dk, dv, v.device)
        o, state = one(qh[:, s:e], kh[:, s:e], vh[:, s:e], gh[:, s:e], bh[:, s:e], state)
        out[:, s:e] = o
        finals.append(state)
    final = torch.stack(finals) if finals else v.new_zeros(0, hv, dk, dv, dtype=torch.float32)
    return out.transpose(0, 1).to(q.dtype), final


def chunk_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of a packed batch, ``chunk_size`` tokens at a time (prefill).

    Args: shapes in the module docstring; ``initial_state`` [B, Hv, K, V] (None: zeros);
    ``cu_seqlens`` None for one request of all T tokens.
    Returns: ``(o [T, Hv, V] in q's dtype, final_state [B, Hv, K, V] float32)``.
    Raises: ValueError when Hv % Hk != 0 or ``cu_seqlens`` does not cover the T tokens.
    """
    def one(*a):
        return _chunk_one(*a, chunk_size)

    return _run(one, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (decode: one token per request, ``cu_seqlens``
    None and q of shape [B, ...] meaning one token each when ``initial_state`` has B rows).

    Args/Returns/Raises: as :func:`chunk_gated_delta_rule_ref`.
    """
    if cu_seqlens is None and initial_state is not None and initial_state.shape[0] == v.shape[0]:
        return _decode_step(q, k, v, g, beta, initial_state, use_qk_l2norm)
    return _run(_recurrent_one, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"conv1d activation {activation!r} is not supported (silu or None)")


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d of a packed batch, each request continuing from its state.

    Args: ``x`` [T, C]; ``weight`` [C, W]; ``bias`` [C] or None; ``conv_state``
    [B, C, W - 1] (None: zeros, a fresh request); ``activation`` "silu" or None.
    Returns: ``(out [T, C] in x's dtype, new_state [B, C, W - 1] in weight's dtype)``: the
    new state holds each request's last W - 1 inputs (older state where it has fewer).
    Raises: ValueError on a bad ``cu_seqlens`` or activation.
    """
    channels, width = weight.shape
    bounds = _bounds(cu_seqlens, x.shape[0])
    outs, states = [], []
    for b, (s, e) in enumerate(zip(bounds, bounds[1:])):
        prior = (conv_state[b].to(weight.dtype) if conv_state is not None
                 else weight.new_zeros(channels, width - 1))
        seq = torch.cat([prior, x[s:e].t().to(weight.dtype)], dim=-1)    # [C, W-1+L]
        out = F.conv1d(seq.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)[0]
        outs.append(_activate(out, activation).t())
        states.append(seq[:, seq.shape[-1] - (width - 1):])
    out = torch.cat(outs) if outs else x.new_zeros(0, channels)
    new_state = (torch.stack(states) if states
                 else weight.new_zeros(0, channels, width - 1))
    return out.to(x.dtype), new_state


def causal_conv1d_update_ref(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None = None, activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of the causal conv1d for B requests; ``conv_state`` advances in place.

    Args: ``x`` [B, C] (each request's new input); ``conv_state`` [B, C, W - 1];
    ``weight`` [C, W]; ``bias`` [C] or None.
    Returns: ``out`` [B, C] in x's dtype.
    """
    channels = weight.shape[0]
    seq = torch.cat([conv_state.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)
    conv_state.copy_(seq[:, :, 1:])
    out = F.conv1d(seq, weight.unsqueeze(1), bias, groups=channels)[:, :, -1]
    return _activate(out, activation).to(x.dtype)


def causal_conv1d_verify_ref(
    x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
    n: int, dst_base: int, activation: str | None = "silu",
) -> torch.Tensor:
    """The causal conv1d of a speculative verify step: the B rows of ``x`` [B, C] are B / n
    requests of n consecutive tokens; request r starts from ``conv_states[slots[r * n]]``
    ([C, W - 1], left as it is) and the state after its token t is written to
    ``conv_states[dst_base + r * n + t]``. Returns ``out`` [B, C] in x's dtype."""
    rows = x.shape[0]
    state = conv_states[slots[::n]].clone()
    out = torch.empty_like(x)
    for t in range(n):
        at = torch.arange(t, rows, n, device=x.device)
        out[at] = causal_conv1d_update_ref(x[at], state, weight, None, activation)
        conv_states[at + dst_base] = state.to(conv_states.dtype)
    return out
