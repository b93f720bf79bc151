"""The building blocks of ferry's decoders, built from ``engine/layers/``.

A family module (``llama.py``, ``qwen.py``, ``qwen_moe.py``...) picks its switches and
composes these:

- :class:`GatedMLP`: the SwiGLU MLP, one fused gate-up matmul and the down projection.
- :class:`AttentionBlock`: the fused q/k/v projection, an optional q/k RMSNorm (per head, or
  over the whole projection), RoPE, the :class:`engine.layers.attention.Attention` layer
  (which holds the layer's :class:`engine.layer_spec.LayerSpec`) and ``o_proj``.
- :class:`DecoderLayer`: pre-norm attention and MLP, each with its residual add fused into
  the next norm (``norm``: the norm class, RMSNorm by default); its variants
  :class:`ScaledResidualDecoderLayer` (Granite's ``residual_multiplier``) and
  :class:`PostNormDecoderLayer` (OLMo 2's norms on the attention and MLP outputs).
- :class:`DecoderOptions`: which layer class, the embedding multiplier; chosen once when the
  model is built (the forward of a family that keeps the defaults is unchanged).
- :class:`DecoderModel`: the embedding, the layers, the final norm and the rotary table; its
  forward and its pieces (the forward cut at the attention calls, for the piecewise graphs).
  A layer whose spec has ``rotary=None`` (NoPE) gets :class:`engine.layers.rotary.NoRotary`.
- :class:`SandwichDecoderLayer`: Gemma's layer, a norm before and after each sub-block.
- :class:`DecoderModel`: the embedding (optionally scaled), the layers, the final norm and
  the rotary tables (one, or one per layer type); its forward and its pieces (the forward
  cut at the attention calls, for the piecewise graphs).

Module and parameter names are HF's with fused projections (``self_attn.qkv_proj``,
``mlp.gate_up_proj``), so the families load HF checkpoints by name
(:mod:`engine.models.weights`). The forward has no host syncs and no per-token Python loops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layer_spec import LayerSpec
from engine.layers.activation import gated_activation
from engine.layers.attention import Attention
from engine.layers.linear import (
    MergedColumnLinear,
    QKVLinear,
    RowParallelLinear,
    VocabEmbedding,
    embedding_scale,
)
from engine.layers.norm import RMSNorm, ShardedRMSNorm
from engine.layers.rotary import NoRotary, RotaryEmbedding
from engine.models.config import ModelConfig

#: ``norm(size, eps, dtype)``: the norm module of a decoder (RMSNorm, or a family's variant)
NormFactory = Callable[[int, float, torch.dtype], nn.Module]
#: ``make_mlp(config, layer_id, dtype)``: the MLP of one decoder layer
MlpFactory = Callable[[ModelConfig, int, torch.dtype], nn.Module]
#: ``rope_for(layer_id) -> (base, rope parameters)``: a layer's rotary (per layer type)
RopeFactory = Callable[[int], tuple[float, dict]]


@dataclass(frozen=True)
class AttentionOptions:
    """A family's attention switches.

    Attributes:
        qkv_bias: bias on the q/k/v projections.
        o_bias: bias on ``o_proj``.
        qk_norm: False (none), True (an RMSNorm per head of q and of k, before RoPE: Qwen3)
            or ``"full"`` (one RMSNorm over the whole q and the whole k projection: OLMoE).
        rope_interleaved: rotate pairs ``(0, 1), (2, 3)...`` instead of halves (GLM).
        qk_norm_cls: the per-head q/k norm class (``norm(size, eps, dtype)``; None:
            RMSNorm; Gemma 3: its ``(1 + w)`` norm).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool | str = False
    rope_interleaved: bool = False
    qk_norm_cls: NormFactory | None = None


@dataclass(frozen=True)
class DecoderOptions:
    """A family's decoder-layer switches (the defaults: Llama's pre-norm layers).

    Attributes:
        norm_placement: ``"pre"`` (norm the input of attention and MLP:
            :class:`DecoderLayer`) or ``"post"`` (norm their outputs before the residual
            add, no input norm: OLMo 2, EXAONE 4; :class:`PostNormDecoderLayer`).
        residual_multiplier: attention and MLP outputs are scaled by it before the residual
            add (Granite; 1.0: not scaled). Pre-norm layers only.
        embedding_multiplier: the embeddings are scaled by it (Granite; 1.0: not scaled).

    Raises:
        ValueError: an unknown placement, or a residual multiplier with post-norm layers.
    """

    norm_placement: str = "pre"
    residual_multiplier: float = 1.0
    embedding_multiplier: float = 1.0

    def __post_init__(self):
        if self.norm_placement not in ("pre", "post"):
            raise ValueError(f"norm_placement {self.norm_placement!r}: 'pre' or 'post'")
        if self.norm_placement == "post" and self.residual_multiplier != 1.0:
            raise ValueError("residual_multiplier is implemented for pre-norm layers only")


class GatedMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))`` of width ``intermediate_size`` (default:
    the config's); ``act`` is the config's ``hidden_act`` (SiLU: SwiGLU; Gemma's
    ``gelu_pytorch_tanh``: GeGLU, :mod:`engine.layers.activation`); with
    ``reduce_results=False`` the output is this rank's partial sum (see
    ``RowParallelLinear``).

    Raises:
        ValueError: a ``hidden_act`` without a gated activation in ferry.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 intermediate_size: int | None = None, reduce_results: bool = True):
        super().__init__()
        self.act_fn = gated_activation(config.hidden_act)
        bias = config.mlp_bias
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [inter, inter], bias, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, dtype,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class AttentionBlock(nn.Module):
    """One layer's attention: fused QKV, optional q/k norm, RoPE, attention, ``o_proj``.

    Args:
        config: the model's shape (hidden size, query heads, norm epsilon).
        spec: the layer's description (its ``head_dim``, ``num_kv_heads``, softmax scale);
            the ``Attention`` layer holds it and refuses kinds ferry does not run yet.
        layer_id: the layer's index (its K/V buffers in the pool).
        dtype: parameter dtype.
        options: the family's switches (:class:`AttentionOptions`).
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, layer_id: int, dtype: torch.dtype,
                 options: AttentionOptions):
        super().__init__()
        self.head_dim = d = spec.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, d, config.num_heads, spec.num_kv_heads,
                                  options.qkv_bias, dtype)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size,
                                        options.o_bias, dtype)
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.full_qk_norm = options.qk_norm == "full"
        eps = config.rms_norm_eps
        if self.full_qk_norm:
            self.q_norm = ShardedRMSNorm(config.num_heads * d, eps, dtype)
            self.k_norm = ShardedRMSNorm(spec.num_kv_heads * d, eps, dtype,
                                         replicas=self.qkv_proj.kv_replicas)
        elif options.qk_norm:
            head_norm = options.qk_norm_cls or RMSNorm
            self.q_norm = head_norm(d, eps, dtype)
            self.k_norm = head_norm(d, eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, layer_id, spec=spec)

    def project_qkv(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> rotated q [T, Hq*D], k [T, Hkv*D] and v [T, Hkv*D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.q_norm is not None:
            fused = rope.norm_rotate(q, k, positions, self.q_norm, self.k_norm)
            if fused is not None:  # one launch for both norms and the rotary
                return (*fused, v)
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        q, k = rope.rotate(q.reshape(t, self.q_size), k.reshape(t, self.kv_size), positions)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q, k, v = self.project_qkv(x, rope, positions)
        return self.o_proj(self.attn(q, k, v, fb))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h += attn(norm(h))``, ``h += mlp(norm(h))``, with each
    residual add fused into the following norm (the residual stream travels beside the
    hidden states).

    Args:
        config, spec, layer_id, dtype, options: as :class:`AttentionBlock`.
        make_mlp: ``make_mlp(config, layer_id, dtype)``, the layer's MLP (default:
            :class:`GatedMLP`; MoE families give their block).
        norm: the norm class (``norm(size, eps, dtype)``; default RMSNorm).
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, layer_id: int, dtype: torch.dtype,
                 options: AttentionOptions, make_mlp: MlpFactory | None = None,
                 norm: NormFactory = RMSNorm):
        super().__init__()
        self.self_attn = AttentionBlock(config, spec, layer_id, dtype, options)
        self.mlp = (GatedMLP(config, dtype) if make_mlp is None
                    else make_mlp(config, layer_id, dtype))
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)

    def pre_attn(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                 rope: RotaryEmbedding, positions: torch.Tensor):
        """Input norm (with the residual add) and the q/k/v projection.

        Returns ``(q, k, v, residual)``; q/k are rotated.
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.self_attn.project_qkv(hidden, rope, positions)
        return q, k, v, residual

    def post_attn(self, attn_out: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """o projection, post-attention norm with the residual add, and the MLP."""
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out),
                                                         residual)
        return self.mlp(hidden), residual

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding,
                positions: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] and the residual stream (None before layer 0) -> the next
        layer's ``(hidden, residual)``."""
        q, k, v, residual = self.pre_attn(hidden, residual, rope, positions)
        return self.post_attn(self.self_attn.attn(q, k, v, fb), residual)


class ScaledResidualDecoderLayer(DecoderLayer):
    """Pre-norm layer whose attention and MLP outputs are scaled by ``residual_multiplier``
    before their residual adds (Granite: ``h += m * attn(norm(h))``, ``h += m * mlp(norm(h))``).

    Args:
        residual_multiplier: ``m``; the rest as :class:`DecoderLayer`.
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, layer_id: int, dtype: torch.dtype,
                 options: AttentionOptions, make_mlp: MlpFactory | None = None,
                 norm: NormFactory = RMSNorm, residual_multiplier: float = 1.0):
        super().__init__(config, spec, layer_id, dtype, options, make_mlp, norm)
        self.residual_multiplier = residual_multiplier

    def post_attn(self, attn_out: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """o projection scaled, norm with the residual add, the MLP scaled (the next norm
        adds it)."""
        m = self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out) * m,
                                                         residual)
        return self.mlp(hidden) * m, residual


class PostNormDecoderLayer(DecoderLayer):
    """Post-norm layer (OLMo 2, OLMo 3, EXAONE 4): ``h += post_attention_layernorm(attn(h))``,
    ``h += post_feedforward_layernorm(mlp(h))``; no input norm.

    The ``(hidden, residual)`` pair it passes on sums to the residual stream (``hidden``: the
    normed MLP output, ``residual``: the stream before its add), so the next layer, and the
    model's final norm with its fused add, read it as after a pre-norm layer.

    Args:
        as :class:`DecoderLayer`.
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, layer_id: int, dtype: torch.dtype,
                 options: AttentionOptions, make_mlp: MlpFactory | None = None,
                 norm: NormFactory = RMSNorm):
        super().__init__(config, spec, layer_id, dtype, options, make_mlp, norm)
        del self.input_layernorm
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)

    def pre_attn(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                 rope: RotaryEmbedding, positions: torch.Tensor):
        """The residual stream (``hidden + residual``) and its q/k/v projection.

        Returns ``(q, k, v, stream)``; q/k are rotated.
        """
        stream = hidden if residual is None else hidden + residual
        q, k, v = self.self_attn.project_qkv(stream, rope, positions)
        return q, k, v, stream

    def post_attn(self, attn_out: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """o projection, its norm and residual add, the MLP and its norm (added by the
        next layer)."""
        stream = residual + self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


def _make_layer(config: ModelConfig, spec: LayerSpec, layer_id: int, dtype: torch.dtype,
                options: AttentionOptions, make_mlp: MlpFactory | None, norm: NormFactory,
                decoder: DecoderOptions) -> DecoderLayer:
    """The layer class ``decoder`` asks for (:class:`DecoderLayer` by default)."""
    if decoder.norm_placement == "post":
        return PostNormDecoderLayer(config, spec, layer_id, dtype, options, make_mlp, norm)
    if decoder.residual_multiplier != 1.0:
        return ScaledResidualDecoderLayer(config, spec, layer_id, dtype, options, make_mlp,
                                          norm, decoder.residual_multiplier)
    return DecoderLayer(config, spec, layer_id, dtype, options, make_mlp, norm)


class SandwichDecoderLayer(DecoderLayer):
    """Decoder layer with "sandwich" norms (Gemma 2/3): each sub-block's output is normed
    before its residual add, ``h += post_attn_norm(attn(input_norm(h)))``,
    ``h += post_ff_norm(mlp(pre_ff_norm(h)))``.

    The parameters are HF's: ``input_layernorm``, ``post_attention_layernorm`` (here the
    norm of the attention output), ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm``. The residual adds stay fused into the following norm:
    :meth:`post_attn` returns the MLP's normed output and the stream before its add, which
    the next layer's ``input_layernorm`` (or the final norm) adds.

    Args: as :class:`DecoderLayer`.
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, layer_id: int, dtype: torch.dtype,
                 options: AttentionOptions, make_mlp: MlpFactory | None = None,
                 norm: NormFactory = RMSNorm):
        super().__init__(config, spec, layer_id, dtype, options, make_mlp, norm)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)

    def post_attn(self, attn_out: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """o projection and its norm, the residual add fused into the pre-MLP norm, the MLP
        and its norm; returns ``(normed MLP output, residual stream)``, both [T, hidden]."""
        attn = self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        hidden, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers (one per spec), final norm, rotary tables.

    Args:
        config: the model's shape.
        specs: one :class:`LayerSpec` per layer (``CausalLM.layer_specs``).
        dtype: parameter dtype (the RoPE tables stay fp32).
        options: the family's attention switches.
        make_mlp: ``make_mlp(config, layer_id, dtype)``, the MLP of each layer (default
            :class:`GatedMLP`: MoE families give their block).
        norm: the norm class of the layers and the final norm.
        decoder: the layer placement and multipliers (:class:`DecoderOptions`; default
            Llama's pre-norm layers).
        layer: a family's decoder layer class (a :class:`DecoderLayer` subclass built with
            the arguments above: GLM-4's, Gemma's :class:`SandwichDecoderLayer`), instead of
            the one ``decoder`` picks.
        scale_embeddings: multiply the embeddings by ``sqrt(hidden_size)`` rounded to the
            run dtype (Gemma; :func:`engine.layers.linear.embedding_scale`).
        rope_for: ``rope_for(layer_id) -> (base, rope parameters)``, each layer's rotary
            (Gemma 3's local and global bases); default: the config's for every layer. A
            layer whose spec has ``rotary=None`` (NoPE) gets
            :class:`engine.layers.rotary.NoRotary`.
    """

    def __init__(self, config: ModelConfig, specs: Sequence[LayerSpec], dtype: torch.dtype,
                 options: AttentionOptions, make_mlp: MlpFactory | None = None,
                 norm: NormFactory = RMSNorm, decoder: DecoderOptions | None = None,
                 layer: type[DecoderLayer] | None = None, scale_embeddings: bool = False,
                 rope_for: RopeFactory | None = None):
        super().__init__()
        decoder = decoder or DecoderOptions()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.embedding_multiplier = decoder.embedding_multiplier
        self.embed_scale = embedding_scale(config.hidden_size, dtype) \
            if scale_embeddings else None
        self.layers = nn.ModuleList(
            layer(config, spec, i, dtype, options, make_mlp, norm) if layer is not None
            else _make_layer(config, spec, i, dtype, options, make_mlp, norm, decoder)
            for i, spec in enumerate(specs))
        self.norm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        ropes = self._layer_ropes(config, len(specs), rope_for, options.rope_interleaved)
        #: layer 0's table (the only one without ``rope_for``)
        self.rotary_emb = ropes[0]
        if any(spec.rotary is None for spec in specs):
            self.no_rotary = NoRotary()
        #: each layer's rotary (NoRotary for a spec without one)
        self.layer_ropes = tuple(r if spec.rotary is not None else self.no_rotary
                                 for r, spec in zip(ropes, specs))
        #: layers whose input (hidden + residual, unnormed) the forward keeps in
        #: ``aux_hidden`` (EAGLE-3's low/mid/high states); empty: none kept
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: list[torch.Tensor] = []

    def _layer_ropes(self, config: ModelConfig, n: int, rope_for: RopeFactory | None,
                     interleaved: bool) -> list[RotaryEmbedding]:
        """Each layer's rotary table: the config's for all by default; with ``rope_for``,
        one table per distinct (base, parameters), kept in ``rotary_embs``."""
        if rope_for is None:
            return [RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                    config.rope_theta, config.rope_parameters,
                                    interleaved=interleaved)] * n
        tables: dict[str, RotaryEmbedding] = {}
        ropes = []
        for i in range(n):
            base, params = rope_for(i)
            key = repr((float(base), sorted(params.items())))
            if key not in tables:
                tables[key] = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                              base, params, interleaved=interleaved)
            ropes.append(tables[key])
        self.rotary_embs = nn.ModuleList(tables.values())
        return ropes

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> embeddings [T, hidden] (scaled when the family says so:
        Granite's multiplier, Gemma's ``sqrt(hidden_size)``)."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final normed hidden states [T, hidden]."""
        hidden = self.embed(input_ids)
        residual = None
        aux = {}
        ropes = self.layer_ropes
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, ropes[i], positions, fb)
        if self.aux_layers:  # in the listed order (a layer may be listed twice)
            self.aux_hidden = [aux[i] for i in self.aux_layers]
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def piece(self, i: int, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
              attn_out: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """Piece ``i`` of the forward (see :meth:`engine.models.base.CausalLM.piece`)."""
        if i == 0:
            hidden, residual = self.embed(input_ids), None
        else:
            hidden, residual = self.layers[i - 1].post_attn(attn_out, residual)
        if i == len(self.layers):
            return self.norm(hidden, residual)[0]
        return self.layers[i].pre_attn(hidden, residual, self.layer_ropes[i], positions)
