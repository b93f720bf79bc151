"""Gemma 4's decoder blocks (text), composed from :mod:`engine.layers` and Gemma 3's
:class:`engine.models.blocks.GatedMLP`; the family is :mod:`engine.models.gemma4`.

- :class:`Gemma4Attention`: per-head q/k norms (plain ``w`` RMSNorm), a weightless v norm,
  softmax scale 1, the layer's own head size and K/V heads (global layers differ), and for a
  layer whose spec has a ``kv_source_layer`` no K/V projection at all: it projects q only
  and reads its source layer's K/V from the pool (``Attention`` called with k = v = None).
- :class:`Gemma4DecoderLayer`: Gemma's sandwich norms, then the per-layer input (PLE)
  block ``h += norm(proj(gelu(gate(h)) * ple_i))`` and the whole stream scaled by the
  checkpoint's ``layer_scalar``; in the MoE variant the experts run beside the dense MLP.
- :class:`Gemma4Router`: the MoE variant's router (its own weightless norm and scale,
  softmax, top-k renormalised, a learned per-expert scale); the experts are
  :class:`engine.layers.moe.FusedMoE` with GeGLU (``gelu_tanh``) experts.

The residual adds stay fused into the next norm, as in
:class:`engine.models.blocks.SandwichDecoderLayer`: :meth:`Gemma4DecoderLayer.post_attn`
returns a ``(hidden, residual)`` pair whose sum is the stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, get_tp
from engine.forward_batch import ForwardBatch
from engine.layer_spec import LayerSpec, kv_heads_per_rank
from engine.layers.attention import Attention
from engine.layers.linear import (
    ColumnParallelLinear,
    QKVLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.layers.moe import ExpertOptions, FusedMoE
from engine.layers.norm import RMSNorm, UnitRMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.blocks import GatedMLP
from engine.models.config import ModelConfig


class Gemma4Attention(nn.Module):
    """One Gemma 4 attention layer (module docstring).

    Args:
        config: the model's shape (hidden size, query heads, norm epsilon, bias).
        spec: the layer's description (its head size, K/V heads, window, scale 1,
            ``kv_source_layer``).
        layer_id: the layer's index (its entry in the pool's buffers).
        dtype: parameter dtype.
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.head_dim = d = spec.head_dim
        bias, eps = config.attention_bias, config.rms_norm_eps
        self.shares_kv = spec.kv_source_layer is not None
        tp = get_tp().size
        if self.shares_kv:   # q only: the K/V are the source layer's
            self.q_proj = ColumnParallelLinear(config.hidden_size, config.num_heads * d, bias,
                                               dtype)
            self.num_heads = config.num_heads // tp
            self.num_kv_heads = kv_heads_per_rank(spec.num_kv_heads, tp)
            self.k_norm = self.v_norm = None
        else:
            self.qkv_proj = QKVLinear(config.hidden_size, d, config.num_heads,
                                      spec.num_kv_heads, bias, dtype)
            self.num_heads = self.qkv_proj.num_heads
            self.num_kv_heads = self.qkv_proj.num_kv_heads
            self.k_norm = RMSNorm(d, eps, dtype)
            self.v_norm = UnitRMSNorm(eps)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.q_norm = RMSNorm(d, eps, dtype)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, bias, dtype)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, layer_id, spec=spec)

    def project_qkv(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [T, hidden] -> rotated q [T, Hq*D], k [T, Hkv*D] (normed, rotated) and v
        [T, Hkv*D] (normed); k and v are None in a layer that reads another's K/V."""
        t, d = x.shape[0], self.head_dim
        if self.shares_kv:
            q = self.q_norm(self.q_proj(x).view(t, self.num_heads, d)).reshape(t, self.q_size)
            # the rotary takes a k: one head of zeros, dropped
            q, _ = rope.rotate(q, q.new_zeros(t, d), positions)
            return q, None, None
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, d))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        v = self.v_norm(v.reshape(t, self.num_kv_heads, d))
        q, k = rope.rotate(q.reshape(t, self.q_size), k.reshape(t, self.kv_size), positions)
        return q, k, v.reshape(t, self.kv_size)


class Gemma4Router(nn.Module):
    """Gemma 4's MoE router (HF ``Gemma4TextRouter``): for the stream x [T, H],
    ``logits = proj(norm(x) * scale / sqrt(H))``, softmax in fp32, the top-k renormalised to
    sum 1, then each weight times ``per_expert_scale`` of its expert.

    Parameters (HF's names): ``proj.weight`` [E, H], ``scale`` [H], ``per_expert_scale`` [E].
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float,
                 dtype: torch.dtype):
        super().__init__()
        self.top_k = top_k
        self.root = hidden_size ** -0.5
        self.norm = UnitRMSNorm(eps)
        self.proj = ReplicatedLinear(hidden_size, num_experts, False, dtype)
        self.scale = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts, dtype=dtype),
                                             requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] fp32, expert ids [T, K] int32)."""
        probs = torch.softmax(self.proj(self.norm(x) * self.scale * self.root).float(), -1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[ids].float(), ids.to(torch.int32)


class Gemma4DecoderLayer(nn.Module):
    """A Gemma 4 decoder layer: sandwich norms around attention and the GeGLU MLP, the
    per-layer input block (when ``ple_size``), the stream times ``layer_scalar``.

    Args:
        config, spec, layer_id, dtype: as :class:`Gemma4Attention`.
        intermediate_size: the MLP's width (twice the config's on KV-sharing layers of a
            ``use_double_wide_mlp`` model).
        ple_size: P, the per-layer input width (0: none).
        moe: ``(num_experts, top_k, expert width)`` of the MoE variant, else None.
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, layer_id: int, dtype: torch.dtype,
                 intermediate_size: int, ple_size: int = 0,
                 moe: tuple[int, int, int] | None = None):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, spec, layer_id, dtype)
        self.mlp = GatedMLP(config, dtype, intermediate_size=intermediate_size)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype)
        # HF's buffer (saved in the checkpoint): the layer's output stream is scaled by it
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)
        self.ple_size = ple_size
        if ple_size:
            self.per_layer_input_gate = ReplicatedLinear(h, ple_size, False, dtype)
            self.per_layer_projection = ReplicatedLinear(ple_size, h, False, dtype)
            self.post_per_layer_input_norm = RMSNorm(h, eps, dtype)
        self.has_moe = moe is not None
        if moe is not None:
            experts, top_k, width = moe
            self.router = Gemma4Router(h, experts, top_k, eps, dtype)
            self.experts = FusedMoE(experts, top_k, h, width, True, dtype,
                                    options=ExpertOptions(activation="gelu_tanh"))
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps, dtype)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps, dtype)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps, dtype)

    def pre_attn(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                 rope: RotaryEmbedding, positions: torch.Tensor):
        """Input norm (with the residual add) and the q/k/v projection: ``(q, k, v,
        residual)`` (k, v None on a KV-sharing layer)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.self_attn.project_qkv(hidden, rope, positions)
        return q, k, v, residual

    def post_attn(self, attn_out: torch.Tensor, residual: torch.Tensor,
                  ple: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """o projection and its norm, the residual add fused into the pre-MLP norm, the MLP
        and its norm, the per-layer input block (``ple`` [T, P], this layer's), the layer
        scalar; returns ``(hidden, residual)`` [T, hidden] whose sum is the stream."""
        attn = self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        hidden, stream = self.pre_feedforward_layernorm(attn, residual)
        out = self.mlp(hidden)
        if self.has_moe:
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(
                self._experts(stream))
        out = self.post_feedforward_layernorm(out)
        if self.ple_size:
            stream = stream + out
            gate = F.gelu(self.per_layer_input_gate(stream), approximate="tanh")
            out = self.post_per_layer_input_norm(self.per_layer_projection(gate * ple))
        s = self.layer_scalar
        return out * s, stream * s

    def _experts(self, stream: torch.Tensor) -> torch.Tensor:
        """The MoE branch on the stream [T, H] (the MLP's input before its norm): routed on
        the stream, the experts on its own pre-norm; [T, H] summed over the ranks."""
        weights, ids = self.router(stream)
        out = self.experts.run_routed(self.pre_feedforward_layernorm_2(stream), weights, ids)
        return all_reduce(out) if self.experts.tp_size > 1 else out

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding,
                positions: torch.Tensor, fb: ForwardBatch, ple: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] and the residual stream (None before layer 0) -> the next
        layer's ``(hidden, residual)``."""
        q, k, v, residual = self.pre_attn(hidden, residual, rope, positions)
        return self.post_attn(self.self_attn.attn(q, k, v, fb), residual, ple)
