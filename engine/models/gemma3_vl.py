"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): the SigLIP tower and projector
of :mod:`engine.models.gemma3_vision` before the Gemma 3 language model of
:mod:`engine.models.gemma`.

A prompt's image is ``<start_of_image>``, ``mm_tokens_per_image`` image soft tokens and
``<end_of_image>`` (``server/media/process.py`` expands the chat template's
``<start_of_image>`` as transformers' ``Gemma3Processor`` does). In a step with image
requests (``ForwardBatch.mm_segments``) the soft tokens' scaled embeddings are overwritten
by the image's embeddings, computed once per image, whole, by the first prefill chunk that
holds one of its tokens (an image the prefix cache holds entirely is never encoded). Plain
1D positions (no M-RoPE).

Attention is causal for text and bidirectional among one image's tokens, in the global and
the sliding-window layers (HF: ``AND(window, OR(causal, same image))``): the step's
``ForwardBatch.key_limit`` gives each image token the end of its image as the last key it
sees (``engine.mm_inputs.key_limits``; the extend kernels' ``key_limit``), and the scheduler
never ends a prefill chunk inside an image (``MMInputs.image_cut``): an image's tokens are
computed in one chunk, so the result does not depend on where chunks fall. A prefix-cache
hit may end inside an image: the cached K/V were computed with the whole (same) image in
view, so the rest of it attends exactly.

Tensor parallelism: the language model is split as Gemma 3's; the SigLIP tower and the
projector (~0.4 B parameters, ``ReplicatedLinear`` layers) are replicated on every rank, and
each rank encodes the step's images from the pixels rank 0 sends with the step
(``engine/executor/tp_images.py``). Pan-and-scan
crops are not supported (``server/media/process.py`` turns image input off for a processor
configured with ``do_pan_and_scan``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.forward_batch import ForwardBatch
from engine.layers.norm import GemmaRMSNorm
from engine.models.blocks import DecoderModel, SandwichDecoderLayer
from engine.models.config import ModelConfig
from engine.models.gemma import Gemma3ForCausalLM, gemma_layer_types, gemma_rope, text_config
from engine.models.gemma3_vision import Gemma3Projector, SiglipVisionTower, encode_image

#: checkpoint prefixes of the image encoder (the Hub's, transformers 5's) -> ferry's
_VISION_PREFIXES = (("model.vision_tower.vision_model.", "vision_tower."),
                    ("vision_tower.vision_model.", "vision_tower."),
                    ("model.vision_tower.", "vision_tower."),
                    ("model.multi_modal_projector.", "multi_modal_projector."))
#: SigLIP's pooling head (``vision_use_head``): not part of Gemma 3's image path
_UNUSED = "vision_tower.head."


class ImageDecoderModel(DecoderModel):
    """:class:`DecoderModel` whose embeddings of a step's image tokens are overwritten by
    the image embeddings (``inject(hidden, fb) -> hidden``) before the first layer."""

    #: ``inject(hidden, fb) -> hidden`` (the model's), or None
    inject = None
    #: an image token id beyond the vocabulary (looked up as id 0 before ``inject``), or None
    oov_image_token: int | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final normed hidden states [T, hidden]."""
        if self.oov_image_token is not None:
            input_ids = torch.where(input_ids == self.oov_image_token, 0, input_ids)
        hidden = self.embed(input_ids)
        if fb.mm_segments and self.inject is not None:
            hidden = self.inject(hidden, fb)
        residual = None
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, self.layer_ropes[i], positions, fb)
        if self.aux_layers:
            self.aux_hidden = [aux[i] for i in self.aux_layers]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 with its image encoder (module docstring).

    Raises:
        ValueError: an ``mm_tokens_per_image`` that does not tile the tower's patch grid.
    """

    family = "Gemma3"
    #: the model reads images (``engine.validation.images_for``)
    accepts_images = True
    #: its language model attends bidirectionally within an image (``MMInputs``)
    bidirectional_images = True
    #: speculative decoding is not refused at start-up (``engine/executor/preflight.py``):
    #: Gemma 3's images need no M-RoPE positions
    images_optional = True

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self.image_token_id = int(getattr(config, "image_token_id", None)
                                  or config.image_token_index)
        self.skipped_prefixes = ()
        self.vision_tower = SiglipVisionTower(config.vision_config, dtype)
        self.multi_modal_projector = Gemma3Projector(config, self.model_config.hidden_size,
                                                     dtype)
        self.model.inject = self.inject_images
        if self.image_token_id >= self.model_config.vocab_size:
            self.model.oov_image_token = self.image_token_id

    def _build_model(self, mc: ModelConfig, dtype: torch.dtype) -> DecoderModel:
        text = text_config(self.config)
        types = gemma_layer_types(text)
        return ImageDecoderModel(mc, self.layer_specs(), dtype, self._options(mc), self._mlp,
                                 norm=GemmaRMSNorm, layer=SandwichDecoderLayer,
                                 scale_embeddings=True,
                                 rope_for=lambda i: gemma_rope(text, types[i]))

    def check_images(self, items) -> None:
        """Refuse images the encoder cannot take (``engine.validation.images_for``).

        Raises:
            ValueError: an image whose patch grid is not the tower's ``(1, side, side)`` or
                whose merge is not the projector's pooling kernel.
        """
        proj = self.multi_modal_projector
        for i, it in enumerate(items):
            if tuple(it.grid_thw) != (1, proj.side, proj.side) or it.merge != proj.kernel:
                raise ValueError(f"images[{i}]: Gemma 3 takes images of {proj.side}x"
                                 f"{proj.side} patches pooled by {proj.kernel}, not the grid "
                                 f"{tuple(it.grid_thw)} (merge {it.merge})")

    def inject_images(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Write the image embeddings of the step's image tokens over their rows.

        Args:
            hidden: [T, hidden] the step's (scaled) token embeddings, written in place.
            fb: the step; ``fb.mm_segments`` lists ``(MMInputs, prefix, new tokens, first
                row)`` per image request.
        Returns:
            ``hidden``.
        """
        for mm, p, n, row in fb.mm_segments:
            for i, item in enumerate(mm.items):
                lo, hi = max(p, item.offset), min(p + n, item.end)
                if lo >= hi:
                    continue
                emb = mm.embeds.get(i)
                if emb is None:  # the whole image, once (kept until its last token)
                    emb = mm.embeds[i] = encode_image(self.vision_tower,
                                                      self.multi_modal_projector,
                                                      item.pixel_values)
                hidden[row + lo - p:row + hi - p] = \
                    emb[lo - item.offset:hi - item.offset].to(hidden.dtype)
            mm.drop_done(p + n)
        return hidden

    # ---- weights -------------------------------------------------------------------------

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        """The image encoder's tensors have their parameters' shapes (replicated)."""
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return tuple(self.get_parameter(name).shape)
        return super()._hf_weight_shape(name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`GemmaForCausalLM.load_weights` after mapping the encoder's names (the
        Hub's ``vision_tower.vision_model.*``, transformers 5's ``model.vision_tower.*``,
        ``model.multi_modal_projector.*``) onto ferry's; SigLIP's unused pooling head is
        dropped; the encoder's tensors load whole on every rank."""
        def renamed():
            for name, tensor in weights:
                for old, new in _VISION_PREFIXES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                if not name.startswith(_UNUSED):
                    yield name, tensor

        return super().load_weights(renamed())
