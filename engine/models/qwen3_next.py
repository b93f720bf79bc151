"""Qwen3-Next and Qwen3.5 (text): hybrid Gated DeltaNet + gated full-attention decoders.

Checked against transformers 5.24's ``modeling_qwen3_next.py``, ``modeling_qwen3_5.py`` and
``modeling_qwen3_5_moe.py``. Each decoder layer is pre-norm with (1 + w) RMSNorms
(:class:`engine.layers.norm.GemmaRMSNorm`) and one token mixer, as the config's
``layer_types`` say (HF's default: every ``full_attention_interval``-th layer full):

  - ``linear_attention``: a Gated DeltaNet (:class:`engine.layers.gated_deltanet.GatedDeltaNet`;
    Qwen3-Next's grouped ``in_proj_qkvz``/``in_proj_ba``, Qwen3.5's split ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) over its slot of the recurrent-state pool
    (``ForwardBatch.state``; ``LayerSpec`` ``LINEAR`` / ``RECURRENT_STATE``);
  - ``full_attention``: :class:`GatedAttention`, whose ``q_proj`` gives each head's query and
    an output gate (``[q_h | gate_h]`` per head), per-head (1 + w) q/k norms, a partial
    rotary (``partial_rotary_factor``, 0.25 in the published configs) and
    ``o_proj(attn * sigmoid(gate))``, over the paged KV pool (its K/V buffers are indexed
    among the full-attention layers only: the pool holds no K/V for the linear layers).

MLPs: Qwen3-Next's MoE (softmax top-k, ``norm_topk_prob``, a shared expert scaled by
``sigmoid(shared_expert_gate(x))``; dense layers where ``mlp_only_layers`` or
``decoder_sparse_step`` say), Qwen3.5's dense SwiGLU, Qwen3.5-MoE's MoE (top-k always
renormalised, a gated shared expert in every layer). Qwen3.5's multimodal rotary (mrope) is
the plain rotary for text (its three position rows are equal).

``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (the multimodal
releases) are these text models with a vision tower and M-RoPE: :mod:`engine.models.qwen3_5_vl`.

Tensor parallelism: the Gated DeltaNet layers split their heads over the ranks
(:mod:`engine.layers.gated_deltanet`; the state pool's slots hold a rank's heads), the full
attention layers their query heads (with their gates) and K/V heads as the dense families
do, the MoE its experts (``--ep-size``) or their width. ``--tp-size`` must divide
``linear_num_key_heads`` and ``linear_num_value_heads`` (:func:`check_tensor_parallel`,
checked before any worker starts). Prefix reuse keeps snapshots of the states
(``engine/kv/state_snapshots.py``), each rank of its share.

The checkpoints' MTP layer (``mtp.*``) is not part of the model: ``--speculative-algorithm
MTP`` loads it into its proposer (``engine/speculative/mtp.py``); a verify step leaves the
linear layers' states at each request's last accepted token (the state after each of its
rows goes to a scratch slot, ``RecurrentStatePool.commit`` copies the accepted one).

Device graphs: decode steps and speculative verify steps are captured and replayed
(``engine/executor/graph_runner.py`` hands the linear layers their state slots from a static
device buffer; padded rows point at the pool's slot 0). Prefill and mixed steps run eagerly:
no piecewise graphs (``supports_piecewise`` False; the start-up log says so).

Not here (refused at start-up, ``engine/executor/preflight.py``): EAGLE-3 and STANDALONE
speculation, LoRA.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RecurrentStateSpec
from engine.layers.attention import Attention
from engine.layers.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetDims,
    LinearStateBatch,
    check_tp_heads,
    checkpoint_shapes,
)
from engine.layers.linear import QKVLinear, RowParallelLinear, VocabEmbedding
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from engine.models.base import full_attention_specs
from engine.models.blocks import GatedMLP, MlpFactory
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.moe import MoeForCausalLM
from engine.models.weights import skip_mtp

_KINDS = {"linear_attention": AttentionKind.LINEAR, "full_attention": AttentionKind.FULL}


def _text(config):
    return getattr(config, "text_config", None) or config


def gdn_dims(config) -> GatedDeltaNetDims:
    """The Gated DeltaNet shape of an HF Qwen3-Next / Qwen3.5 config (``linear_*`` fields)."""
    t = _text(config)
    return GatedDeltaNetDims(t.hidden_size, t.linear_num_key_heads, t.linear_num_value_heads,
                             t.linear_key_head_dim, t.linear_value_head_dim,
                             t.linear_conv_kernel_dim, float(t.rms_norm_eps))


def hybrid_layer_specs(mc: ModelConfig, config) -> list[LayerSpec]:
    """One spec per layer from the config's ``layer_types``: ``LINEAR`` layers keeping a
    ``RECURRENT_STATE`` (their conv and recurrent state shapes), ``FULL`` layers over the
    paged KV (the config's heads and partial rotary).

    Raises:
        ValueError: a layer type other than ``linear_attention`` / ``full_attention``, or a
            ``layer_types`` list whose length is not the layer count.
    """
    types = list(mc.layer_types)
    if len(types) != mc.num_layers or set(types) - set(_KINDS):
        raise ValueError(f"{mc.architecture}: layer_types {types} must name each of the "
                         f"{mc.num_layers} layers as one of {sorted(_KINDS)}")
    d = gdn_dims(config)
    full = full_attention_specs(mc)[0]
    linear = LayerSpec(
        attention=AttentionKind.LINEAR, cache=CacheKind.RECURRENT_STATE,
        head_dim=d.k_head_dim, v_head_dim=d.v_head_dim, num_kv_heads=d.num_k_heads,
        rotary=None, state=RecurrentStateSpec(d.conv_dim, d.conv_width, d.num_v_heads,
                                              d.k_head_dim, d.v_head_dim))
    return [linear if t == "linear_attention" else full for t in types]


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention: query and output gate from one ``q_proj`` (fused with
    k/v into ``qkv_proj``), per-head (1 + w) q/k norms, rotary, ``o_proj(o * sigmoid(g))``;
    under tensor parallelism a rank holds ``num_heads / tp`` heads (and their gates), its
    share of the K/V heads, and a row-parallel ``o_proj``.

    Args:
        config: the model's shape; spec: the layer's (head size, K/V heads, rotary);
        kv_layer: the layer's index among the full-attention layers (its K/V buffers);
        dtype: parameter dtype.
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, kv_layer: int, dtype: torch.dtype):
        super().__init__()
        self.head_dim = d = spec.head_dim
        h = config.num_heads
        # q_proj's rows are [q_h | gate_h] per head: a fused projection of 2h "heads", so a
        # tensor-parallel rank's q rows are its heads' [q | gate] pairs
        self.qkv_proj = QKVLinear(config.hidden_size, d, 2 * h, spec.num_kv_heads,
                                  config.attention_bias, dtype)
        self.num_heads = self.qkv_proj.num_heads // 2       # this rank's
        self.q_size = self.num_heads * d
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, config.attention_bias, dtype)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype)
        self.attn = Attention(self.num_heads, self.qkv_proj.num_kv_heads, d, kv_layer,
                              spec=spec)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        t, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(t, -1, d))
        q, k = rope.rotate(q.reshape(t, self.q_size), k.reshape(t, self.kv_size), positions)
        out = self.attn(q, k, v, fb) * torch.sigmoid(gate.reshape(t, self.q_size))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    """Pre-norm layer ``h += mixer(norm(h))``, ``h += mlp(norm(h))`` with (1 + w) norms and
    the residual adds fused into them; the mixer is ``linear_attn`` (a Gated DeltaNet over
    its state slot ``state_index`` of the pool) or ``self_attn`` (:class:`GatedAttention`)."""

    def __init__(self, config: ModelConfig, hf_config, spec: LayerSpec, index: int,
                 mlp: nn.Module, dtype: torch.dtype, split_projections: bool):
        super().__init__()
        self.is_linear = spec.cache == CacheKind.RECURRENT_STATE
        #: the layer's index among the layers of its kind (state slots or K/V buffers)
        self.state_index = index
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(gdn_dims(hf_config), dtype, split_projections)
        else:
            self.self_attn = GatedAttention(config, spec, index, dtype)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps,
                                                     dtype)

    def _state(self, fb: ForwardBatch) -> LinearStateBatch:
        st, n = fb.state, self.state_index
        if st is None:
            raise RuntimeError("a linear-attention layer ran without the step's recurrent-state "
                               "view (ForwardBatch.state): the runner built no state pool")
        return LinearStateBatch(st.conv_states[n], st.recurrent_states[n], st.slots,
                                st.cu_seqlens, fb.is_decode, fb.num_decodes, st.cu_seqlens_dev,
                                st.verify_n, st.scratch_base, st.prefill_cu)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RotaryEmbedding, positions: torch.Tensor, fb: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, self._state(fb))
        else:
            hidden = self.self_attn(hidden, rope, positions, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridModel(nn.Module):
    """Embedding, hybrid layers (one per spec), final (1 + w) norm, one rotary table
    (``mrope``: Qwen3.5's interleaved multimodal RoPE, :class:`MRotaryEmbedding`, whose
    ``mrope_section`` defaults to HF's ``[11, 11, 10]``)."""

    #: ``inject(hidden, fb) -> hidden``: a step's image embeddings written over its image
    #: tokens' (``engine/models/qwen3_5_vl.py``), or None
    inject = None

    def __init__(self, config: ModelConfig, hf_config, specs: list[LayerSpec],
                 dtype: torch.dtype, make_mlp: MlpFactory, split_projections: bool,
                 mrope: bool = False):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        counts = {True: 0, False: 0}
        layers = []
        for i, spec in enumerate(specs):
            linear = spec.cache == CacheKind.RECURRENT_STATE
            layers.append(HybridDecoderLayer(config, hf_config, spec, counts[linear],
                                             make_mlp(config, i, dtype), dtype,
                                             split_projections))
            counts[linear] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        rope_cls, params = RotaryEmbedding, config.rope_parameters
        if mrope:
            rope_cls = MRotaryEmbedding
            params = {"mrope_section": [11, 11, 10], **(params or {}),
                      "mrope_interleaved": True}
        self.rotary_emb = rope_cls(config.head_dim, config.max_position_embeddings,
                                   config.rope_theta, params)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions [T] int64 (``fb.mrope_positions`` [3, T] replaces the
        positions when set: a step with image requests) -> final normed hidden states
        [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        if fb.mm_segments and self.inject is not None:
            hidden = self.inject(hidden, fb)
        if fb.mrope_positions is not None:
            positions = fb.mrope_positions
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rotary_emb, positions, fb)
        return self.norm(hidden, residual)[0]


# ---- what the three classes share (composed, one call each) ------------------------------

def _build(model, mc: ModelConfig, dtype: torch.dtype, split: bool) -> HybridModel:
    return HybridModel(mc, model.config, model.layer_specs(), dtype, model._mlp, split,
                       mrope=getattr(model, "mrope", False))


def _attention_layers(model) -> list[Attention]:
    return [layer.self_attn.attn for layer in model.model.layers if not layer.is_linear]


#: why the hybrid models have no piecewise graphs (``engine/executor/graph_setup.py`` logs it)
NO_PIECES = ("its linear-attention layers run prefill through variable-length kernels "
             "(the piecewise graphs do not cut the forward there)")


def _no_pieces(model, *args, **kwargs):
    raise NotImplementedError(f"{type(model).__name__}: piecewise graphs are not supported "
                              "(linear-attention layers: prefill runs eagerly)")


def check_tensor_parallel(config, tp_size: int) -> None:
    """Refuse a ``tp_size`` that does not split the Gated DeltaNet layers' heads (before any
    worker starts: ``engine.executor.tp_worker.check_tensor_parallel`` calls it).

    Raises:
        ValueError: one line naming ``--tp-size`` and the config field.
    """
    if tp_size > 1:
        check_tp_heads(gdn_dims(config), tp_size)


def _weight_shape(model, name: str) -> tuple[int, ...] | None:
    """The full shape of checkpoint tensor ``name`` where it differs from the decoder's
    rules (the Gated DeltaNet's tensors, the doubled ``q_proj``, the per-head norms)."""
    if ".linear_attn." in name:
        return checkpoint_shapes(gdn_dims(model.config),
                                 model.split_projections)[name.split(".linear_attn.")[1]]
    mc = model.model_config
    if name.endswith("self_attn.q_proj.weight"):
        return (2 * mc.num_heads * mc.head_dim, mc.hidden_size)
    if name.endswith("self_attn.q_proj.bias"):
        return (2 * mc.num_heads * mc.head_dim,)
    if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        return (mc.head_dim,)
    return None


class Qwen3NextForCausalLM(MoeForCausalLM):
    """Qwen3-Next: Gated DeltaNet and gated full attention, MoE with a gated shared expert."""

    family = "Qwen3-Next / Qwen3.5"
    attention_kinds = (AttentionKind.FULL, AttentionKind.LINEAR)
    cache_kinds = (CacheKind.PAGED_KV, CacheKind.RECURRENT_STATE)
    has_shared_expert = True
    #: the layout of the checkpoint's MTP layer (``mtp.*``; engine/speculative/mtp.py)
    mtp_style = "qwen3_next"
    #: Qwen3.5's split in_proj_qkv / in_proj_z / in_proj_b / in_proj_a
    split_projections = False
    #: the head counts a TP size must split (:func:`check_tensor_parallel`)
    check_tensor_parallel = staticmethod(check_tensor_parallel)
    #: prefill and mixed steps run eagerly (decode graphs run): :data:`NO_PIECES`
    supports_piecewise = False
    no_piecewise_reason = NO_PIECES

    def layer_specs(self) -> list[LayerSpec]:
        return hybrid_layer_specs(self.model_config, self.config)

    def _build_model(self, mc: ModelConfig, dtype: torch.dtype) -> HybridModel:
        return _build(self, mc, dtype, self.split_projections)

    def attention_layers(self) -> list[Attention]:
        return _attention_layers(self)

    def piece(self, i, positions, input_ids=None, attn_out=None, residual=None):
        _no_pieces(self)

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        return _weight_shape(self, name) or super()._hf_weight_shape(name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # the MTP layer (mtp.*) is the MTP proposer's (engine/speculative/mtp.py)
        return super().load_weights(skip_mtp(weights, "mtp.", type(self).__name__))


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE (text): Qwen3-Next's layers with split GDN projections; every layer MoE,
    top-k weights always renormalised."""

    split_projections = True

    def _renormalize(self, config: ModelConfig) -> bool:
        return True


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 (text, dense): Gated DeltaNet (split projections) and gated full attention,
    SwiGLU MLPs."""

    family = "Qwen3-Next / Qwen3.5"
    attention_kinds = (AttentionKind.FULL, AttentionKind.LINEAR)
    cache_kinds = (CacheKind.PAGED_KV, CacheKind.RECURRENT_STATE)
    split_projections = True
    check_tensor_parallel = staticmethod(check_tensor_parallel)
    #: prefill and mixed steps run eagerly (decode graphs run): :data:`NO_PIECES`
    supports_piecewise = False
    no_piecewise_reason = NO_PIECES
    mtp_style = "qwen3_next"

    def layer_specs(self) -> list[LayerSpec]:
        return hybrid_layer_specs(self.model_config, self.config)

    def _build_model(self, mc: ModelConfig, dtype: torch.dtype) -> HybridModel:
        return _build(self, mc, dtype, True)

    def _mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        return GatedMLP(config, dtype)

    def attention_layers(self) -> list[Attention]:
        return _attention_layers(self)

    def piece(self, i, positions, input_ids=None, attn_out=None, residual=None):
        _no_pieces(self)

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        return _weight_shape(self, name) or super()._hf_weight_shape(name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # the MTP layer (mtp.*) is the MTP proposer's (engine/speculative/mtp.py)
        return super().load_weights(skip_mtp(weights, "mtp.", type(self).__name__))


__all__ = ["GatedAttention", "HybridDecoderLayer", "HybridModel", "Qwen3NextForCausalLM",
           "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "check_tensor_parallel",
           "hybrid_layer_specs"]
