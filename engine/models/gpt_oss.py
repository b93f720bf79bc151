"""gpt-oss (``GptOssForCausalLM``) on :class:`engine.models.moe.MoeForCausalLM`, checked
against transformers 5.24's ``modeling_gpt_oss.py`` and ``integrations/mxfp4.py``.

- Attention: q/k/v/o bias (``attention_bias``), a learned sink logit per query head
  (``self_attn.sinks``, held by :class:`engine.layers.attention.Attention` and passed to the
  kernels), sliding-window attention (``sliding_window``, 128) on the layers that
  ``layer_types`` marks ``sliding_attention`` (every other one), full attention elsewhere;
  YaRN rotary (:mod:`engine.layers.rope_scaling`, NeoX layout).
- MoE on every layer: the router ``mlp.router`` (with a bias) -> top-k over the logits and a
  softmax over the chosen k (the same as ferry's softmax, top-k, renormalise); experts with
  biases and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``;
  :func:`kernels.moe.reference.swiglu_oai`).
- Expert tensors are stacked in the checkpoint: ``mlp.experts.gate_up_proj [E, H, 2I]``
  (columns alternate gate, up) and ``down_proj [E, I, H]`` with ``*_bias`` (a bf16
  checkpoint, or one already dequantized), or ``*_blocks``/``*_scales`` (MXFP4,
  ``quantization_config.quant_method: mxfp4``), kept in 4 bits
  (:class:`engine.layers.moe.ExpertOptions` ``mxfp4``): the Triton path dequantizes in
  registers (:mod:`kernels.moe.fused_moe_mxfp4`), the CPU path dequantizes the experts a
  call uses, per call (:func:`kernels.moe.reference.fused_moe_torch`). With
  ``quantization_config.dequantize: true`` the experts are float and MXFP4 tensors are
  dequantized once, at load. The gate/up columns are de-interleaved into ferry's ``w13``
  (gate rows, then up rows) as they load.

Tensor parallelism splits heads (the sinks with them) and each expert's intermediate
dimension (MXFP4: ``I / tp_size`` a multiple of 32); the down bias is added on rank 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RotarySpec
from engine.layers.linear import full_tensor
from engine.layers.moe import ExpertOptions, FusedMoE, SparseMoeBlock
from engine.models.blocks import AttentionOptions
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.moe import MoeForCausalLM
from kernels.moe.mxfp4 import dequantize_mxfp4, dummy_mxfp4

#: HF name piece -> ferry's (names in the checkpoint: ``mlp.router``, ``self_attn.sinks``,
#: ``mlp.experts.gate_up_proj[_blocks|_scales|_bias]``, ``down_proj...``)
_RENAMES = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"))
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)"
                     r"(_blocks|_scales|_bias)?")
_FERRY_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(w13|w2)_(weight|scales|bias)")


def is_mxfp4(config) -> bool:
    """Whether the HF config's ``quantization_config`` says MXFP4 (and not dequantize)."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return bool(qc) and qc.get("quant_method") == "mxfp4" and not qc.get("dequantize")


class GptOssForCausalLM(MoeForCausalLM):
    """gpt-oss: sinks, alternating sliding/full attention, YaRN, biased MoE with the clamped
    SwiGLU, MXFP4 or float experts (see the module docstring)."""

    family = "gpt-oss"
    attention_kinds = (AttentionKind.FULL, AttentionKind.SLIDING)

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        self.mxfp4 = is_mxfp4(config)
        super().__init__(config, dtype)

    # ---- switches ------------------------------------------------------------------------

    def layer_specs(self) -> list[LayerSpec]:
        mc = self.model_config
        text = getattr(self.config, "text_config", None) or self.config
        types = list(getattr(text, "layer_types", None) or
                     ["sliding_attention" if (i + 1) % 2 else "full_attention"
                      for i in range(mc.num_layers)])
        window = getattr(text, "sliding_window", None)
        rotary = RotarySpec(kind=mc.rope_parameters.get("rope_type", "default"),
                            base=mc.rope_theta)
        specs = []
        for i in range(mc.num_layers):
            sliding = types[i] == "sliding_attention" and window
            specs.append(LayerSpec(
                attention=AttentionKind.SLIDING if sliding else AttentionKind.FULL,
                cache=CacheKind.PAGED_KV, head_dim=mc.head_dim, v_head_dim=mc.head_dim,
                num_kv_heads=mc.num_kv_heads, sliding_window=int(window) if sliding else None,
                sinks=True, rotary=rotary))
        return specs

    def _options(self, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def _renormalize(self, config: ModelConfig) -> bool:
        return True  # softmax over the top-k logits = softmax, top-k, renormalise

    def _mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        text = getattr(self.config, "text_config", None) or self.config
        options = ExpertOptions(bias=True, activation="swiglu_oai",
                                swiglu_alpha=float(getattr(text, "swiglu_alpha", 1.702)),
                                swiglu_limit=float(getattr(text, "swiglu_limit", 7.0)),
                                mxfp4=self.mxfp4)
        return SparseMoeBlock(config.hidden_size, config.num_experts,
                              config.num_experts_per_tok, config.moe_intermediate_size,
                              True, dtype, router_bias=True, options=options)

    def memory_note(self) -> str:
        """The experts' share of the weights for the load log line, e.g. ``experts 10.2 GB,
        MXFP4 (4.25 bits a weight)``."""
        moes = [m for m in self.modules() if isinstance(m, FusedMoE)]
        nbytes = sum(m.expert_bytes() for m in moes)
        fmt = "MXFP4 (4.25 bits a weight)" if self.mxfp4 else str(self.dtype).removeprefix(
            "torch.")
        return f"experts {nbytes / 1e9:.3f} GB, {fmt}"

    # ---- names ---------------------------------------------------------------------------

    def _to_ferry(self, name: str) -> str:
        for hf, ferry in _RENAMES:
            name = name.replace(hf, ferry)
        m = _EXPERT.fullmatch(name)
        if m:
            prefix, part, suffix = m.groups()
            kind = {None: "weight", "_blocks": "weight", "_scales": "scales",
                    "_bias": "bias"}[suffix]
            return f"{prefix}{'w13' if part == 'gate_up_proj' else 'w2'}_{kind}"
        return name

    def _to_hf(self, name: str) -> str:
        for hf, ferry in _RENAMES:
            name = name.replace(ferry, hf)
        m = _FERRY_EXPERT.fullmatch(name)
        if m:
            prefix, w, kind = m.groups()
            suffix = {"weight": "_blocks" if self.mxfp4 else "", "scales": "_scales",
                      "bias": "_bias"}[kind]
            return f"{prefix}{'gate_up_proj' if w == 'w13' else 'down_proj'}{suffix}"
        return name

    # ---- weights -------------------------------------------------------------------------

    def expected_weights(self) -> set[str]:
        """Every parameter by its ferry name (the stacked experts included: the checkpoint
        stacks them too)."""
        return DecoderForCausalLM.expected_weights(self)

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        mc = self.model_config
        h, i, e = mc.hidden_size, mc.moe_intermediate_size, mc.num_experts
        shapes = {"gate_up_proj": (e, h, 2 * i), "gate_up_proj_bias": (e, 2 * i),
                  "gate_up_proj_blocks": (e, 2 * i, h // 32, 16),
                  "gate_up_proj_scales": (e, 2 * i, h // 32),
                  "down_proj": (e, i, h), "down_proj_bias": (e, h),
                  "down_proj_blocks": (e, h, i // 32, 16), "down_proj_scales": (e, h, i // 32)}
        if ".mlp.experts." in name:
            return shapes[name.rsplit(".", 1)[1]]
        if name.endswith(".self_attn.sinks"):
            return (mc.num_heads,)
        if ".mlp.router." in name:
            return (e, h) if name.endswith(".weight") else (e,)
        return DecoderForCausalLM._hf_weight_shape(self, name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The stacked expert tensors into each layer's :class:`FusedMoE`
        (:func:`load_gptoss_expert`; float noise for ``*_blocks``/``*_scales``, which
        ``--load-format dummy`` gives, becomes dummy MXFP4 bytes); the router and the sinks
        renamed; the rest through :meth:`DecoderForCausalLM.load_weights`."""
        modules = dict(self.named_modules())
        experts: set[str] = set()
        pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 halves for float experts

        def dense():
            for hf_name, tensor in weights:
                name = self._to_ferry(hf_name)
                m = _FERRY_EXPERT.fullmatch(name)
                if m is None:
                    yield name, tensor
                    continue
                moe = modules[m.group(1).rstrip(".")]
                if not moe.options.mxfp4 and hf_name.endswith(("_blocks", "_scales")):
                    # float experts from an MXFP4 checkpoint (quantization_config dequantize):
                    # dequantized here, once both halves are read
                    base, _, half = hf_name.rpartition("_")
                    got = pending.setdefault(base, {})
                    got[half] = full_tensor(tensor)
                    if len(got) < 2 or got["blocks"].is_floating_point():
                        if len(got) == 2:
                            raise ValueError(f"{base}: float MXFP4 blocks (dummy weights) "
                                             "for float experts")
                        continue
                    w = dequantize_mxfp4(got.pop("blocks"), got.pop("scales"), self.dtype)
                    load_gptoss_expert(moe, base, w.transpose(1, 2))
                    experts.add(_FERRY_EXPERT.sub(r"\1\2_weight", name))
                    continue
                load_gptoss_expert(moe, hf_name, tensor)
                experts.add(name)

        return DecoderForCausalLM.load_weights(self, dense()) | experts


def _deinterleave(t: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """[E, 2I, ...] with rows alternating gate, up -> this rank's [E, 2n, ...]: its n gate
    rows, then its n up rows."""
    gate, up = t[:, 0::2], t[:, 1::2]
    return torch.cat([gate[:, rank * n:(rank + 1) * n], up[:, rank * n:(rank + 1) * n]], 1)


def load_gptoss_expert(moe: FusedMoE, name: str, loaded) -> None:
    """Load one stacked gpt-oss expert tensor (HF name ``name``) into ``moe``: this rank's
    experts (expert parallelism) and its slice of I (tensor parallelism), gate/up rows
    de-interleaved. Float ``*_blocks``/``*_scales`` (dummy weights) become dummy MXFP4.

    Raises:
        ValueError: a tensor of the wrong shape, a float tensor for MXFP4 experts or MXFP4
            bytes for float ones.
    """
    part = name.rsplit(".", 1)[1]
    t = full_tensor(loaded)
    if part.endswith(("_blocks", "_scales")) and t.is_floating_point():
        blocks, scales = dummy_mxfp4(t if part.endswith("_blocks") else t[..., None])
        t = blocks if part.endswith("_blocks") else scales
    mx = moe.options.mxfp4
    if mx != part.endswith(("_blocks", "_scales")) and not part.endswith("_bias"):
        raise ValueError(f"{name}: the experts are {'MXFP4' if mx else 'float'} (the config's "
                         "quantization_config) but the checkpoint's tensor is not")
    if moe.ep_size > 1:
        t = t[moe.first_expert:moe.first_expert + moe.num_local_experts]
    n = moe.intermediate_size // moe.i_split
    rank = moe.tp_rank if moe.i_split > 1 else 0
    if part == "gate_up_proj":
        src, dst = _deinterleave(t.transpose(1, 2), n, rank), moe.w13_weight
    elif part in ("gate_up_proj_blocks", "gate_up_proj_bias"):
        src = _deinterleave(t, n, rank)
        dst = moe.w13_weight if part.endswith("_blocks") else moe.w13_bias
    elif part == "gate_up_proj_scales":
        src, dst = _deinterleave(t, n, rank), moe.w13_scales
    elif part == "down_proj":
        src, dst = t.transpose(1, 2)[:, :, rank * n:(rank + 1) * n], moe.w2_weight
    elif part in ("down_proj_blocks", "down_proj_scales"):
        g = n // 32
        src = t[:, :, rank * g:(rank + 1) * g]
        dst = moe.w2_weight if part.endswith("_blocks") else moe.w2_scales
    elif part == "down_proj_bias":
        src, dst = t, moe.w2_bias
    else:
        raise ValueError(f"{name}: not a gpt-oss expert tensor")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not give this rank's "
                         f"{tuple(dst.shape)}")
    dst.data.copy_(src)
