"""The mixture-of-experts decoder: ``MoeForCausalLM``, the base of the MoE families
(:mod:`engine.models.qwen_moe`: Qwen3-MoE and Qwen2-MoE, :mod:`engine.models.mixtral`,
:mod:`engine.models.olmoe`).

Attention, norms, rotary and the dense MLP are :mod:`engine.models.blocks`'; a layer's MLP
is either the dense :class:`engine.models.blocks.GatedMLP` or
:class:`engine.layers.moe.SparseMoeBlock` (router, stacked experts, optional shared expert),
chosen per layer by :meth:`engine.models.config.ModelConfig.is_moe_layer`
(``decoder_sparse_step``, ``mlp_only_layers``). A family sets the switches below
(``hf_moe_block``, ``expert_parts``, ``has_shared_expert``, ``_renormalize``) and its
attention options (``_options``).

Checkpoints hold one tensor per expert (``...mlp.experts.{e}.gate_proj.weight``); ferry
stacks them into ``...mlp.experts.w13_weight`` / ``w2_weight`` at load time.
``expected_weights`` names each expert tensor (``model.layers.{l}.mlp.experts.{e}.{part}
.weight``, Mixtral's under ``mlp.`` too), so a checkpoint missing one is reported by name,
and ``hf_weight_shapes`` covers them for ``--load-format dummy``.

Block-wise FP8 checkpoints (``weight_block_size``; Qwen3-MoE-FP8, DeepSeek-V3) keep their
experts in e4m3 with their block scales (:mod:`engine.layers.moe_fp8`; the per-expert
``weight_scale_inv`` tensors are stacked like the weights) and their attention and dense
layers as block-FP8 linear layers; the routers stay in the run dtype. Not supported (refused
at start-up with the reason): per-channel FP8, AWQ and GPTQ (``--quantization fp8|awq|gptq``
on a float checkpoint or such a checkpoint: those quantized experts are future work), block
FP8 for a family that sets ``fp8_block_experts`` False, and GGUF files of MoE models (the
loader's check).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.layers.moe import EXPERT_SHARDS, ExpertOptions, SparseMoeBlock
from engine.layers.quantization import current_linear_method
from engine.models.blocks import GatedMLP
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.weights import load_tensor

_EXPERT_NAME = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight(_scale_inv)?")
_STACKED = (".experts.w13_weight", ".experts.w2_weight", ".experts.w13_weight_scale_inv",
            ".experts.w2_weight_scale_inv")


class MoeForCausalLM(DecoderForCausalLM):
    """Base of the MoE families (see the module docstring); subclasses set the switches."""

    #: HF name of the layer's MoE block ("mlp"; Mixtral: "block_sparse_moe")
    hf_moe_block = "mlp"
    #: HF expert parts, in (gate, up, down) order
    expert_parts = ("gate_proj", "up_proj", "down_proj")
    #: a Qwen2-MoE shared expert with its sigmoid gate
    has_shared_expert = False
    #: whether block-wise FP8 checkpoints load (their experts in e4m3, engine.layers.moe_fp8)
    fp8_block_experts = True

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        mc = ModelConfig.from_hf(config)
        arch = mc.architecture or type(self).__name__
        method = current_linear_method()
        self._fp8_block = getattr(getattr(method, "config", None), "weight_block_size", None)
        if method is not None and not (self._fp8_block and self.fp8_block_experts):
            src = method.config.source
            what = (src if src.startswith(("--", "quant_method"))
                    else f"an FP8 checkpoint (quant_method {src!r})")
            kind = "block-wise FP8" if self._fp8_block else "FP8 and 4-bit"
            raise ValueError(f"{what} is not supported for {arch}, a mixture-of-experts model "
                             f"({kind} expert weights are future work here); serve it "
                             "unquantized (bfloat16/float16/float32)")
        if mc.num_experts <= 0 or mc.num_experts_per_tok <= 0:
            raise ValueError(f"{arch}: the config gives no experts (num_experts / "
                             "num_experts_per_tok)")
        if mc.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {mc.hidden_act!r}; ferry supports silu")
        super().__init__(config, dtype)

    # ---- switches ------------------------------------------------------------------------

    def _renormalize(self, config: ModelConfig) -> bool:
        return config.norm_topk_prob

    def _mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        if not config.is_moe_layer(layer_id):
            return GatedMLP(config, dtype)
        shared = None
        if self.has_shared_expert and config.shared_expert_intermediate_size:
            shared = GatedMLP(config, dtype, config.shared_expert_intermediate_size,
                              reduce_results=False)
        return SparseMoeBlock(config.hidden_size, config.num_experts,
                              config.num_experts_per_tok, config.moe_intermediate_size,
                              self._renormalize(config), dtype, shared_expert=shared,
                              shared_expert_gate=shared is not None,
                              options=self._expert_options())

    def _expert_options(self) -> ExpertOptions | None:
        """The experts' block-FP8 options under a block-FP8 scheme (while the model is
        built, inside the loader's quantization scope), else None."""
        if not self._fp8_block:
            return None
        return ExpertOptions(fp8_block=self._fp8_block,
                             fp8_checkpoint=current_linear_method().config.checkpoint_fp8)

    # ---- names ---------------------------------------------------------------------------

    def _to_ferry(self, name: str) -> str:
        """HF checkpoint name -> the name ferry's modules use (the block is always ``mlp``)."""
        if self.hf_moe_block != "mlp":
            return name.replace(f".{self.hf_moe_block}.", ".mlp.")
        return name

    def _to_hf(self, name: str) -> str:
        if self.hf_moe_block != "mlp" and ".mlp." in name:
            layer = int(name.split(".")[2])
            if self.model_config.is_moe_layer(layer):
                return name.replace(".mlp.", f".{self.hf_moe_block}.")
        return name

    # ---- weights -------------------------------------------------------------------------

    def expected_weights(self) -> set[str]:
        """The dense keys (:meth:`DecoderForCausalLM.expected_weights`) with each stacked
        expert parameter replaced by its per-expert checkpoint names."""
        keys = {k for k in super().expected_weights() if not k.endswith(_STACKED)}
        mc = self.model_config
        # a block-FP8 checkpoint's per-expert scales (not when they are derived at load)
        leaves = ("weight", "weight_scale_inv") if any(
            n.endswith(_STACKED[2]) and not getattr(p, "derived", False)
            for n, p in self.named_parameters()) else ("weight",)
        for layer in range(mc.num_layers):
            if mc.is_moe_layer(layer):
                keys.update(f"model.layers.{layer}.mlp.experts.{e}.{part}.{leaf}"
                            for e in range(mc.num_experts) for part in self.expert_parts
                            for leaf in leaves)
        return keys

    def hf_weight_names(self) -> list[str]:
        return [self._to_hf(n) for n in super().hf_weight_names()]

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        mc = self.model_config
        h = mc.hidden_size
        ferry = self._to_ferry(name)
        m = _EXPERT_NAME.fullmatch(ferry)
        if m:
            i = mc.moe_intermediate_size
            return (h, i) if EXPERT_SHARDS[m.group(3)] == "down" else (i, h)
        if ".mlp.shared_expert." in ferry:
            return super()._hf_weight_shape(name, mc.shared_expert_intermediate_size)
        if ferry.endswith(".mlp.shared_expert_gate.weight"):
            return (1, h)
        if ferry.endswith(".mlp.gate.weight"):
            return (mc.num_experts, h)
        return super()._hf_weight_shape(name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors go into the stacked expert parameters (before the dense
        q/k/v and gate/up fusion rules, which would take ``experts.{e}.gate_proj``); the
        rest through :meth:`DecoderForCausalLM.load_weights`."""
        params = dict(self.named_parameters())
        experts: set[str] = set()

        def dense():
            for hf_name, tensor in weights:
                name = self._to_ferry(hf_name)
                m = _EXPERT_NAME.fullmatch(name)
                if m and m.group(3) in self.expert_parts:
                    layer, expert, part, scale = m.groups()
                    shard = EXPERT_SHARDS[part]
                    stacked = ("w2_weight" if shard == "down" else "w13_weight") + (scale or "")
                    p = params.get(f"model.layers.{layer}.mlp.experts.{stacked}")
                    if p is not None:
                        load_tensor(hf_name, p.weight_loader, p, tensor, int(expert), shard)
                        experts.add(name)
                        continue
                yield name, tensor

        return super().load_weights(dense()) | experts

