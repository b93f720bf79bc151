"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): the vision tower of
:mod:`engine.models.qwen_vision` before a Qwen2 language model with multimodal RoPE.

A step with image requests (``ForwardBatch.mm_segments``, ``engine/mm_inputs.py``): the
prompt's image tokens are embedded as usual, then each image's rows are overwritten by its
vision embeddings. An image's embeddings are computed once, by the first prefill chunk that
holds one of its tokens, for the whole image, and kept on the request (``MMInputs.embeds``)
until the chunk that prefills its last token, so chunked prefill may cut an image anywhere;
an image the prefix cache holds entirely is never encoded. The language model's rotary is
:class:`engine.layers.rotary.MRotaryEmbedding`: ``ForwardBatch.mrope_positions`` [3, T] when
the step has image requests (``mrope_section`` splits the frequencies among the temporal,
height and width positions), the plain positions otherwise (text: the three are equal, and
a generated token's are ``p + delta``, the request's ``MMInputs.delta``).

Steps with image requests run eagerly (``engine/executor/graph_replay.py``); text-only steps
use the graphs as any Qwen2. Checkpoint names: ``model.*`` / ``visual.*`` (the Hub's) or
transformers 5's ``model.language_model.*`` / ``model.visual.*``.

Tensor parallelism: the language model is split as any Qwen2; the vision tower (~0.7 B
parameters for the 7B, ``ReplicatedLinear`` layers) is replicated on every rank, and each
rank encodes the step's images itself from the pixels rank 0 sends with the step
(``engine/executor/tp_images.py``), so the tower needs no collective. Not supported yet:
video input.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.forward_batch import ForwardBatch
from engine.layers.rotary import MRotaryEmbedding
from engine.models.blocks import DecoderModel
from engine.models.config import ModelConfig
from engine.models.qwen import Qwen2ForCausalLM
from engine.models.qwen_vision import Qwen25VisionTower

#: checkpoint prefixes -> ferry's (transformers 5 writes the first two in memory)
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class MRopeDecoderModel(DecoderModel):
    """:class:`DecoderModel` with one :class:`MRotaryEmbedding` for every layer and the
    image embeddings written over the image tokens' before the first layer."""

    def __init__(self, config: ModelConfig, *args, mrope_interleaved: bool = False, **kwargs):
        super().__init__(config, *args, **kwargs)
        params = dict(config.rope_parameters, mrope_interleaved=mrope_interleaved)
        rope = MRotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                config.rope_theta, params)
        self.rotary_emb = rope
        self.layer_ropes = (rope,) * len(self.layers)
        #: ``inject(hidden, fb) -> hidden``: the image embeddings of the step (the model's)
        self.inject = None
        #: ``after_layer(i, hidden) -> hidden`` after decoder layer ``i`` of a step with
        #: images (Qwen3-VL's DeepStack features), or None
        self.after_layer = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions [T] int64 (``fb.mrope_positions`` [3, T] replaces the
        positions when set) -> final normed hidden states [T, hidden]."""
        hidden = self.embed(input_ids)
        if fb.mm_segments and self.inject is not None:
            hidden = self.inject(hidden, fb)
        if fb.mrope_positions is not None:
            positions = fb.mrope_positions
        residual = None
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, self.layer_ropes[i], positions, fb)
            if fb.mm_segments and self.after_layer is not None:
                hidden = self.after_layer(i, hidden)
        if self.aux_layers:
            self.aux_hidden = [aux[i] for i in self.aux_layers]
        hidden, _ = self.norm(hidden, residual)
        return hidden


def inject_image_embeds(visual, hidden: torch.Tensor, fb: ForwardBatch
                        ) -> list[tuple[int, int, torch.Tensor]]:
    """Write the vision embeddings of the step's image tokens over their rows.

    Args:
        visual: the vision tower (``visual(pixels, grid_thw)`` -> ``[tokens, width *
            (1 + levels)]``).
        hidden: [T, hidden] the step's token embeddings (written in place).
        fb: the step; ``fb.mm_segments`` lists ``(MMInputs, prefix, new tokens, first
            row)`` per image request.
    Returns:
        the step's DeepStack rows, ``(first row, end row, [rows, levels * hidden])`` per
        image part (empty for a tower without levels).
    """
    width = hidden.shape[-1]
    deep = []
    for mm, p, n, row in fb.mm_segments:
        for i, item in enumerate(mm.items):
            lo, hi = max(p, item.offset), min(p + n, item.end)
            if lo >= hi:
                continue
            emb = mm.embeds.get(i)
            if emb is None:  # the whole image, once (kept until its last token)
                emb = mm.embeds[i] = visual(item.pixel_values, item.grid_thw)
            part = emb[lo - item.offset: hi - item.offset].to(hidden.dtype)
            r0, r1 = row + lo - p, row + hi - p
            hidden[r0:r1] = part[:, :width]
            if part.shape[-1] > width:
                deep.append((r0, r1, part[:, width:]))
        mm.drop_done(p + n)
    return deep


def rename_vl_weights(weights: Iterable[tuple[str, torch.Tensor]]):
    """transformers 5's names (``model.language_model.*``, ``model.visual.*``) mapped onto
    the Hub's (``model.*``, ``visual.*``); other names as they are."""
    for name, tensor in weights:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2.5-VL: vision tower + Qwen2 language model with M-RoPE (module docstring).

    Raises:
        ValueError: an ``mrope_section`` that does not fit the head dimension.
    """

    family = "Qwen2.5-VL"
    #: the model reads images (``engine.validation.images_for``)
    accepts_images = True
    #: the vision tower class (``tower(vision_config, dtype)``; its output per image token:
    #: the embedding, then any DeepStack levels, each ``hidden_size`` wide)
    vision_tower: type[torch.nn.Module] = Qwen25VisionTower
    #: M-RoPE's frequency layout: sections in a row (Qwen2.5-VL) or interleaved (Qwen3-VL)
    mrope_interleaved = False

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self.image_token_id = int(config.image_token_id)
        self.visual = self.vision_tower(config.vision_config, dtype)
        self.model.inject = self.inject_images
        self.model.after_layer = self.add_deepstack
        #: the step's DeepStack rows: ``(first row, end row, [rows, levels * hidden])``
        self._deep: list[tuple[int, int, torch.Tensor]] = []

    def _build_model(self, mc: ModelConfig, dtype: torch.dtype) -> DecoderModel:
        return MRopeDecoderModel(mc, self.layer_specs(), dtype, self._options(mc), self._mlp,
                                 decoder=self._decoder(mc), layer=self.decoder_layer,
                                 mrope_interleaved=self.mrope_interleaved)

    def inject_images(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """:func:`inject_image_embeds` with this model's tower; keeps the step's DeepStack
        rows for :meth:`add_deepstack`. hidden [T, hidden] (written in place) -> hidden."""
        self._deep = inject_image_embeds(self.visual, hidden, fb)
        return hidden

    def add_deepstack(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """After decoder layer ``i``: the image rows of the step get DeepStack level ``i``
        added (Qwen3-VL; nothing for a tower without levels). hidden [T, hidden]."""
        width = hidden.shape[-1]
        for r0, r1, deep in self._deep:
            if (i + 1) * width <= deep.shape[-1]:
                hidden[r0:r1] += deep[:, i * width:(i + 1) * width]
        return hidden

    # ---- weights -------------------------------------------------------------------------

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        """The vision tower's tensors have their parameters' shapes (replicated on every
        rank)."""
        if name.startswith("visual."):
            return tuple(self.get_parameter(name).shape)
        return super()._hf_weight_shape(name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`DecoderForCausalLM.load_weights` after mapping transformers 5's names
        (``model.language_model.*``, ``model.visual.*``) onto the Hub's."""
        return super().load_weights(rename_vl_weights(weights))
