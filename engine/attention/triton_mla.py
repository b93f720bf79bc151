"""The Triton backend of a model with latent-attention layers (DeepSeek-V2/V3's MLA).

:func:`engine.attention.create_attention_backend` builds this instead of
:class:`~engine.attention.triton.TritonAttnBackend` when the model's layers are ``LATENT``.
The ``MLAttention`` layers (``engine/layers/mla.py``) see ``runs_latent`` and call
:meth:`TritonMLABackend.mla_decode` and :meth:`TritonMLABackend.mla_extend` with their
projections done; this backend keeps the per-step state both read, built once per step:

- decode rows (a DECODE step, or the tail of a mixed one): split counts
  (``kernels.mla.decode.choose_mla_splits``, on the device) and the fp32 split workspaces,
  whose split axis is a host function of the batch size alone
  (``kernels.mla.decode.mla_split_cap``), so a decode graph keeps them in one static buffer
  shared by its batch sizes (:meth:`init_capture`);
- extend rows: the pool slots of each extending request's whole sequence and where each
  starts (``kernels.mla.prefill.ragged_latent_slots``, device ops sized by the step's host
  lengths: no sync, no loop over requests), which the layers gather and decompress.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.triton import TritonAttnBackend
from engine.forward_batch import ForwardBatch
from engine.layer_spec import AttentionKind


@dataclass
class MLAMetadata(AttentionMetadata):
    """:class:`AttentionMetadata` of the decode rows plus the MLA state (module docstring).

    Attributes:
        num_kv_splits: ``[Bd]`` int32 splits per decode request.
        max_splits: the decode grid's split axis (host int).
        attn_logits, attn_lse: fp32 ``[Bd, H, max_splits, R]`` / ``[Bd, H, max_splits]``.
        kv_slots: ``[S]`` int64 pool slots of the extending requests' sequences (None in a
            step without extends).
        kv_start: ``[Be]`` int32 first row of each extending request in ``kv_slots``.
    """

    num_kv_splits: torch.Tensor | None = None
    max_splits: int = 1
    attn_logits: torch.Tensor | None = None
    attn_lse: torch.Tensor | None = None
    kv_slots: torch.Tensor | None = None
    kv_start: torch.Tensor | None = None


class TritonMLABackend(TritonAttnBackend):
    """Triton MLA: absorbed-form decode, MHA-form extend (``kernels/mla/``).

    Args: as :class:`TritonAttnBackend`; ``layer_specs`` must be ``LATENT`` (their
    ``kv_lora_rank`` sizes the decode workspaces). ``max_kv_splits`` bounds the splits of
    one request (default 64: a lone 4k request of a 16-head model spreads over 64 programs,
    of a 128-head one over 33 splits x 4 programs, the 132 SMs of an H200).
    ``kv_dtype``: the latent pool's dtype (None: 16-bit), which picks the decode kernel's
    launch configuration (``kernels/mla/decode_config.py``) and so its programs per split.
    Raises:
        NotImplementedError: a layer that is not ``LATENT``.
        ValueError: no layer specs (the latent rank is unknown).
    """

    supported_attention = frozenset({AttentionKind.LATENT})
    #: the ``MLAttention`` layers call :meth:`mla_decode` / :meth:`mla_extend`
    runs_latent = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 device: str | torch.device = "cpu", num_sms: int = 132,
                 waves: int | None = None, max_kv_splits: int = 64, layer_specs=None,
                 kv_dtype: torch.dtype | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, device=device, num_sms=num_sms,
                         waves=waves, max_kv_splits=max_kv_splits, layer_specs=layer_specs)
        if not self.layer_specs:
            raise ValueError("TritonMLABackend needs the model's layer specs (kv_lora_rank)")
        from kernels.mla import decode, decode_config, prefill

        self.kv_lora_rank = self.layer_specs[0].kv_lora_rank
        self.kv_fp8 = kv_dtype is not None and kv_dtype.itemsize == 1
        # the decode kernel's launch config, for its programs per split (the kernel picks
        # the same one itself, or a smaller one on a device with less shared memory)
        self.decode_config = decode_config.mla_decode_config(
            num_heads, self.kv_fp8, kv_dtype, torch.device(device).type)
        self._k_decode, self._k_prefill = decode, prefill
        self._graph_flat: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- metadata -----------------------------------------------------------------------
    def _split_cap(self, bs: int) -> int:
        return self._k_decode.mla_split_cap(bs, self.num_heads, self.num_sms, self.waves,
                                            self.max_kv_splits, config=self.decode_config)

    def _decode_state(self, rows: torch.Tensor, seq_lens: torch.Tensor,
                      splits_out: torch.Tensor | None = None,
                      flat: torch.Tensor | None = None) -> MLAMetadata:
        bs = rows.shape[0]
        cap = self._split_cap(bs)
        splits = self._k_decode.choose_mla_splits(seq_lens, self.num_heads, cap, self.num_sms,
                                                  waves=self.waves, config=self.decode_config,
                                                  out=splits_out)
        logits, lse = self._k_decode.mla_decode_workspaces(bs, self.num_heads, cap,
                                                           self.kv_lora_rank, seq_lens.device,
                                                           flat)
        return MLAMetadata(bs, rows, seq_lens, splits, cap, logits, lse)

    def init_forward(self, fb: ForwardBatch) -> None:
        """Decode state of the step's decode rows (their own copies in a mixed step: see
        :meth:`TritonAttnBackend.init_forward`) and the extending requests' slots."""
        first, nd = self.decode_rows(fb)
        if nd:
            rows, seq_lens = fb.req_pool_indices[first:], fb.seq_lens[first:]
            if first:
                rows, seq_lens = rows.clone(), seq_lens.clone()
            meta = self._decode_state(rows, seq_lens)
        else:
            meta = MLAMetadata(0, fb.req_pool_indices[:0], fb.seq_lens[:0])
        ne = fb.num_extends
        if ne:
            lens = fb.seq_lens_cpu[:ne] if len(fb.seq_lens_cpu) == fb.batch_size \
                else fb.seq_lens[:ne].tolist()
            meta.kv_slots, meta.kv_start = self._k_prefill.ragged_latent_slots(
                fb.req_to_token, fb.req_pool_indices[:ne], fb.seq_lens[:ne], int(sum(lens)))
        fb.attn_meta = meta

    def init_capture(self, max_bs: int) -> None:
        """Static split counts ``[max_bs]`` int32 and one flat fp32 workspace that fits the
        largest of the batch sizes' workspaces."""
        need = max(b * self.num_heads * self._split_cap(b) * (self.kv_lora_rank + 1)
                   for b in range(1, max_bs + 1))
        self._graph_flat = (torch.ones(max_bs, dtype=torch.int32, device=self.device),
                            torch.empty(need, dtype=torch.float32, device=self.device))

    def init_forward_graph(self, fb: ForwardBatch) -> None:
        """The split counts computed on the device into the static buffer (captured), the
        workspaces views of the static one.

        Raises:
            RuntimeError: :meth:`init_capture` was not called, or ``fb`` is not a DECODE
                step within its ``max_bs``.
        """
        bs = fb.batch_size
        if self._graph_flat is None or not fb.is_decode or bs > self._graph_flat[0].shape[0]:
            raise RuntimeError("init_forward_graph needs init_capture(max_bs) and a DECODE "
                               "step of at most max_bs requests")
        splits, flat = self._graph_flat
        fb.attn_meta = self._decode_state(fb.req_pool_indices, fb.seq_lens, splits[:bs], flat)

    # ---- kernels ------------------------------------------------------------------------
    def mla_decode(self, q_lat: torch.Tensor, q_pe: torch.Tensor, o: torch.Tensor,
                   latent: torch.Tensor, fb: ForwardBatch, sm_scale: float,
                   kv_scale: float = 1.0) -> None:
        """Absorbed decode of the step's decode rows: q_lat ``[Bd, H, R]``, q_pe
        ``[Bd, H, P]``, o ``[Bd, H, R]`` (written), latent the layer's ``[S, 1, R + P]``
        (an FP8 one holding ``latent / kv_scale``).

        Raises:
            RuntimeError: ``init_forward`` was not called for the step.
        """
        m = self._meta(fb)
        self._k_decode.mla_decode_fwd(q_lat, q_pe, latent, o, fb.req_to_token,
                                      m.req_pool_indices, m.seq_lens, sm_scale,
                                      m.num_kv_splits, m.max_splits, m.attn_logits, m.attn_lse,
                                      kv_scale=kv_scale)

    def extend_slots(self, fb: ForwardBatch) -> torch.Tensor:
        """``[S]`` int64 pool slots of the extending requests' whole sequences, in order."""
        m = self._meta(fb)
        if m.kv_slots is None:
            raise RuntimeError("the step has no extend rows in its MLA metadata")
        return m.kv_slots

    def mla_extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor,
                   k_pe: torch.Tensor, v: torch.Tensor, o: torch.Tensor, fb: ForwardBatch,
                   sm_scale: float) -> None:
        """MHA-form extend of the first ``fb.num_extends`` requests: q_nope ``[Te, H, N]``,
        q_pe ``[Te, H, P]``; k_nope ``[S, H, N]``, k_pe ``[S, P]``, v ``[S, H, V]`` over
        :meth:`extend_slots`'s rows; o ``[Te, H, V]`` (written)."""
        m, ne = self._meta(fb), fb.num_extends
        self._k_prefill.mla_prefill_fwd(
            q_nope, q_pe, k_nope, k_pe, v, o, fb.seq_lens[:ne], fb.extend_seq_lens[:ne],
            fb.extend_start_loc[:ne], m.kv_start, sm_scale, fb.max_extend_len)


__all__ = ["MLAMetadata", "TritonMLABackend"]
