"""DeepSeek-V2 and DeepSeek-V3 (checked against transformers 5.24's ``modeling_deepseek_v2.py``
and ``modeling_deepseek_v3.py``): multi-head latent attention and DeepSeek's MoE.

Each layer is pre-norm: :class:`engine.layers.mla.MLAttention` (its latent rows in the
:class:`engine.kv.pool.LatentKVPool`) and an MLP that is dense for the first
``first_k_dense_replace`` layers (``ModelConfig.mlp_only_layers``) and otherwise
:class:`engine.layers.moe_grouped.GroupedMoeBlock` (both built by
:mod:`engine.models.deepseek_moe`, which GLM-4.5 shares): V2 routes with softmax scores
(``topk_method`` ``group_limited_greedy``: the best ``topk_group`` of ``n_group`` groups by
their best expert; ``greedy``: no groups) and no renormalisation (as HF's V2 router); V3 with
sigmoid scores, ``e_score_correction_bias`` for the choice, groups ranked by their two best,
``norm_topk_prob``; both scale the routed weights by ``routed_scaling_factor`` and add
``n_shared_experts`` shared experts (one MLP). Rope: the ``qk_rope_head_dim`` parts only,
interleaved in the checkpoint (V2 always, V3 with ``rope_interleave``).

Block-wise FP8 checkpoints (V3's own format) load as :class:`engine.models.moe.MoeForCausalLM`
says, with ``kv_b_proj`` dequantized to the run dtype after loading (MLA's absorbed form reads
its weight as a float tensor).

Tensor parallelism splits MLA by head (:class:`engine.layers.mla.MLAttention`: the query
and ``kv_b_proj`` rows, ``o_proj``'s columns; the latent and its pool are the same on every
rank) and the MoE as :class:`engine.layers.moe_grouped.GroupedMoeBlock` says (each expert's
width, or whole experts per rank with ``--ep-size``; the shared experts TP-split; one
all-reduce). ``--tp-size`` must divide ``num_attention_heads``.

Not supported yet (refused at construction, one line naming the family): other quantized
weights (per-channel FP8/4-bit, from :class:`engine.models.moe.MoeForCausalLM`), EAGLE-3
(the inputs of three layers for its head); piecewise graphs (``supports_piecewise`` False:
prefill runs eagerly); the preflight refuses LoRA and EAGLE-3 (an FP8 KV cache runs: the
latent pool holds e4m3, :mod:`engine.layers.mla`). Decode graphs capture the Triton MLA
kernels (``engine/attention/triton_mla.py``). V3's MTP layer is skipped here and loaded by
the MTP proposer (``engine/speculative/mtp.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import get_tp
from engine.forward_batch import ForwardBatch
from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RotarySpec, kv_heads_per_rank
from engine.layers.linear import LinearBase, VocabEmbedding, checkpoint_shape
from engine.layers.mla import MLAttention, mla_softmax_scale
from engine.layers.moe_grouped import GroupedRouting
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig
from engine.models.deepseek_moe import grouped_moe_mlp, grouped_moe_weight_shape, sigmoid_routing
from engine.models.moe import MoeForCausalLM


class DeepseekLayer(nn.Module):
    """``h += mla(norm(h))``, ``h += mlp(norm(h))`` (residual adds fused into the norms)."""

    def __init__(self, config: ModelConfig, text, layer_id: int, dtype: torch.dtype,
                 rotary: nn.Module, mlp: nn.Module, interleaved: bool, spec: LayerSpec):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = MLAttention(
            config.hidden_size, config.num_heads, text.q_lora_rank, text.kv_lora_rank,
            text.qk_nope_head_dim, text.qk_rope_head_dim, text.v_head_dim, layer_id, rotary,
            eps, dtype, mla_softmax_scale(text.qk_nope_head_dim + text.qk_rope_head_dim,
                                          config.rope_parameters),
            interleaved=interleaved, bias=config.attention_bias, spec=spec)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] and the residual stream (None before layer 0) -> the next pair."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(
            self.self_attn(positions, hidden, fb), residual)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    """Embedding, the MLA layers, the final norm and the rope table (``qk_rope_head_dim``)."""

    def __init__(self, config: ModelConfig, text, dtype: torch.dtype, make_mlp,
                 interleaved: bool, specs: list[LayerSpec]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.rotary_emb = RotaryEmbedding(text.qk_rope_head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_parameters)
        self.layers = nn.ModuleList(
            DeepseekLayer(config, text, i, dtype, self.rotary_emb, make_mlp(config, i, dtype),
                          interleaved, specs[i]) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final normed hidden states [T, H]."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, fb)
        return self.norm(hidden, residual)[0]


class DeepseekV2ForCausalLM(MoeForCausalLM):
    """DeepSeek-V2 (and V2-Lite): MLA, softmax grouped routing.

    Raises:
        ValueError: ``moe_layer_freq`` other than 1; attention heads the tensor-parallel
            size does not divide; as :class:`MoeForCausalLM` (quantized weights, no
            experts).
    """

    family = "DeepSeek-V2/V3"
    attention_kinds = (AttentionKind.LATENT,)
    cache_kinds = (CacheKind.LATENT_KV,)
    expert_parts = ("gate_proj", "up_proj", "down_proj")
    #: the piecewise graphs cannot cut the forward at MLA layers yet (:meth:`piece`)
    supports_piecewise = False

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        text = getattr(config, "text_config", None) or config
        freq = getattr(text, "moe_layer_freq", 1) or 1
        if freq != 1:
            raise ValueError(f"{type(self).__name__} with moe_layer_freq={freq} is not "
                             "supported (every layer after first_k_dense_replace is MoE)")
        super().__init__(config, dtype)
        if self._fp8_block:
            # block-FP8 (V3's checkpoints): MLA's absorbed form reads kv_b_proj's weight as a
            # float tensor, so that one layer is dequantized after loading
            for layer in self.model.layers:
                layer.self_attn.kv_b_proj.fp8_dequantize_after_load = True

    def _text(self):
        return getattr(self.config, "text_config", None) or self.config

    def _interleaved(self) -> bool:
        return True

    def _routing(self, config: ModelConfig) -> GroupedRouting:
        t = self._text()
        grouped = getattr(t, "topk_method", "greedy") == "group_limited_greedy"
        return GroupedRouting(scoring="softmax",
                              n_group=int(t.n_group or 1) if grouped else 1,
                              topk_group=int(t.topk_group or 1) if grouped else 1,
                              routed_scaling_factor=float(t.routed_scaling_factor or 1.0))

    def _mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        return grouped_moe_mlp(config, layer_id, dtype, self._routing(config),
                               self._expert_options())

    def _build_model(self, config: ModelConfig, dtype: torch.dtype) -> nn.Module:
        return DeepseekModel(config, self._text(), dtype, self._mlp, self._interleaved(),
                             self.layer_specs())

    def layer_specs(self) -> list[LayerSpec]:
        t, mc = self._text(), self.model_config
        qk = t.qk_nope_head_dim + t.qk_rope_head_dim
        spec = LayerSpec(attention=AttentionKind.LATENT, cache=CacheKind.LATENT_KV,
                         head_dim=qk, v_head_dim=t.v_head_dim, num_kv_heads=1,
                         scale=mla_softmax_scale(qk, mc.rope_parameters),
                         rotary=RotarySpec(kind=mc.rope_parameters.get("rope_type", "default"),
                                           base=mc.rope_theta),
                         kv_lora_rank=t.kv_lora_rank, qk_rope_head_dim=t.qk_rope_head_dim)
        return [spec] * mc.num_layers

    # ---- what MLA does not run yet --------------------------------------------------------

    def set_capture_hidden(self, mode: str | None) -> None:
        """The final normed hidden states (``"last"``: EAGLE-1/2 and MTP heads) or none;
        EAGLE-3's ``"aux"`` is refused (ValueError)."""
        if mode == "aux":
            raise ValueError(f"{type(self).__name__}: EAGLE-3 (the inputs of three layers) "
                             "is not supported with MLA yet")
        super().set_capture_hidden(mode)

    def attention_layers(self) -> list[MLAttention]:
        """Each layer's :class:`MLAttention` (its ``layer_id`` and ``spec``; the piecewise
        graphs cannot cut the forward at them: :meth:`piece` refuses)."""
        return [layer.self_attn for layer in self.model.layers]

    def piece(self, i, positions, input_ids=None, attn_out=None, residual=None):
        raise NotImplementedError(f"{type(self).__name__}: piecewise graphs are not "
                                  "supported with MLA yet")

    @property
    def q_size(self) -> int:
        """This rank's query heads times ``head_dim`` (the runner derives its head count)."""
        return self.model.layers[0].self_attn.num_heads * self.model_config.head_dim

    @property
    def kv_size(self) -> int:
        """This rank's K/V heads (as the dense families split them) times ``head_dim``."""
        mc = self.model_config
        return kv_heads_per_rank(mc.num_kv_heads, get_tp().size) * mc.head_dim

    # ---- weights ---------------------------------------------------------------------------

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        """MLA's tensors at their full (unsplit) shapes; the router's and the shared experts'
        as :func:`grouped_moe_weight_shape`; the rest as :class:`MoeForCausalLM`."""
        if ".self_attn." in name:
            module, _, leaf = name.rpartition(".")
            layer = self.get_submodule(module)
            if isinstance(layer, LinearBase):
                return checkpoint_shape(layer, leaf)
            return tuple(dict(self.named_parameters())[name].shape)
        shape = grouped_moe_weight_shape(self.model_config, name, super()._hf_weight_shape)
        return shape if shape is not None else super()._hf_weight_shape(name, inter)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and Moonlight, Kimi-K2's shape): sigmoid routing with the correction
    bias, top-2-sum group scores, ``norm_topk_prob``; rope interleaved with
    ``rope_interleave``. Its checkpoints' MTP layer (``model.layers.{num_hidden_layers}``)
    drafts for ``--speculative-algorithm MTP`` (``engine/speculative/mtp.py``)."""

    #: the layout of the checkpoint's MTP layer (``engine/speculative/mtp.py``)
    mtp_style = "deepseek"

    def load_weights(self, weights):
        """As :class:`MoeForCausalLM`, the MTP layer's tensors left out (``skip_mtp``)."""
        from engine.models.weights import skip_mtp

        n = self._text().num_hidden_layers
        return super().load_weights(skip_mtp(weights, f"model.layers.{n}.",
                                             type(self).__name__))

    def _interleaved(self) -> bool:
        return bool(getattr(self._text(), "rope_interleave", True))

    def _routing(self, config: ModelConfig) -> GroupedRouting:
        return sigmoid_routing(self._text())


__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]
