"""The attention layer: ``RadixAttention``-style, no weights of its own.

The model gives q/k/v of the new tokens; the step's backend (``forward_batch.attn_backend``,
one of :mod:`engine.attention`) stores k/v into the paged KV cache at
``forward_batch.out_cache_loc`` and runs extend or decode attention through
``req_to_token``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_batch import ForwardBatch


class Attention(nn.Module):
    """Attention over the paged KV cache for one layer.

    Args:
        num_heads, num_kv_heads, head_dim: per-rank shape (Hq, Hkv, D).
        layer_id: index of the layer's K/V buffers in the pool.
        scaling: softmax scale (default ``D ** -0.5``).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int,
                 scaling: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.scaling = scaling if scaling is not None else head_dim ** -0.5

    @property
    def q_size(self) -> int:
        """Width of this layer's q rows (Hq * D)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of this layer's k and v rows (Hkv * D)."""
        return self.num_kv_heads * self.head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D] (into ``out`` [T, Hq*D] if given)."""
        t = q.shape[0]
        o = fb.attn_backend.forward(q.view(t, self.num_heads, self.head_dim),
                                    k.view(t, self.num_kv_heads, self.head_dim),
                                    v.view(t, self.num_kv_heads, self.head_dim),
                                    self.layer_id, self.scaling, fb,
                                    None if out is None
                                    else out.view(t, self.num_heads, self.head_dim))
        return o.view(t, self.num_heads * self.head_dim)
