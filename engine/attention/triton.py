"""The Triton backend: the kernels of ``kernels/`` (the CUDA and XPU default).

Decode is SGLang's split-KV decode with an LSE merge (``kernels/decode_attention.py``):
the per-request split counts and the fp32 split workspaces are metadata, built once per
step. Extend is ``kernels/extend_attention.py``; the K/V store is ``kernels/kv_store.py``.

The kernels are imported when the backend is built, so the registry can name this class on
a machine without Triton. On the CPU the kernels run only in Triton's interpreter
(``TRITON_INTERPRET=1``, the kernel tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.forward_batch import ForwardBatch


@dataclass
class TritonMetadata(AttentionMetadata):
    """:class:`AttentionMetadata` plus the split-KV decode state.

    Attributes:
        num_kv_splits: ``[Bd]`` int32 KV splits per request (``choose_num_kv_splits``).
        attn_logits: ``[Bd, Hq, max_kv_splits, D]`` fp32 partial outputs (workspace).
        attn_lse: ``[Bd, Hq, max_kv_splits]`` fp32 log-sum-exp per split (workspace).
    """

    num_kv_splits: torch.Tensor | None = None
    attn_logits: torch.Tensor | None = None
    attn_lse: torch.Tensor | None = None


class TritonAttnBackend(AttentionBackend):
    """Triton extend, split-KV decode and K/V store.

    Args: as :class:`AttentionBackend`, plus ``max_kv_splits``: the split axis of the decode
    workspaces (the most splits of one request's KV).
    """

    supports_graphs = True
    rounds_new_kv_to_pool = True   # kernels/extend_attention.py, the KV_FP8 path

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 device: str | torch.device = "cpu", num_sms: int = 132,
                 waves: int | None = None, max_kv_splits: int = 16, layer_specs=None):
        from kernels.decode_attention import (
            choose_num_kv_splits,
            decode_attention_fwd,
            default_waves,
        )

        super().__init__(num_heads, num_kv_heads, head_dim, device=device, num_sms=num_sms,
                         waves=waves or default_waves(torch.device(device).type),
                         layer_specs=layer_specs)
        from kernels.extend_attention import extend_attention_fwd
        from kernels.kv_store import store_kv

        self.max_kv_splits = max_kv_splits
        self._choose_splits = choose_num_kv_splits
        self._decode, self._extend, self._store = decode_attention_fwd, extend_attention_fwd, store_kv
        # decode graphs' static split counts [max_bs] int32 and workspaces (init_capture)
        self._graph_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ---- metadata -----------------------------------------------------------------------
    def _workspaces(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (n, self.num_heads, self.max_kv_splits)
        return (torch.empty(shape + (self.max_head_dim,), dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device))

    def init_forward(self, fb: ForwardBatch) -> None:
        """Split counts (on the device) and fresh workspaces for the step's decode requests.

        The decode tail of a mixed step gets its own copies of its rows: a slice at request
        ``first`` would move the pointers' 16-byte alignment with ``first``, and Triton
        compiles a new kernel variant for each alignment, in the middle of serving (0.45 s
        stalls of every stream on the H200).
        """
        first, nd = self.decode_rows(fb)
        if nd == 0:
            fb.attn_meta = None
            return
        rows, seq_lens = fb.req_pool_indices[first:], fb.seq_lens[first:]
        if first:
            rows, seq_lens = rows.clone(), seq_lens.clone()
        splits = self._choose_splits(seq_lens, self.num_kv_heads, self.max_kv_splits,
                                     self.num_sms, waves=self.waves)
        logits, lse = self._workspaces(nd, seq_lens.device)
        fb.attn_meta = TritonMetadata(nd, rows, seq_lens, splits, logits, lse)

    def init_capture(self, max_bs: int) -> None:
        """Static split counts [max_bs] int32 and workspaces for decode graphs."""
        splits = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_bufs = (splits, *self._workspaces(max_bs, self.device))

    def init_forward_graph(self, fb: ForwardBatch) -> None:
        """The split counts are computed on the device from the static ``fb.seq_lens`` into
        the static buffer, inside the captured graph; the workspaces are static slices.

        Raises:
            RuntimeError: :meth:`init_capture` was not called, or ``fb`` is not a DECODE
                step within its ``max_bs``.
        """
        bs = fb.batch_size
        if self._graph_bufs is None or not fb.is_decode or bs > self._graph_bufs[0].shape[0]:
            raise RuntimeError("init_forward_graph needs init_capture(max_bs) and a DECODE "
                               "step of at most max_bs requests")
        splits, logits, lse = (t[:bs] for t in self._graph_bufs)
        self._choose_splits(fb.seq_lens, self.num_kv_heads, self.max_kv_splits, self.num_sms,
                            waves=self.waves, out=splits)
        fb.attn_meta = TritonMetadata(bs, fb.req_pool_indices, fb.seq_lens, splits, logits, lse)

    # ---- kernels ------------------------------------------------------------------------
    def store_kv(self, k_buffer, v_buffer, loc, k, v) -> None:
        self._store(k_buffer, v_buffer, loc, k, v)

    def forward_extend(self, q, k, v, o, k_buffer, v_buffer, fb: ForwardBatch,
                       sm_scale: float, **variants) -> None:
        """:meth:`AttentionBackend.forward_extend`; ``variants`` (sliding_window,
        logit_softcap, sinks) and the step's ``fb.key_limit`` (bidirectional image spans)
        go to ``extend_attention_fwd``."""
        rows = slice(0, fb.num_extends)
        self._extend(q, k, v, o, k_buffer, v_buffer, fb.req_to_token, fb.req_pool_indices[rows],
                     fb.seq_lens[rows], fb.extend_seq_lens[rows], fb.extend_start_loc[rows],
                     sm_scale, max_extend_len=fb.max_extend_len, key_limit=fb.key_limit,
                     **variants)

    def forward_decode(self, q: torch.Tensor, o: torch.Tensor, k_buffer: torch.Tensor,
                       v_buffer: torch.Tensor, fb: ForwardBatch, sm_scale: float,
                       **variants) -> None:
        """:meth:`AttentionBackend.forward_decode`; ``variants`` (sliding_window,
        logit_softcap, sinks) go to ``decode_attention_fwd``."""
        m = self._meta(fb)
        logits = m.attn_logits    # sized by the widest head: this layer's heads' part
        if logits.shape[-1] != q.shape[-1]:
            logits = logits[..., :q.shape[-1]]
        self._decode(q, k_buffer, v_buffer, o, fb.req_to_token, m.req_pool_indices,
                     m.seq_lens, sm_scale, num_kv_splits=m.num_kv_splits,
                     max_kv_splits=self.max_kv_splits, attn_logits=logits,
                     attn_lse=m.attn_lse, **variants)
