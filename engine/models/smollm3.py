"""SmolLM3 on :mod:`engine.models.decoder` (checked against transformers 5.24's
``modeling_smollm3.py``): Llama's layers, but the layers whose ``no_rope_layers`` entry is
0 have no rotary embedding (NoPE: q and k enter attention unrotated; HF's list holds 1 for
the layers that do use RoPE). With ``use_sliding_window`` and a ``sliding_window``, the
layers ``layer_types`` calls ``sliding_attention`` attend to that window. q/k/v/o bias =
``attention_bias``.
"""

from __future__ import annotations

from engine.layer_spec import AttentionKind, LayerSpec
from engine.models.base import layer_type_specs
from engine.models.decoder import DecoderForCausalLM


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """SmolLM3: Llama layers, NoPE on the layers ``no_rope_layers`` marks 0."""

    family = "SmolLM3"
    attention_kinds = (AttentionKind.FULL, AttentionKind.SLIDING)

    def layer_specs(self) -> list[LayerSpec]:
        text = getattr(self.config, "text_config", None) or self.config
        n = self.model_config.num_layers
        rope = getattr(text, "no_rope_layers", None)
        rotary = [True] * n if rope is None else [bool(r) for r in rope]
        window = getattr(text, "sliding_window", None)
        types = getattr(text, "layer_types", None)
        if not (getattr(text, "use_sliding_window", False) and window):
            types, window = None, None
        return layer_type_specs(self.model_config, types, window, rotary=rotary)
