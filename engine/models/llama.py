"""Llama and Mistral: the plain decoder of :mod:`engine.models.decoder`.

Llama 2/3 (and SmolLM, and other Llama-shaped checkpoints) and Mistral: fused QKV and
gate-up projections, RMSNorm, RoPE (NeoX layout, ``default``/``linear``/``llama3``
scaling), SwiGLU; q/k/v/o bias = ``config.attention_bias`` (default False). Every layer is
full attention over the paged KV cache.

Mistral's ``sliding_window``: ferry has no sliding-window kernel. The loader caps the
context at the window (``engine/loader/loader.py``, ``_cap_sliding_window``), so full
attention over every admissible sequence is exact, and the layers are described as what
they run: ``FULL`` (:meth:`engine.models.base.CausalLM.layer_specs`), no window.
"""

from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3, SmolLM: q/k/v/o bias = ``attention_bias``, no q/k norm."""

    family = "Llama"


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral = Llama layers; the loader caps the context at ``sliding_window`` (see the
    module docstring), so the layers are full attention."""

    family = "Mistral"
