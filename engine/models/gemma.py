"""Gemma 2 and Gemma 3 (text): the decoder of :mod:`engine.models.decoder` with Gemma's
layer variants.

What differs from Llama (all from :mod:`engine.layers` and :mod:`engine.models.blocks`):

- sandwich norms (:class:`engine.models.blocks.SandwichDecoderLayer`): input, post-attention,
  pre- and post-feedforward norms, each a ``(1 + w)`` RMSNorm in fp32
  (:class:`engine.layers.norm.GemmaRMSNorm`);
- the embeddings times ``sqrt(hidden_size)`` rounded to the run dtype
  (:func:`engine.layers.linear.embedding_scale`);
- a GeGLU MLP (``hidden_activation: gelu_pytorch_tanh``,
  :class:`engine.layers.activation.GeluTanhAndMul`);
- the softmax scale ``query_pre_attn_scalar ** -0.5``; the layers HF marks
  ``sliding_attention`` (``layer_types``; Gemma 2 alternates, Gemma 3 has five local layers
  to one global) attend over the last ``sliding_window`` tokens; Gemma 2's
  ``attn_logit_softcapping`` caps the scores; all three go to the backend in each layer's
  :class:`engine.layer_spec.LayerSpec`;
- the final logits soft-capped by ``final_logit_softcapping`` (Gemma 2;
  :func:`engine.layers.logits.softcap`);
- Gemma 3: per-head ``(1 + w)`` q/k norms, and a rotary per layer type (local layers
  ``rope_local_base_freq``, 10k; global layers ``rope_theta``, 1M, with their
  ``rope_scaling``, linear factor 8 on the 27B model).

Multimodal checkpoints: the language model's weights (``model.language_model.*``, or
``language_model.model.*`` in older files) load into the text model; a family that does
not run the towers skips them (logged once). ``Gemma3ForConditionalGeneration`` runs its
image encoder: :mod:`engine.models.gemma3_vl`.

The projections have Llama's names (fused as ``qkv_proj``/``gate_up_proj``), so FP8
(``--quantization fp8``), LoRA and tensor parallelism work as for Llama; EAGLE heads read
the decoder's hidden-state hook. GGUF files load through transformers' GGUF config (model
types ``gemma2``, ``gemma3``): its mapping (transformers 5.24) reads neither the
soft-caps nor ``query_pre_attn_scalar`` nor Gemma 3's rope scaling from the file, so the
config classes' defaults apply: right for Gemma 2 2B/9B and Gemma 3 1B, not for Gemma 2
27B (scalar 144) nor Gemma 3 4B-27B (linear rope scaling; 27B's scalar 168). Gemma 4
(``gemma4_text``: plain ``w`` norms, scale 1 with a weightless v norm, K/V shared across
layers, per-layer input embeddings, an MoE block and global layers of another head size)
is :mod:`engine.models.gemma4`, built on this class.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RotarySpec
from engine.layers.logits import softcap
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import rope_config
from engine.models.blocks import AttentionOptions, DecoderModel, SandwichDecoderLayer
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)

SLIDING_TYPE = "sliding_attention"
#: checkpoint prefixes of a multimodal Gemma 3's language model -> ferry's names
_LM_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."))
#: checkpoint prefixes of the parts ferry does not run yet (the image encoder)
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                    "multi_modal_projector.")


def text_config(config):
    """The language model's HF config (a multimodal config's ``text_config``)."""
    return getattr(config, "text_config", None) or config


def gemma_layer_types(text) -> list[str]:
    """``sliding_attention`` / ``full_attention`` per layer: the config's ``layer_types``,
    else from ``sliding_window_pattern`` (every ``pattern``-th layer global; Gemma 2's
    default 2: odd layers global)."""
    types = getattr(text, "layer_types", None)
    if types:
        return list(types)
    pattern = int(getattr(text, "sliding_window_pattern", None)
                  or getattr(text, "_sliding_window_pattern", None) or 2)
    return [SLIDING_TYPE if (i + 1) % pattern else "full_attention"
            for i in range(text.num_hidden_layers)]


def gemma_rope(text, layer_type: str) -> tuple[float, dict]:
    """``(base, rope parameters)`` of a layer type: transformers 5's per-type
    ``rope_parameters``, else the legacy fields (``rope_local_base_freq`` on local layers,
    ``rope_theta`` and ``rope_scaling`` on the others)."""
    params = getattr(text, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        p = dict(params[layer_type])
        p["rope_type"] = p.get("rope_type", p.get("type", "default")) or "default"
        return float(p.get("rope_theta", 10000.0)), p
    local = getattr(text, "rope_local_base_freq", None)
    if layer_type == SLIDING_TYPE and local is not None:
        return float(local), {"rope_type": "default"}
    return rope_config(text)


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 2/3's decoder (module docstring); the families below set their switches.

    Raises:
        ValueError: an activation without a gated form in ferry (from the MLP).
    """

    family = "Gemma"
    attention_kinds = (AttentionKind.FULL, AttentionKind.SLIDING)
    #: per-head (1 + w) q/k norms (Gemma 3)
    qk_norm = False
    #: checkpoint prefixes of the towers ferry does not run (skipped at load, one log line)
    skipped_prefixes: tuple[str, ...] = _VISION_PREFIXES

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        text = text_config(config)
        self.final_logit_softcap = getattr(text, "final_logit_softcapping", None)
        super().__init__(config, dtype)

    def _build_model(self, mc: ModelConfig, dtype: torch.dtype) -> DecoderModel:
        text = text_config(self.config)
        types = gemma_layer_types(text)
        return DecoderModel(mc, self.layer_specs(), dtype, self._options(mc), self._mlp,
                            norm=GemmaRMSNorm, layer=SandwichDecoderLayer,
                            scale_embeddings=True,
                            rope_for=lambda i: gemma_rope(text, types[i]))

    def _options(self, config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm,
                                qk_norm_cls=GemmaRMSNorm)

    def layer_specs(self) -> list[LayerSpec]:
        """Per layer: SLIDING with ``sliding_window`` on the layers HF marks
        ``sliding_attention`` (FULL when the config has no window), the scale
        ``query_pre_attn_scalar ** -0.5``, ``attn_logit_softcapping``, the layer type's
        rotary base."""
        mc, text = self.model_config, text_config(self.config)
        window = getattr(text, "sliding_window", None)
        cap = getattr(text, "attn_logit_softcapping", None)
        scalar = getattr(text, "query_pre_attn_scalar", None) or mc.head_dim
        specs = []
        for layer_type in gemma_layer_types(text):
            sliding = layer_type == SLIDING_TYPE and bool(window)
            base, params = gemma_rope(text, layer_type)
            specs.append(LayerSpec(
                attention=AttentionKind.SLIDING if sliding else AttentionKind.FULL,
                cache=CacheKind.PAGED_KV, head_dim=mc.head_dim, v_head_dim=mc.head_dim,
                num_kv_heads=mc.num_kv_heads, sliding_window=int(window) if sliding else None,
                logit_softcap=float(cap) if cap else None, scale=float(scalar) ** -0.5,
                rotary=RotarySpec(kind=params["rope_type"], base=base)))
        return specs

    def compute_logits(self, hidden: torch.Tensor,
                       logits_indices: torch.Tensor | None) -> torch.Tensor:
        """As :meth:`engine.models.base.CausalLM.compute_logits`, then soft-capped by
        ``final_logit_softcapping`` (when the config sets it): float32 ``[B or T, vocab]``."""
        logits = super().compute_logits(hidden, logits_indices)
        cap = self.final_logit_softcap
        return logits if not cap else softcap(logits, float(cap))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`DecoderForCausalLM.load_weights` after renaming a multimodal checkpoint's
        language-model tensors to the text model's names; vision tensors are skipped (one
        log line with their count)."""
        skipped = [0]

        def text_only():
            for name, tensor in weights:
                if name.startswith(self.skipped_prefixes):
                    skipped[0] += 1
                    continue
                for old, new in _LM_PREFIXES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                yield name, tensor

        loaded = super().load_weights(text_only())
        if skipped[0]:
            logger.info("%s: skipped %d vision/audio-tower tensors (ferry serves the text "
                        "model only; image and audio inputs are not supported yet)",
                        type(self).__name__,
                        skipped[0])
        return loaded


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: alternating local/global layers, attention and final logit soft-capping."""

    family = "Gemma2"


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 (text): 5:1 local/global layers, per-head q/k norms, a rotary per layer
    type."""

    family = "Gemma3"
    qk_norm = True

