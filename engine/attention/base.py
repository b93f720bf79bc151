"""The attention-backend interface: what every implementation of paged attention provides.

A backend runs one layer's attention for one step over the paged KV cache (see
``engine/kv/pool.py``): it stores the new tokens' K/V into the pool at
``forward_batch.out_cache_loc``, then attends through ``req_to_token``. The shape follows
SGLang's ``AttentionBackend`` and mini-sglang's ``attention/base.py``: per-step metadata is
built once (:meth:`AttentionBackend.init_forward`) and every layer reads it; graph support
keeps that metadata in static buffers (:meth:`AttentionBackend.init_capture`).

Steps (``ForwardBatch.mode``):
  - DECODE: one new token per request; all of it goes to :meth:`forward_decode`.
  - EXTEND: prefill with or without a cached prefix. A mixed EXTEND step (chunked prefill
    with the running decodes) ends with ``num_decodes`` one-token requests: the first
    ``batch_size - num_decodes`` requests go to :meth:`forward_extend`, the tail to
    :meth:`forward_decode` (the extend kernel would spend a BLOCK_M-row tile per query head
    on each one-token query; the decode kernel reads their KV once per KV head).

Per layer: the backend is built with the model's layer descriptions
(``layer_specs``, :class:`engine.layer_spec.LayerSpec`, one per layer, this rank's) and
refuses at construction any layer it cannot run (:meth:`AttentionBackend.check_layer_specs`:
today every backend runs full attention only); each call of :meth:`AttentionBackend.forward`
also gets its layer's spec, where a backend that runs windows, soft-capping or sinks picks
the kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

# the step and its per-step attention state live below the backends (the layers, models and
# executor read them too); AttentionMetadata is re-exported here for the backends
from engine.forward_batch import AttentionMetadata, ForwardBatch
from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, unsupported_feature

__all__ = ["AttentionBackend", "AttentionMetadata"]


class AttentionBackend(ABC):
    """Paged attention for the layers of one model (one instance per model runner).

    Args:
        num_heads: query heads per rank (Hq).
        num_kv_heads: KV heads per rank (Hkv); ``Hq % Hkv == 0``.
        head_dim: D.
        device: where static graph buffers live (:meth:`init_capture`).
        num_sms: compute units of the device (SMs, Xe cores, CPU cores), for backends that
            size their launch to it.
        waves: programs wanted per compute unit (the decode split-KV heuristic); None for
            the backend's default.
        layer_specs: the model's layers (:meth:`engine.models.base.CausalLM.layer_specs`,
            this rank's), kept as ``self.layer_specs``; None: not checked (tests of the
            kernels alone).
    Raises:
        ValueError: Hq not a multiple of Hkv.
        NotImplementedError: a layer the backend does not run (:meth:`check_layer_specs`).
    """

    #: whether the decode graph runner may capture this backend's decode step (no host
    #: syncs, metadata in static buffers)
    supports_graphs: ClassVar[bool] = False
    #: the attention kinds this backend runs, and the per-layer features beyond plain
    #: causal attention (a window, score soft-capping, sinks) its kernels take
    supported_attention: ClassVar[frozenset[AttentionKind]] = frozenset(
        {AttentionKind.FULL, AttentionKind.SLIDING})
    # the Triton kernels, the torch references and the C++ CPU decode run every variant
    # (kernels/attention_variants.py); a layer's window and soft-cap come from its spec, its
    # sinks from the ``Attention`` layer's learned ``sinks`` tensor (gpt-oss)
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = True
    #: whether forward_extend rounds the new tokens' K/V to an FP8 pool's dtype itself (the
    #: Triton kernel, in registers); otherwise :meth:`forward` casts them there and back
    rounds_new_kv_to_pool: ClassVar[bool] = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 device: str | torch.device = "cpu", num_sms: int = 1,
                 waves: int | None = None, layer_specs: Sequence[LayerSpec] | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        self.layer_specs = tuple(layer_specs or ())
        self.check_layer_specs(self.layer_specs)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        #: the widest head of the paged layers (Gemma 4's global layers are wider than
        #: ``head_dim``): per-head workspaces are sized by it
        self.max_head_dim = max([head_dim] + [s.head_dim for s in self.layer_specs
                                              if s.cache == CacheKind.PAGED_KV])
        self.device = torch.device(device)
        self.num_sms = num_sms
        self.waves = waves or 1

    @classmethod
    def check_layer_specs(cls, specs: Sequence[LayerSpec]) -> None:
        """Refuse a model whose layers this backend cannot run.

        Raises:
            NotImplementedError: one line naming the first such layer, what it needs and
                the backend.
        """
        for i, spec in enumerate(specs):
            what = unsupported_feature(spec, cls.supported_attention,
                                       sliding_window=cls.supports_sliding_window,
                                       logit_softcap=cls.supports_logit_softcap,
                                       sinks=cls.supports_sinks)
            if what is not None:
                runs = ", ".join(sorted(k.value for k in cls.supported_attention))
                raise NotImplementedError(
                    f"layer {i} needs {what}, which the {cls.__name__} attention backend "
                    f"does not run yet (it runs: {runs} attention)")

    # ---- metadata -----------------------------------------------------------------------
    @abstractmethod
    def init_forward(self, fb: ForwardBatch) -> None:
        """Build the step's metadata into ``fb.attn_meta`` (once per step, before forward)."""

    def init_step(self, fb: ForwardBatch) -> None:
        """:meth:`init_forward` of the step and of its windowed view ``fb.swa`` (a model
        whose windowed layers keep a pool of their own), if any."""
        self.init_forward(fb)
        if fb.swa is not None:
            self.init_forward(fb.swa)

    def init_capture(self, max_bs: int) -> None:
        """Allocate the static metadata buffers of decode graphs of up to ``max_bs`` requests.

        Raises:
            NotImplementedError: the backend does not support graphs (``supports_graphs``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support device graphs")

    def init_forward_graph(self, fb: ForwardBatch) -> None:
        """:meth:`init_forward` for a DECODE step whose tensors are a graph's static buffers.

        Called while capturing (and warming up); the metadata lives in the buffers of
        :meth:`init_capture` and any device work is captured, so a replay recomputes it from
        the static ``seq_lens`` with no host-side hook.

        Raises:
            NotImplementedError: the backend does not support graphs.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support device graphs")

    # ---- kernels ------------------------------------------------------------------------
    @abstractmethod
    def store_kv(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        """``k_buffer[loc[i]] = k[i]`` (same for v): loc [T] int64; k, v [T, Hkv, D], cast
        to the pool's dtype."""

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                       fb: ForwardBatch, sm_scale: float, *, sliding_window: int | None = None,
                       logit_softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> None:
        """Extend attention of the first ``fb.num_extends`` requests into ``o``.

        q, o [Te, Hq, D] and k, v [Te, Hkv, D] are their tokens' rows (already stored in the
        pool); each new token sees its request's prefix and the new tokens up to itself. The
        variants as in :meth:`forward`.
        """

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, o: torch.Tensor, k_buffer: torch.Tensor,
                       v_buffer: torch.Tensor, fb: ForwardBatch, sm_scale: float, *,
                       sliding_window: int | None = None, logit_softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> None:
        """Decode attention of the step's ``fb.attn_meta.num_decodes`` decode requests.

        q, o [Bd, Hq, D]: one query row per request, in ``fb.attn_meta``'s order. The
        variants as in :meth:`forward`.

        Raises:
            RuntimeError: ``init_forward`` was not called for the step.
        """

    # ---- one layer ----------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                sm_scale: float, fb: ForwardBatch, out: torch.Tensor | None = None, *,
                spec: LayerSpec | None = None, sliding_window: int | None = None,
                logit_softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store the new K/V of layer ``layer_id``, then attend.

        Args:
            q: [T, Hq, D]; k, v: [T, Hkv, D] (the step's new tokens), or both None for a
                layer that reads another layer's K/V (``LayerSpec.kv_source_layer``; its
                ``fb.k_buffers[layer_id]`` is the source's, which stored this step's K/V
                already): nothing is stored.
            sm_scale: softmax scale, usually ``D ** -0.5`` (Gemma: ``query_pre_attn_scalar
                ** -0.5``).
            fb: the step (``init_forward`` done).
            out: optional [T, Hq, D] view to write into (e.g. a graph runner's static buffer).
            spec: the layer's description (the ``Attention`` layer's ``spec``; None: full
                attention). Every spec the backend was built with is one it runs (checked
                at construction); its window and soft-cap apply unless given below.
            sliding_window: W >= 1: a query at position p sees keys ``p - W + 1 .. p``
                (HF's sliding window); None: the spec's, else all earlier keys.
            logit_softcap: cap > 0: scores ``cap * tanh(s / cap)`` after the scale (Gemma 2);
                None: the spec's, else none.
            sinks: ``[Hq]`` float32 per-head logits in the softmax denominator only (gpt-oss).
        Returns:
            [T, Hq, D] in q's dtype (``out`` when given).
        Raises:
            ValueError: a variant out of range (``kernels.reference.check_variants``).
        """
        if spec is not None:
            sliding_window = spec.sliding_window if sliding_window is None else sliding_window
            logit_softcap = spec.logit_softcap if logit_softcap is None else logit_softcap
        variants = {"sliding_window": sliding_window, "logit_softcap": logit_softcap,
                    "sinks": sinks}
        if fb.swa is not None and spec is not None and spec.attention == AttentionKind.SLIDING:
            fb = fb.swa  # the windowed pool's slots and table (engine/kv/windowed.py)
        kb, vb = fb.k_buffers[layer_id], fb.v_buffers[layer_id]
        if k is not None:
            self.store_kv(kb, vb, fb.out_cache_loc, k, v)
        o = torch.empty_like(q) if out is None else out
        if fb.is_decode:
            self.forward_decode(q, o, kb, vb, fb, sm_scale, **variants)
            return o
        nd = fb.num_decodes
        te = q.shape[0] - nd             # tokens of the requests that extend
        if fb.num_extends:
            if k is None:  # a kv_source_layer reader: the source stored this step's K/V
                loc = fb.out_cache_loc[:te]
                k, v = kb[loc].to(q.dtype), vb[loc].to(q.dtype)
            ke, ve = k[:te], v[:te]
            if kb.dtype != k.dtype and not self.rounds_new_kv_to_pool:
                # an fp8 cache: attend to the new tokens as stored, like to the prefix, so the
                # result does not depend on where the chunks (and so the load) cut the prompt
                ke, ve = ke.to(kb.dtype).to(k.dtype), ve.to(vb.dtype).to(v.dtype)
            self.forward_extend(q[:te], ke, ve, o[:te], kb, vb, fb, sm_scale, **variants)
        if nd:
            self.forward_decode(q[te:], o[te:], kb, vb, fb, sm_scale, **variants)
        return o

    @staticmethod
    def _meta(fb: ForwardBatch) -> AttentionMetadata:
        if fb.attn_meta is None:
            raise RuntimeError("the step has decode requests but no attention metadata: call "
                               "attn_backend.init_forward(fb) before the model's forward")
        return fb.attn_meta

    @staticmethod
    def decode_rows(fb: ForwardBatch) -> tuple[int, int]:
        """``(first, num_decodes)``: the decode requests of ``fb`` are ``first:``."""
        nd = fb.batch_size if fb.is_decode else fb.num_decodes
        return fb.batch_size - nd, nd
