"""The torch-native backend: the pure-torch reference kernels of ``kernels/reference.py``.

The CPU default. It runs on any device; it cannot be captured in a decode graph
(``supports_graphs`` is False; the model runner then runs decode eagerly). The gather
indices, length masks and causal masks depend only on the step, so :meth:`init_forward`
builds them once (from the step's host lists: no device sync) and every layer reuses them
(``decode_attention_sdpa`` / ``extend_attention_sdpa``), which run torch's fused
``F.scaled_dot_product_attention`` (decode: the KV heads' query groups passed as query
positions; extend: one call per request, ``is_causal`` without a prefix), 2-3x faster than
the einsum/matmul references on the CPU. Both paths are checked against float64 attention in
``tests/unit/kernels/test_reference_attention.py``.

On the CPU, when ferry's C++ kernels build (:mod:`kernels.cpu_ops`; ``fused_ops=True``,
i.e. no ``--disable-fused-ops``) and the KV cache has the model's dtype (float32 or
bfloat16), decode attention reads the paged cache directly
(:func:`kernels.cpu_ops.decode_attention`: no gather, no padded block) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.forward_batch import ForwardBatch
from engine.layer_spec import AttentionKind
from kernels import cpu_ops, reference


@dataclass
class TorchNativeMetadata(AttentionMetadata):
    """The step's decode gather plan and the extend requests' prefix slots / causal masks."""

    decode: reference.DecodePlan | None = None
    extend: list[reference.ExtendItem] | None = None
    #: the decode rows' int64 ``seq_lens`` for the C++ kernel (None: the planned path)
    decode_lens64: torch.Tensor | None = None


class TorchNativeAttnBackend(AttentionBackend):
    """Extend and decode attention with the planned reference kernels (and, on the CPU,
    the C++ paged decode kernel where it builds). ``LATENT`` layers (MLA) are accepted:
    they attend over the latent pool themselves (``engine/layers/mla.py``'s torch path)."""

    supported_attention: ClassVar[frozenset[AttentionKind]] = frozenset(
        {AttentionKind.FULL, AttentionKind.SLIDING, AttentionKind.LATENT})

    def __init__(self, *args, fused_ops: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        #: whether decode runs :func:`kernels.cpu_ops.decode_attention` (for a KV cache in
        #: the query's dtype); built on first use, False where it cannot build
        self.cpu_kernels = fused_ops and self.device.type == "cpu" and cpu_ops.load()

    def _use_cpu_kernel(self, fb: ForwardBatch) -> bool:
        """The C++ decode kernel reads float32/bfloat16 caches (an fp8 one is gathered and
        upcast by the planned path)."""
        buf = next((b for b in fb.k_buffers if b is not None), None)
        return self.cpu_kernels and buf is not None and fb.v_buffers[0] is not None \
            and buf.dtype in (torch.float32, torch.bfloat16)

    def init_forward(self, fb: ForwardBatch) -> None:
        """Build the step's plans once (the layers all read them)."""
        first, nd = self.decode_rows(fb)
        rows, lens = fb.req_pool_indices[first:], fb.seq_lens[first:]
        meta = TorchNativeMetadata(nd, rows, lens)
        host_lens = fb.seq_lens_cpu if len(fb.seq_lens_cpu) == fb.batch_size else None
        if nd and self._use_cpu_kernel(fb):
            meta.decode_lens64 = lens.long()
        elif nd:
            max_len = max(host_lens[first:]) if host_lens is not None else None
            meta.decode = reference.decode_plan(fb.req_to_token, rows, lens, max_len)
        if first:  # the extend requests, the rows before the decodes
            ne = slice(0, first)
            ext = fb.extend_seq_lens_cpu[ne] if len(fb.extend_seq_lens_cpu) == fb.batch_size \
                else fb.extend_seq_lens[ne].tolist()
            starts = fb.extend_start_loc[ne].tolist()
            limits = fb.key_limit.tolist() if fb.key_limit is not None else None
            meta.extend = reference.extend_plan(
                fb.req_to_token, fb.req_pool_indices[ne].tolist(),
                host_lens[ne] if host_lens is not None else fb.seq_lens[ne].tolist(), ext, starts,
                limits)
        fb.attn_meta = meta

    def store_kv(self, k_buffer, v_buffer, loc, k, v) -> None:
        reference.store_kv_ref(k_buffer, v_buffer, loc, k, v)

    def forward_extend(self, q, k, v, o, k_buffer, v_buffer, fb: ForwardBatch,
                       sm_scale: float, **variants) -> None:
        """:meth:`AttentionBackend.forward_extend`; ``variants`` (sliding_window,
        logit_softcap, sinks) go to the references (``extend_attention_sdpa`` runs the
        soft-cap and the sinks through ``extend_attention_planned``); the step's
        ``fb.key_limit`` (bidirectional image spans) is in the plan's masks."""
        plan = getattr(fb.attn_meta, "extend", None)
        if plan is None:  # no init_forward plan: build it for this layer
            rows = slice(0, fb.num_extends)
            reference.extend_attention_ref(
                q, k, v, o, k_buffer, v_buffer, fb.req_to_token, fb.req_pool_indices[rows],
                fb.seq_lens[rows], fb.extend_seq_lens[rows], fb.extend_start_loc[rows],
                sm_scale, key_limit=fb.key_limit, **variants)
            return
        reference.extend_attention_sdpa(q, k, v, o, k_buffer, v_buffer, plan, sm_scale,
                                        **variants)

    def forward_decode(self, q: torch.Tensor, o: torch.Tensor, k_buffer: torch.Tensor,
                       v_buffer: torch.Tensor, fb: ForwardBatch, sm_scale: float,
                       **variants) -> None:
        """:meth:`AttentionBackend.forward_decode`; ``variants`` (sliding_window,
        logit_softcap, sinks) go to the C++ kernel or the references."""
        m = self._meta(fb)
        lens64 = getattr(m, "decode_lens64", None)
        if lens64 is not None and q.dtype == k_buffer.dtype:
            cpu_ops.decode_attention(q, k_buffer, v_buffer, o, fb.req_to_token,
                                     m.req_pool_indices, lens64, sm_scale, **variants)
            return
        plan = getattr(m, "decode", None)
        if plan is None:  # no init_forward plan: build it for this layer
            plan = reference.decode_plan(fb.req_to_token, m.req_pool_indices, m.seq_lens)
        reference.decode_attention_sdpa(q, k_buffer, v_buffer, o, plan, sm_scale, **variants)
