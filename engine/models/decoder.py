"""``DecoderForCausalLM``: the causal LM over :mod:`engine.models.blocks` that every family
of ``engine/models/`` specialises.

It implements the model contract (:class:`engine.models.base.CausalLM`): the forward, the
hidden states a draft head reads, the piecewise split, the LM head (the embedding table with
``tie_word_embeddings``), and the weights by HF name (fused ``qkv_proj``/``gate_up_proj``
filled from their checkpoint parts, :mod:`engine.models.weights`). A family sets its
switches by overriding :meth:`DecoderForCausalLM._options` (q/k/v/o bias, q/k norm),
:meth:`DecoderForCausalLM._mlp` (the MLP of a layer) and :meth:`DecoderForCausalLM._decoder`
(norm placement, multipliers), and, once its layers differ from plain full attention
(a window, a scale, no rotary), :meth:`engine.models.base.CausalLM.layer_specs`. Every shape comes from
:class:`engine.models.config.ModelConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layers.attention import Attention
from engine.layers.linear import VocabEmbedding, default_weight_loader
from engine.models.base import CausalLM
from engine.models.blocks import (
    AttentionOptions,
    DecoderLayer,
    DecoderModel,
    DecoderOptions,
    GatedMLP,
)
from engine.models.config import ModelConfig
from engine.models.weights import (
    IGNORED_SUFFIXES,
    STACKED_PARAMS,
    STATIC_SCALE_SUFFIXES,
    check_fp8,
    load_tensor,
)

logger = logging.getLogger(__name__)


class DecoderForCausalLM(CausalLM):
    """Causal LM over the paged KV cache (pre-norm decoder layers of
    :mod:`engine.models.blocks`).

    Args:
        config: HF ``PretrainedConfig`` (llama-like fields; a multimodal config's
            ``text_config`` is used) or a ``ModelConfig``.
        dtype: parameter and activation dtype. Parameters are created uninitialised on the
            current default device (build it under ``with torch.device(dev):``); the RoPE table
            stays fp32.
    Raises:
        ValueError: a ``hidden_act`` without a gated activation; NotImplementedError: a layer spec of a
            kind ferry does not run yet.
    """

    #: (ferry fused param, HF checkpoint part, shard id), for the loader and quantization
    stacked_params = STACKED_PARAMS
    #: a family's own decoder layer class (GLM-4's extra post-norms); None: the one
    #: ``_decoder``'s options pick (pre-norm, post-norm or scaled-residual)
    decoder_layer: type[DecoderLayer] | None = None

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model_config = mc = ModelConfig.from_hf(config)
        self.dtype = dtype
        self.model = self._build_model(mc, dtype)
        self.tie_word_embeddings = mc.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabEmbedding(mc.vocab_size, mc.hidden_size, dtype)

    # ---- the family's switches ----------------------------------------------------------

    def _build_model(self, mc: ModelConfig, dtype: torch.dtype) -> DecoderModel:
        """The decoder (a hook: a family with other layers, norms or ropes builds its own)."""
        return DecoderModel(mc, self.layer_specs(), dtype, self._options(mc), self._mlp,
                            decoder=self._decoder(mc), layer=self.decoder_layer)

    def _options(self, config: ModelConfig) -> AttentionOptions:
        """The attention switches (default: q/k/v/o bias = ``attention_bias``, no q/k norm)."""
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def _decoder(self, config: ModelConfig) -> DecoderOptions:
        """The decoder-layer switches (default: pre-norm layers, no multipliers)."""
        return DecoderOptions()

    def _mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        """The MLP of decoder layer ``layer_id`` (a hook: MoE models return their block)."""
        return GatedMLP(config, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """One model step.

        Args:
            input_ids: [T] int64 token ids of the new tokens.
            positions: [T] int64 positions of those tokens in their sequences.
            forward_batch: the step's ``ForwardBatch`` (KV pool, backend, logits_indices).
        Returns:
            float32 logits ``[len(logits_indices), vocab]``, or ``[T, vocab]`` when
            ``forward_batch.logits_indices`` is None.
        """
        hidden = self.model(input_ids, positions, forward_batch)
        if self.capture_hidden is not None:
            self.hidden_out = hidden if self.capture_hidden == "last" else \
                torch.cat(self.model.aux_hidden, dim=-1)
        return self.compute_logits(hidden, forward_batch.logits_indices)

    def set_capture_hidden(self, mode: str | None) -> None:
        """See :meth:`engine.models.base.CausalLM.set_capture_hidden`; ``"aux"`` keeps the
        inputs of layers ``(2, L // 2, L - 3)`` (SGLang's and vLLM's EAGLE-3 default)."""
        if mode not in (None, "last", "aux"):
            raise ValueError(f"unknown hidden-state capture {mode!r}")
        n = len(self.model.layers)
        if mode == "aux" and n < 3:
            raise ValueError(f"EAGLE-3 reads the inputs of layers 2, L/2 and L-3: the target "
                             f"needs at least 3 layers, it has {n}")
        self.model.aux_layers = (2, n // 2, n - 3) if mode == "aux" else ()
        self.capture_hidden = mode
        self.hidden_out = None

    # ---- the contract's piecewise split and LM head -------------------------------------

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def piece(self, i: int, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
              attn_out: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        return self.model.piece(i, positions, input_ids, attn_out, residual)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    # ---- weights -------------------------------------------------------------------------

    def expected_weights(self) -> set[str]:
        """Keys that a complete checkpoint must fill: ``name`` or ``name:shard`` for fused.

        Parameters marked ``derived`` (FP8 scales computed from the float weights at load
        time) are not expected; an FP8 checkpoint's ``weight_scale`` tensors are."""
        keys = set()
        for name, p in self.named_parameters():
            if getattr(p, "derived", False):
                continue
            fused = [(part, shard) for f, part, shard in STACKED_PARAMS if f".{f}." in name]
            if fused:
                keys.update(f"{name}:{shard}" for _, shard in fused)
            else:
                keys.add(name)
        return keys

    def hf_weight_names(self) -> list[str]:
        """The HF checkpoint names (unfused) of every weight this model needs."""
        parts = {(fused, str(shard)): part for fused, part, shard in STACKED_PARAMS}
        names = []
        for key in sorted(self.expected_weights()):
            name, _, shard = key.partition(":")
            if shard:
                fused = next(f for f, _, s in STACKED_PARAMS
                             if f".{f}." in name and str(s) == shard)
                name = name.replace(f".{fused}.", f".{parts[(fused, shard)]}.")
            names.append(name)
        return names

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full (unsplit) shape of each HF checkpoint tensor the model needs (dummy
        weights are drawn at these shapes, so every tensor-parallel size sees the same
        model)."""
        return {name: self._hf_weight_shape(name) for name in self.hf_weight_names()}

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        """The full shape of HF checkpoint tensor ``name`` (MLP width ``inter``, default the
        config's ``intermediate_size``)."""
        mc = self.model_config
        h, d = mc.hidden_size, mc.head_dim
        inter = inter or mc.intermediate_size
        rows = {"q_proj": mc.num_heads * d, "k_proj": mc.num_kv_heads * d,
                "v_proj": mc.num_kv_heads * d, "gate_proj": inter, "up_proj": inter}
        parts = name.split(".")
        kind, leaf = parts[-2], parts[-1]
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return (mc.vocab_size, h)
        if kind in ("q_norm", "k_norm"):
            if self._options(mc).qk_norm == "full":  # one norm over the whole projection
                return (mc.num_heads * d,) if kind == "q_norm" else (mc.num_kv_heads * d,)
            return (d,)
        if kind.endswith("norm"):
            return (h,)
        if kind in rows:
            return (rows[kind], h) if leaf == "weight" else (rows[kind],)
        if kind == "o_proj":
            return (h, mc.num_heads * d) if leaf == "weight" else (h,)
        if kind == "down_proj":
            return (h, inter) if leaf == "weight" else (h,)
        raise ValueError(f"no known shape for checkpoint tensor {name}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors (any float dtype, any device).

        Fused parameters get each part through their ``weight_loader``; RoPE buffers are
        skipped, as is ``lm_head.weight`` when the embeddings are tied. Unknown names are
        logged and skipped, as are FP8 checkpoints' static scales (``STATIC_SCALE_SUFFIXES``).

        Returns:
            the keys loaded (see :meth:`expected_weights`).
        Raises:
            ValueError: a tensor of the wrong shape, or an FP8 tensor for a parameter that
                is not FP8 (an FP8 embedding or LM head).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        static_scales = 0
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name.endswith(STATIC_SCALE_SUFFIXES):
                static_scales += 1
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            for fused, part, shard in STACKED_PARAMS:
                if f".{part}." in name:
                    pname = name.replace(f".{part}.", f".{fused}.")
                    if pname in params:
                        p = params[pname]
                        check_fp8(name, p, tensor)
                        load_tensor(name, p.weight_loader, p, tensor, shard)
                        loaded.add(f"{pname}:{shard}")
                        break
            else:
                p = params.get(name)
                if p is None:
                    unexpected.append(name)
                    continue
                check_fp8(name, p, tensor)
                load_tensor(name, getattr(p, "weight_loader", default_weight_loader), p, tensor)
                loaded.add(name)
        if static_scales:
            logger.info("skipped %d static activation/KV scales of the FP8 checkpoint: "
                        "activations are quantized per token at run time", static_scales)
        if unexpected:
            logger.warning("skipped %d checkpoint tensors with unknown names: %s%s",
                           len(unexpected), ", ".join(unexpected[:8]),
                           " ..." if len(unexpected) > 8 else "")
        return loaded
