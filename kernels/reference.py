"""Pure-torch reference attention kernels over the paged KV pool.

These define the semantics the Triton kernels in this package must match, and they are
what the CPU device runs. Shapes (T = new tokens in the batch, B = requests, Hq/Hkv = query
and KV heads with Hq % Hkv == 0, D = head_dim, S = pool slots, R = req_to_token rows):

  k_buffer, v_buffer : [S, Hkv, D]       one pool tensor per layer
  req_to_token       : [R, max_context]  int32, maps (request row, position) -> slot
  req_pool_indices   : [B]               int64/int32 rows of req_to_token
  seq_lens           : [B]               int32/int64, tokens in the KV after this step

Attention is softmax(q k^T * sm_scale) v with fp32 accumulation; the output has q's dtype.
"""

from __future__ import annotations

import torch


def store_kv_ref(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new keys/values into pool slots: ``k_buffer[loc[i]] = k[i]``.

    Args: loc [T] int64 slots; k, v [T, Hkv, D] (cast to the pool dtype).
    """
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
            causal_offset: int | None) -> torch.Tensor:
    """q [n, Hq, D], k/v [m, Hkv, D] -> [n, Hq, D] in fp32.

    causal_offset: query i may see keys j <= i + causal_offset (None: all keys).
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)                                   # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, m, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale               # [Hq, n, m]
    if causal_offset is not None:
        n, m = q.shape[0], k.shape[0]
        qi = torch.arange(n, device=q.device)[:, None]
        kj = torch.arange(m, device=q.device)[None, :]
        s = s.masked_fill(kj > qi + causal_offset, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1)                      # [n, Hq, D]


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         o: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         sm_scale: float) -> torch.Tensor:
    """Decode attention: one query token per request over its whole KV (already stored).

    The batch is gathered into a padded ``[B, max_len]`` block with a length mask, so the CPU
    runs one batched product per layer instead of a loop over requests.

    Args: q [B, Hq, D]; o [B, Hq, D] written in place and returned.
    """
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    group = hq // hkv
    max_len = int(seq_lens.max()) if bsz else 0
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].to(pos.dtype)                   # [B, L]
    slots = req_to_token[req_pool_indices.long(), :max_len].long() * valid   # [B, L]
    k = k_buffer[slots].float()                                             # [B, L, Hkv, D]
    v = v_buffer[slots].float()
    qf = q.float().view(bsz, hkv, group, d)
    s = torch.einsum("bhgd,blhd->bhgl", qf, k) * sm_scale                  # [B, Hkv, G, L]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", p, v)
    o.copy_(out.reshape(bsz, hq, d).to(o.dtype))
    return o


def extend_attention_ref(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                         extend_start_loc: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Extend (prefill with an optional cached prefix) attention.

    Request b has ``prefix = seq_lens[b] - extend_seq_lens[b]`` tokens already in the pool,
    read through ``req_to_token[req_pool_indices[b], :prefix]``, and ``extend_seq_lens[b]``
    new tokens at rows ``extend_start_loc[b] : + extend_seq_lens[b]`` of q/k/v_extend. New
    token i sees the whole prefix and new tokens 0..i (causal). Plain prefill is prefix 0.

    Args: q_extend [T, Hq, D]; k_extend, v_extend [T, Hkv, D]; o_extend [T, Hq, D] written
    in place and returned; extend_seq_lens, extend_start_loc [B] int.
    """
    rows = req_pool_indices.tolist()
    lens = seq_lens.tolist()
    ext = extend_seq_lens.tolist()
    starts = extend_start_loc.tolist()
    for b in range(len(rows)):
        n, s0 = ext[b], starts[b]
        if n == 0:
            continue
        prefix = lens[b] - n
        slots = req_to_token[rows[b], :prefix].long()
        k = torch.cat([k_buffer[slots].to(k_extend.dtype), k_extend[s0: s0 + n]], dim=0)
        v = torch.cat([v_buffer[slots].to(v_extend.dtype), v_extend[s0: s0 + n]], dim=0)
        o_extend[s0: s0 + n] = _attend(q_extend[s0: s0 + n], k, v, sm_scale, prefix).to(o_extend.dtype)
    return o_extend
