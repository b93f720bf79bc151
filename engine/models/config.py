"""``ModelConfig``: the decoder's dimensions, read once from the HF config.

It lives beside the models (not in ``loader/``) because it is what the models and the model
runner read; the loader only produces the HF ``PretrainedConfig`` it is built from. Every
default that used to be re-derived at each use (``head_dim = hidden_size // heads``, KV
heads = query heads, the LM-part of a multimodal config) is decided here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: context (tokens) assumed when a config gives no ``max_position_embeddings``
DEFAULT_MAX_POSITION = 4096
# GGUF-derived configs carry no ``architectures``; fall back on ``model_type`` (here, not in
# the registry ``engine.models``, which imports this module)
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "ministral": "MinistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    """The language model's shape (all counts are for the whole model, before any TP split).

    Attributes:
        architecture: ``architectures[0]`` of the HF config, else the registry's name for its
            ``model_type`` (GGUF-derived configs), else "".
        model_type: the language model's ``model_type`` (``llama``, ``qwen3``...).
        num_layers: decoder layers.
        hidden_size: residual width.
        num_heads: query heads.
        num_kv_heads: K/V heads (``num_key_value_heads``, else ``num_heads``).
        head_dim: per-head size (``head_dim``, else ``hidden_size // num_heads``).
        intermediate_size: MLP width.
        vocab_size: token ids are in ``[0, vocab_size)``.
        max_position_embeddings: the model's context in tokens (4096 when unset).
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: the LM head is the embedding table.
        rope_theta: RoPE base.
        rope_parameters: ``rope_type`` and its fields (``engine.layers.rotary.rope_config``).
        hidden_act: MLP activation name (Gemma's ``hidden_activation``, else
            ``hidden_act``).
        attention_bias, mlp_bias: projection biases (``attention_bias``, ``mlp_bias``).
        num_experts: routed experts per MoE layer (``num_experts``, Mixtral's
            ``num_local_experts``); 0 for a dense model.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: width of one expert (``moe_intermediate_size``, else
            ``intermediate_size``: Mixtral's experts); ``intermediate_size`` stays the width
            of the dense MLP layers.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1 (``norm_topk_prob``;
            a model class may force it, as Mixtral does).
        shared_expert_intermediate_size: width of the always-on shared expert (Qwen2-MoE),
            0 for none.
        decoder_sparse_step, mlp_only_layers: layer ``i`` is an MoE layer when
            ``num_experts > 0``, ``i not in mlp_only_layers`` and
            ``(i + 1) % decoder_sparse_step == 0`` (:meth:`is_moe_layer`), as in transformers.
        sliding_window: the config's ``sliding_window`` (tokens a windowed layer's query sees,
            itself included), None when unset; which layers are windowed is the family's
            call (:meth:`engine.models.base.CausalLM.layer_specs`).
        layer_types: the config's ``layer_types`` (``sliding_attention``/``full_attention``
            per layer), empty when unset.
    """

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float
    rope_parameters: dict[str, Any] = field(default_factory=dict, hash=False)
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` has a mixture-of-experts MLP."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        """num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def context_length(self) -> int:
        """The model's context in tokens (``max_position_embeddings``)."""
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, config) -> ModelConfig:
        """Read an HF ``PretrainedConfig`` (a ``ModelConfig`` is returned as is).

        A multimodal config's language part is its ``text_config``; the architecture and
        ``tie_word_embeddings`` come from the outer config (as in transformers), the rest
        from the language part.

        Raises:
            AttributeError: a required field (``hidden_size``, ``num_attention_heads``,
                ``num_hidden_layers``, ``intermediate_size`` (or ``moe_intermediate_size``),
                ``vocab_size``) is missing.
        """
        from engine.layers.rotary import rope_config

        if isinstance(config, ModelConfig):
            return config
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        eps = getattr(text, "rms_norm_eps", None)
        tie = getattr(config, "tie_word_embeddings", None)
        if tie is None:
            tie = getattr(text, "tie_word_embeddings", None)
        theta, rope_params = rope_config(text)
        return cls(
            architecture=_architecture(config),
            model_type=getattr(text, "model_type", None) or "",
            num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            num_heads=heads,
            num_kv_heads=_global_field(text, "num_key_value_heads") or heads,
            head_dim=_global_field(text, "head_dim") or text.hidden_size // heads,
            # an MoE-only config (Qwen3.5-MoE) names only its experts' width
            intermediate_size=(text.intermediate_size if hasattr(text, "intermediate_size")
                               else text.moe_intermediate_size),
            vocab_size=text.vocab_size,
            max_position_embeddings=(getattr(text, "max_position_embeddings", None)
                                     or DEFAULT_MAX_POSITION),
            rms_norm_eps=1e-6 if eps is None else float(eps),
            tie_word_embeddings=bool(tie),
            rope_theta=theta,
            rope_parameters=rope_params,
            hidden_act=(getattr(text, "hidden_activation", None)
                        or getattr(text, "hidden_act", None) or "silu"),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            sliding_window=getattr(text, "sliding_window", None) or None,
            layer_types=tuple(getattr(text, "layer_types", None) or ()),
            **_moe_fields(text),
        )


def _global_field(text, name: str):
    """``text.<name>`` or None. transformers 5's heterogeneous configs (Gemma 4: head size and
    K/V heads per layer, ``per_layer_config``) refuse a plain read of a per-layer field; the
    global value (the sliding layers', which a family with other layers reads per layer) is
    read without that check."""
    read = getattr(text, "_getattr_without_heterogeneous_validation", None)
    if read is not None:
        return read(name, None)
    return getattr(text, name, None)


def _moe_fields(text) -> dict:
    """The MoE fields of an HF config, under each family's own names (none: dense)."""
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if not experts:
        return {}
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(getattr(text, "num_experts_per_tok", None)
                                   or text.top_k_experts),          # Gemma 4's name
        "moe_intermediate_size": int(getattr(text, "moe_intermediate_size", None)
                                     or text.intermediate_size),
        "norm_topk_prob": bool(getattr(text, "norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(
            getattr(text, "shared_expert_intermediate_size", None) or 0)
        or int(getattr(text, "n_shared_experts", None) or 0)   # DeepSeek: n experts' width
        * int(getattr(text, "moe_intermediate_size", None) or 0),
        "decoder_sparse_step": int(getattr(text, "decoder_sparse_step", None) or 1),
        "mlp_only_layers": tuple(int(i) for i in getattr(text, "mlp_only_layers", None) or ())
        # DeepSeek: the first ``first_k_dense_replace`` layers are dense
        + tuple(range(int(getattr(text, "first_k_dense_replace", None) or 0))),
    }


def _architecture(config) -> str:
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    return MODEL_TYPES.get(getattr(config, "model_type", None) or "", "")
