"""Model registry: HF ``config.architectures[0]`` (or ``model_type``) -> ferry model class.

Every registered class implements the model contract :class:`engine.models.base.CausalLM`
and reads its shape from :class:`engine.models.config.ModelConfig`; most are small family
modules on the shared decoder (``blocks.py``, ``decoder.py``, ``moe.py``). Adding an
architecture is one file (a ``CausalLM`` subclass in this folder) plus one line in
``MODEL_REGISTRY`` (and one in ``MODEL_TYPES``, in ``config.py``, if GGUF files of it carry
no ``architectures``); ``docs/models.md`` is generated from the registry
(:mod:`engine.models.docs`).
"""

from __future__ import annotations

from engine.models.base import CausalLM
from engine.models.config import MODEL_TYPES, ModelConfig
from engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.models.exaone4 import Exaone4ForCausalLM
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gemma3_vl import Gemma3ForConditionalGeneration
from engine.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from engine.models.glm4 import Glm4ForCausalLM
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.granite import GraniteForCausalLM
from engine.models.llama import LlamaForCausalLM, MinistralForCausalLM, MistralForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
from engine.models.olmoe import OlmoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3_5_vl import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)
from engine.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from engine.models.qwen3_vl import Qwen3VLForConditionalGeneration
from engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "MinistralForCausalLM": MinistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(config) -> type[CausalLM]:
    """The ferry class for an HF config.

    Uses ``config.architectures[0]``; when that is missing (configs read from GGUF files),
    ``config.model_type``.

    Raises:
        ValueError: an unsupported architecture (the message lists the supported ones).
    """
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else MODEL_TYPES.get(getattr(config, "model_type", None) or "")
    if arch in MODEL_REGISTRY:
        return MODEL_REGISTRY[arch]
    shown = arch or f"model_type={getattr(config, 'model_type', None)!r}"
    raise ValueError(f"unsupported model architecture {shown}; ferry supports "
                     f"{', '.join(supported_architectures())}")


__all__ = [
    "MODEL_REGISTRY",
    "MODEL_TYPES",
    "CausalLM",
    "ModelConfig",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "SmolLM3ForCausalLM",
    "GraniteForCausalLM",
    "Exaone4ForCausalLM",
    "MinistralForCausalLM",
    "Phi3ForCausalLM",
    "Glm4ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "get_model_class",
    "supported_architectures",
]
