"""The building blocks of ferry's decoders, built from ``engine/layers/``.

A family module (``llama.py``, ``qwen.py``, ``qwen_moe.py``...) picks its switches and
composes these:

- :class:`GatedMLP`: the SwiGLU MLP, one fused gate-up matmul and the down projection.
- :class:`AttentionBlock`: the fused q/k/v projection, an optional q/k RMSNorm (per head, or
  over the whole projection), RoPE, the :class:`engine.layers.attention.Attention` layer
  (which holds the layer's :class:`engine.layer_spec.LayerSpec`) and ``o_proj``.
- :class:`DecoderLayer`: pre-norm attention and MLP, each with its residual add fused into
  the next norm (``norm``: the norm class, RMSNorm by default).
- :class:`DecoderModel`: the embedding, the layers, the final norm and the rotary table; its
  forward and its pieces (the forward cut at the attention calls, for the piecewise graphs).

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
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.linear import (
    MergedColumnLinear,
    QKVLinear,
    RowParallelLinear,
    VocabEmbedding,
)
from engine.layers.norm import RMSNorm, ShardedRMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig

#: ``norm(size, eps, dtype)``: the norm module of a decoder (RMSNorm, or a family's variant)
NormFactory = Callable[[int, float, torch.dtype], nn.Module]
#: ``make_mlp(config, layer_id, dtype)``: the MLP of one decoder layer
MlpFactory = Callable[[ModelConfig, int, torch.dtype], nn.Module]


@dataclass(frozen=True)
class AttentionOptions:
    """A family's attention switches.

    Attributes:
        qkv_bias: bias on the q/k/v projections.
        o_bias: bias on ``o_proj``.
        qk_norm: False (none), True (an RMSNorm per head of q and of k, before RoPE: Qwen3)
            or ``"full"`` (one RMSNorm over the whole q and the whole k projection: OLMoE).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool | str = False


class GatedMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` of width ``intermediate_size`` (default:
    the config's); with ``reduce_results=False`` the output is this rank's partial sum (see
    ``RowParallelLinear``).

    Raises:
        ValueError: a ``hidden_act`` other than silu.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 intermediate_size: int | None = None, reduce_results: bool = True):
        super().__init__()
        act = config.hidden_act
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; ferry supports silu")
        bias = config.mlp_bias
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [inter, inter], bias, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, dtype,
                                           reduce_results=reduce_results)
        self.act_fn = SiluAndMul()

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
            self.q_norm = RMSNorm(d, eps, dtype)
            self.k_norm = RMSNorm(d, eps, dtype)
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


class DecoderModel(nn.Module):
    """Embedding, decoder layers (one per spec), final norm, rotary table.

    Args:
        config: the model's shape.
        specs: one :class:`LayerSpec` per layer (``CausalLM.layer_specs``).
        dtype: parameter dtype (the RoPE table stays fp32).
        options: the family's attention switches.
        make_mlp: ``make_mlp(config, layer_id, dtype)``, the MLP of each layer (default
            :class:`GatedMLP`: MoE families give their block).
        norm: the norm class of the layers and the final norm.
        rotary: the rotary table (default: a :class:`RotaryEmbedding` from the config's
            rope parameters; a family with its own rope type gives its table).
    """

    def __init__(self, config: ModelConfig, specs: Sequence[LayerSpec], dtype: torch.dtype,
                 options: AttentionOptions, make_mlp: MlpFactory | None = None,
                 norm: NormFactory = RMSNorm, rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, i, dtype, options, make_mlp, norm)
                                    for i, spec in enumerate(specs))
        self.norm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = rotary if rotary is not None else RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_parameters)
        #: layers whose input (hidden + residual, unnormed) the forward keeps in
        #: ``aux_hidden`` (EAGLE-3's low/mid/high states); empty: none kept
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final normed hidden states [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, self.rotary_emb, positions, fb)
        if self.aux_layers:  # in the listed order (a layer may be listed twice)
            self.aux_hidden = [aux[i] for i in self.aux_layers]
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def piece(self, i: int, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
              attn_out: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """Piece ``i`` of the forward (see :meth:`engine.models.base.CausalLM.piece`)."""
        if i == 0:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = self.layers[i - 1].post_attn(attn_out, residual)
        if i == len(self.layers):
            return self.norm(hidden, residual)[0]
        return self.layers[i].pre_attn(hidden, residual, self.rotary_emb, positions)
