"""The torch-native backend: the pure-torch reference kernels of ``kernels/reference.py``.

The CPU default. It runs on any device, but its kernels read lengths on the host (a sync
per layer), so it cannot be captured in a decode graph (``supports_graphs`` is False; the
model runner then runs decode eagerly). The reference kernels are checked against
``F.scaled_dot_product_attention`` in ``tests/unit/test_reference_attention.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from kernels import reference

if TYPE_CHECKING:
    from engine.executor.forward_batch import ForwardBatch


class TorchNativeAttnBackend(AttentionBackend):
    """Extend and decode attention with ``extend_attention_ref`` / ``decode_attention_ref``."""

    def init_forward(self, fb: ForwardBatch) -> None:
        """Views of the decode requests' rows (no copies, no device work)."""
        first, nd = self.decode_rows(fb)
        fb.attn_meta = None if nd == 0 else AttentionMetadata(
            nd, fb.req_pool_indices[first:], fb.seq_lens[first:])

    def store_kv(self, k_buffer, v_buffer, loc, k, v) -> None:
        reference.store_kv_ref(k_buffer, v_buffer, loc, k, v)

    def forward_extend(self, q, k, v, o, k_buffer, v_buffer, fb: ForwardBatch,
                       sm_scale: float) -> None:
        rows = slice(0, fb.num_extends)
        reference.extend_attention_ref(
            q, k, v, o, k_buffer, v_buffer, fb.req_to_token, fb.req_pool_indices[rows],
            fb.seq_lens[rows], fb.extend_seq_lens[rows], fb.extend_start_loc[rows], sm_scale)

    def forward_decode(self, q: torch.Tensor, o: torch.Tensor, k_buffer: torch.Tensor,
                       v_buffer: torch.Tensor, fb: ForwardBatch, sm_scale: float) -> None:
        m = self._meta(fb)
        reference.decode_attention_ref(q, k_buffer, v_buffer, o, fb.req_to_token,
                                       m.req_pool_indices, m.seq_lens, sm_scale)
