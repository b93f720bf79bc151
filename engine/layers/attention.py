"""The attention layer: ``RadixAttention``-style, no weights of its own.

The model gives q/k/v of the new tokens; the step's backend (``forward_batch.attn_backend``,
one of :mod:`engine.attention`) stores k/v into the paged KV cache at
``forward_batch.out_cache_loc`` and runs extend or decode attention through
``req_to_token``.

Each layer holds its :class:`engine.layer_spec.LayerSpec` (``spec``, with this rank's K/V
heads) and passes it to the backend with every call, so a backend can pick a kernel per
layer (a window, soft-capping, sinks). The kinds the layer itself runs are
:data:`SUPPORTED_ATTENTION` (full and sliding-window attention over the paged K/V, with
soft-capping and sinks); any other is refused when the layer is built.

A spec with ``sinks`` gives the layer a learned parameter ``sinks`` (``[Hq_local]`` float32,
this rank's query heads; HF's ``self_attn.sinks``, split by heads under tensor parallelism
through its ``weight_loader``), passed to the backend with every call.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.distributed import get_tp
from engine.forward_batch import ForwardBatch
from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, unsupported_feature
from engine.layers.linear import full_tensor

#: attention kinds this layer runs (q/k/v in, one output row per query token); a sliding
#: window and logit soft-capping go to the backend with the spec (which checks them itself)
SUPPORTED_ATTENTION = frozenset({AttentionKind.FULL, AttentionKind.SLIDING})


class Attention(nn.Module):
    """Attention over the paged KV cache for one layer.

    Args:
        num_heads, num_kv_heads, head_dim: per-rank shape (Hq, Hkv, D).
        layer_id: index of the layer's K/V buffers in the pool.
        scaling: softmax scale (default: the spec's, else ``D ** -0.5``).
        spec: the layer's description (default: full attention over the paged K/V, D and
            Hkv as given); kept as ``self.spec`` with this rank's ``num_kv_heads``.
    Raises:
        NotImplementedError: a spec of a kind or feature the layer does not run yet, or a
            cache other than the paged K/V (one line naming the layer and the kind).
        ValueError: a spec whose ``head_dim`` is not ``head_dim``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int,
                 scaling: float | None = None, spec: LayerSpec | None = None):
        super().__init__()
        if spec is None:
            spec = LayerSpec(head_dim=head_dim, v_head_dim=head_dim, num_kv_heads=num_kv_heads)
        what = unsupported_feature(spec, SUPPORTED_ATTENTION, sliding_window=True,
                                   logit_softcap=True, sinks=True)
        if what is None and spec.cache != CacheKind.PAGED_KV:
            what = f"a {spec.cache.value} cache"
        if what is not None:
            raise NotImplementedError(f"layer {layer_id}: {what} is not implemented yet "
                                      "(ferry's attention layer runs full and sliding-window "
                                      "attention over the paged KV cache)")
        if spec.head_dim != head_dim:
            raise ValueError(f"layer {layer_id}: the spec's head_dim {spec.head_dim} is not the "
                             f"layer's {head_dim}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.spec = spec if spec.num_kv_heads == num_kv_heads \
            else replace(spec, num_kv_heads=num_kv_heads)
        self.scaling = scaling if scaling is not None else spec.softmax_scale
        if spec.sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32),
                                      requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        else:
            self.sinks = None

    def _load_sinks(self, param: nn.Parameter, loaded) -> None:
        """Load HF's ``self_attn.sinks`` (``[Hq]``, the whole model's heads): this rank's
        ``num_heads`` of them, as float32.

        Raises:
            ValueError: a tensor that is not ``[num_heads * tp_size]``.
        """
        g = get_tp()
        want = self.num_heads * g.size
        if tuple(loaded.shape) != (want,):
            raise ValueError(f"sinks of shape {tuple(loaded.shape)}, expected ({want},)")
        part = loaded.narrow(0, g.rank * self.num_heads, self.num_heads)
        param.data.copy_(full_tensor(part).float())

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
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D] (into ``out`` [T, Hq*D] if given).

        k and v are None in a layer that reads another layer's K/V (its spec's
        ``kv_source_layer``): the backend stores nothing and reads the source's."""
        t = q.shape[0]
        kv_shape = (t, self.num_kv_heads, self.head_dim)
        o = fb.attn_backend.forward(q.view(t, self.num_heads, self.head_dim),
                                    None if k is None else k.view(kv_shape),
                                    None if v is None else v.view(kv_shape),
                                    self.layer_id, self.scaling, fb,
                                    None if out is None
                                    else out.view(t, self.num_heads, self.head_dim),
                                    spec=self.spec, sinks=self.sinks)
        return o.view(t, self.num_heads * self.head_dim)
