"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``): the hybrid language models of
:mod:`engine.models.qwen3_next` (Gated DeltaNet + gated full attention) behind Qwen3-VL's
vision tower (:class:`engine.models.qwen3_vision.Qwen3VisionTower`; Qwen3.5's has no
DeepStack levels: patch embedding with a bias, a learned position table resampled to each
image, LayerNorm ViT blocks with the same axial 2D rotary, the patch merger).

Checked against transformers 5's ``modeling_qwen3_5.py``. In a step with image requests
(``ForwardBatch.mm_segments``) the image tokens' embeddings are overwritten by the tower's
(:func:`engine.models.qwen2_5_vl.inject_image_embeds`: each image encoded once, whole, by
the first prefill chunk that holds one of its tokens) before the first layer, and the
full-attention layers rotate by the M-RoPE positions (``ForwardBatch.mrope_positions``;
Qwen3.5's text rotary is always interleaved over its partial rotary dims, ``mrope_section``
defaulting to ``[11, 11, 10]``); the Gated DeltaNet layers take no positions. The prefix
cache keys an image's tokens by its content hash (``engine/mm_inputs.py``) as for the other
VL models; the state snapshots of the hybrid layers sit at token boundaries of that key.

Tensor parallelism: the hybrid language model is split as Qwen3.5's; the vision tower
(``ReplicatedLinear`` layers) is replicated on every rank, and each rank encodes the step's
images from the pixels rank 0 sends with the step (``engine/executor/tp_images.py``). Not
supported yet: video input; image requests with ``--speculative-algorithm MTP`` (the draft
layer gets plain positions).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.forward_batch import ForwardBatch
from engine.models.qwen2_5_vl import inject_image_embeds, rename_vl_weights
from engine.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from engine.models.qwen3_vision import Qwen3VisionTower


def attach_vision(model, config, dtype: torch.dtype) -> None:
    """Give ``model`` its vision tower (``model.visual``, whole on every tensor-parallel
    rank) and the image hook of its :class:`engine.models.qwen3_next.HybridModel`."""
    model.image_token_id = int(config.image_token_id)
    model.visual = Qwen3VisionTower(config.vision_config, dtype)

    def inject(hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        inject_image_embeds(model.visual, hidden, fb)   # no DeepStack levels
        return hidden

    model.model.inject = inject


def vision_weights(model, weights: Iterable[tuple[str, torch.Tensor]]):
    """A multimodal checkpoint's tensors under the model's names (``model.language_model.``
    -> ``model.``, ``model.visual.`` -> ``visual.``)."""
    yield from rename_vl_weights(weights)


def vision_weight_shape(model, name: str) -> tuple[int, ...] | None:
    """The tower's tensors have their parameters' shapes (replicated); None for others."""
    return tuple(model.get_parameter(name).shape) if name.startswith("visual.") else None


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Qwen3.5 (dense) with its vision tower (module docstring)."""

    #: the model reads images (``engine.validation.images_for``)
    accepts_images = True
    #: MTP is not refused at start-up: text is served as before (image requests are then
    #: refused: ``RankRunner``'s ``images_off_reason``)
    images_optional = True
    #: the full-attention layers' rotary is M-RoPE (``HybridModel``)
    mrope = True

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        attach_vision(self, config, dtype)

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        return vision_weight_shape(self, name) or super()._hf_weight_shape(name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(vision_weights(self, weights))


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE with its vision tower (module docstring)."""

    accepts_images = True
    images_optional = True
    mrope = True

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        attach_vision(self, config, dtype)

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        return vision_weight_shape(self, name) or super()._hf_weight_shape(name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(vision_weights(self, weights))


__all__ = ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
           "attach_vision"]
