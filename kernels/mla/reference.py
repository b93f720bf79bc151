"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over the latent cache, in torch.

The absorbed form: each query head's no-rope part has already been projected into the
latent space (``q_nope @ W_UK``), so a query row is ``[q_latent (R) | q_rope (P)]`` and
every key is the token's cached latent row ``[c (R) | k_rope (P)]`` (one head shared by all
query heads). The score is one dot product over ``R + P`` values; the output is the
attention-weighted sum of the keys' ``c`` parts (``[T, H, R]``), which the layer maps
through ``W_UV`` to the heads' values.

The cache is read through ``req_to_token`` like the paged K/V (see ``engine/kv/pool.py``):
the CPU reference path, one request at a time; extend and decode rows alike (a decode is
an extend of one token). An FP8 cache (``float8_e4m3fn``/``float8_e5m2`` rows holding
``latent / kv_scale``, the paged pool's per-tensor convention) is read dequantized in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mla_attention_ref(q: torch.Tensor, latent: torch.Tensor, req_to_token: torch.Tensor,
                      rows: Sequence[int], seq_lens: Sequence[int], ext_lens: Sequence[int],
                      sm_scale: float, kv_lora_rank: int, kv_scale: float = 1.0
                      ) -> torch.Tensor:
    """Causal latent attention of a step's new tokens.

    Args:
        q: ``[T, H, R + P]`` the new tokens' absorbed queries, requests in order (request
            ``i`` owns ``ext_lens[i]`` consecutive rows, its last positions).
        latent: ``[num_slots, 1, R + P]`` one layer's latent cache (the new tokens stored),
            any float dtype, FP8 included.
        req_to_token: ``[rows, max_context]`` int32 slot of each (row, position).
        rows, seq_lens, ext_lens: per request its ``req_to_token`` row, its length with the
            new tokens, and its new tokens (host ints).
        sm_scale: the softmax scale.
        kv_lora_rank: R (the first R values of a latent row are the values).
        kv_scale: the cache's per-tensor scale (a row is ``stored * kv_scale``; 1.0 for a
            16/32-bit cache).
    Returns:
        ``[T, H, R]`` in q's dtype (computed in float32).
    Raises:
        ValueError: the ``ext_lens`` do not add up to ``T``.
    """
    if sum(ext_lens) != q.shape[0]:
        raise ValueError(f"ext_lens add up to {sum(ext_lens)}, q has {q.shape[0]} rows")
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    start = 0
    for row, n, e in zip(rows, seq_lens, ext_lens):
        slots = req_to_token[row, :n].long()
        kv = latent.index_select(0, slots)[:, 0].float()             # [n, R + P]
        if kv_scale != 1.0:
            kv = kv * kv_scale
        qi = q[start:start + e].float()                              # [e, H, R + P]
        s = torch.einsum("thd,nd->htn", qi, kv) * sm_scale           # [H, e, n]
        qpos = torch.arange(n - e, n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] > qpos[:, None]   # [e, n]
        s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[start:start + e] = torch.einsum("htn,nr->thr", p, kv[:, :kv_lora_rank]).to(q.dtype)
        start += e
    return out


__all__ = ["mla_attention_ref"]
