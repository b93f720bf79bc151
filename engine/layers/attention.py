"""The attention layer and its backend.

``RadixAttention``-style layer: the model gives q/k/v of the new tokens; the backend stores
k/v into the paged pool at ``forward_batch.out_cache_loc`` and runs extend or decode
attention. On cuda/xpu the Triton kernels in ``kernels/`` run; on the CPU the torch
references in ``kernels/reference.py`` run. Both read K/V through ``req_to_token``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from kernels import reference


class AttentionBackend:
    """Dispatches to Triton kernels (``use_triton``) or the torch references."""

    def __init__(self, use_triton: bool, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_kv_splits: int = 16, num_sms: int = 132, waves: int = 1):
        self.use_triton = use_triton
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_kv_splits = max_kv_splits
        self.num_sms = num_sms
        self.waves = waves
        if use_triton:
            from kernels.decode_attention import decode_attention_fwd
            from kernels.extend_attention import extend_attention_fwd
            from kernels.kv_store import store_kv

            self._decode, self._extend, self._store = decode_attention_fwd, extend_attention_fwd, store_kv
        else:
            self._decode = reference.decode_attention_ref
            self._extend = reference.extend_attention_ref
            self._store = reference.store_kv_ref

    def init_forward(self, fb: ForwardBatch) -> None:
        """Per-step metadata shared by all layers (called once per step, before forward)."""
        if fb.is_decode and self.use_triton:
            from kernels.decode_attention import choose_num_kv_splits

            fb.attn_meta["num_kv_splits"] = choose_num_kv_splits(
                fb.seq_lens, self.num_kv_heads, self.max_kv_splits, self.num_sms,
                waves=self.waves)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                sm_scale: float, fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D] (q's dtype)."""
        kb, vb = fb.k_buffers[layer_id], fb.v_buffers[layer_id]
        self._store(kb, vb, fb.out_cache_loc, k, v)
        o = torch.empty_like(q)
        if fb.is_decode:
            if self.use_triton:
                self._decode(q, kb, vb, o, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                             sm_scale, num_kv_splits=fb.attn_meta.get("num_kv_splits"),
                             max_kv_splits=self.max_kv_splits)
            else:
                self._decode(q, kb, vb, o, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                             sm_scale)
        else:
            if self.use_triton:
                self._extend(q, k, v, o, kb, vb, fb.req_to_token, fb.req_pool_indices,
                             fb.seq_lens, fb.extend_seq_lens, fb.extend_start_loc, sm_scale,
                             max_extend_len=fb.max_extend_len)
            else:
                self._extend(q, k, v, o, kb, vb, fb.req_to_token, fb.req_pool_indices,
                             fb.seq_lens, fb.extend_seq_lens, fb.extend_start_loc, sm_scale)
        return o


class Attention(nn.Module):
    """Attention over the paged KV cache for one layer (no weights of its own)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int,
                 scaling: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.scaling = scaling if scaling is not None else head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""
        t = q.shape[0]
        o = fb.attn_backend.forward(q.view(t, self.num_heads, self.head_dim),
                                    k.view(t, self.num_kv_heads, self.head_dim),
                                    v.view(t, self.num_kv_heads, self.head_dim),
                                    self.layer_id, self.scaling, fb)
        return o.view(t, self.num_heads * self.head_dim)
