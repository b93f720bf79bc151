"""The attention layer and its backend.

``RadixAttention``-style layer: the model gives q/k/v of the new tokens; the backend stores
k/v into the paged pool at ``forward_batch.out_cache_loc`` and runs extend or decode
attention. On cuda/xpu the Triton kernels in ``kernels/`` run; on the CPU the torch
references in ``kernels/reference.py`` run. Both read K/V through ``req_to_token``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.executor.forward_batch import ForwardBatch
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
        """Per-step metadata shared by all layers (called once per step, before forward).

        For the decode requests of the step (all of a DECODE step, the ``num_decodes`` tail
        of a mixed EXTEND step): their KV split counts and the fp32 split workspaces, so the
        layers do not allocate them again.
        """
        nd = fb.batch_size if fb.is_decode else fb.num_decodes
        if nd == 0 or not self.use_triton:
            return
        from kernels.decode_attention import choose_num_kv_splits

        first = fb.batch_size - nd
        seq_lens = fb.seq_lens[first:]
        if first:
            # The decode tail of a mixed step gets its own copies of its rows: a slice at
            # request `first` would move the pointers' 16-byte alignment with `first`, and
            # Triton compiles a new kernel variant for each alignment, in the middle of
            # serving (0.45 s stalls of every stream on the H200).
            seq_lens = seq_lens.clone()
            fb.attn_meta["req_pool_indices"] = fb.req_pool_indices[first:].clone()
            fb.attn_meta["seq_lens"] = seq_lens
        dev = seq_lens.device
        fb.attn_meta["num_kv_splits"] = choose_num_kv_splits(
            seq_lens, self.num_kv_heads, self.max_kv_splits, self.num_sms, waves=self.waves)
        fb.attn_meta["attn_logits"] = torch.empty(
            (nd, self.num_heads, self.max_kv_splits, self.head_dim), dtype=torch.float32,
            device=dev)
        fb.attn_meta["attn_lse"] = torch.empty((nd, self.num_heads, self.max_kv_splits),
                                               dtype=torch.float32, device=dev)

    def _decode_part(self, q, kb, vb, o, fb: ForwardBatch, sm_scale: float, first: int) -> None:
        """Decode attention for requests ``first:`` (one query token each, rows ``first:`` of
        q/o in a DECODE step, the tail rows in a mixed step)."""
        rows = slice(first, None)
        m = fb.attn_meta
        args = (q, kb, vb, o, fb.req_to_token,
                m.get("req_pool_indices", fb.req_pool_indices[rows]),
                m.get("seq_lens", fb.seq_lens[rows]), sm_scale)
        if self.use_triton:
            self._decode(*args, num_kv_splits=m.get("num_kv_splits"),
                         max_kv_splits=self.max_kv_splits, attn_logits=m.get("attn_logits"),
                         attn_lse=m.get("attn_lse"))
        else:
            self._decode(*args)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                sm_scale: float, fb: ForwardBatch, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        """q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D] (q's dtype), written into ``out``
        when given (a [T, Hq, D] view, e.g. a graph runner's static buffer)."""
        kb, vb = fb.k_buffers[layer_id], fb.v_buffers[layer_id]
        self._store(kb, vb, fb.out_cache_loc, k, v)
        o = torch.empty_like(q) if out is None else out
        if fb.is_decode:
            self._decode_part(q, kb, vb, o, fb, sm_scale, 0)
            return o
        nd = fb.num_decodes
        ne = fb.batch_size - nd          # requests (and their tokens) that extend
        te = q.shape[0] - nd
        if ne:
            rows = slice(0, ne)
            if kb.dtype != k.dtype:
                # an fp8 cache: attend to the new tokens as stored, like to the prefix, so the
                # result does not depend on where the chunks (and so the load) cut the prompt
                k, v = k[:te].to(kb.dtype).to(k.dtype), v[:te].to(vb.dtype).to(v.dtype)
            args = (q[:te], k[:te], v[:te], o[:te], kb, vb, fb.req_to_token,
                    fb.req_pool_indices[rows], fb.seq_lens[rows], fb.extend_seq_lens[rows],
                    fb.extend_start_loc[rows], sm_scale)
            if self.use_triton:
                self._extend(*args, max_extend_len=fb.max_extend_len)
            else:
                self._extend(*args)
        if nd:
            # the mixed-in decodes: the extend kernel would spend a BLOCK_M-row tile per
            # query head on each one-token query; the decode kernel reads their KV once
            # per KV head
            self._decode_part(q[te:], kb, vb, o[te:], fb, sm_scale, ne)
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
