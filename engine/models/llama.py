"""Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window, Qwen2, Qwen3).

A minimal gpt-fast / nano-vllm style model: one fused QKV matmul and one fused gate-up matmul
per layer, RMSNorm with the residual add fused into it, RoPE (NeoX layout), SwiGLU, and
attention through :class:`engine.layers.attention.Attention` (paged KV cache, the backend is
``forward_batch.attn_backend``). The forward has no host syncs and no per-token Python loops.

Variants differ only in small switches (``_options``):
  - Llama/Mistral: q/k/v/o bias = ``config.attention_bias`` (default False).
  - Qwen2: bias on q/k/v, none on o.
  - Qwen3: per-head RMSNorm on q and k (``q_norm``/``k_norm``) before RoPE; ``head_dim`` from
    the config, which may differ from ``hidden_size / num_heads``.

Parameter names follow HF with fused projections: ``...self_attn.qkv_proj`` (from
``q_proj``/``k_proj``/``v_proj``) and ``...mlp.gate_up_proj`` (from ``gate_proj``/``up_proj``).
With ``tie_word_embeddings`` the LM head is the embedding table.

FP8 checkpoints add ``<module>.weight_scale`` tensors, loaded like the weights onto the fused
``...qkv_proj.weight_scale`` / ``...gate_up_proj.weight_scale`` (same shard ids); their
static ``input_scale`` (and KV ``k_scale``/``v_scale``) tensors are skipped.

The classes implement the model contract :class:`engine.models.base.CausalLM`; every shape
comes from :class:`engine.models.config.ModelConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.linear import (
    MergedColumnLinear,
    QKVLinear,
    RowParallelLinear,
    VocabEmbedding,
    default_weight_loader,
)
from engine.layers.norm import RMSNorm, ShardedRMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import CausalLM
from engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# (ferry fused param, HF checkpoint part, shard id)
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# checkpoint tensors that are not weights (precomputed RoPE tables)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# FP8 checkpoints' static activation and KV scales: activations are quantized per token at
# run time, the KV cache format is --kv-cache-dtype (engine.layers.quantization)
STATIC_SCALE_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")


class LlamaAttention(nn.Module):
    """Attention with fused QKV; ``qk_norm``: False, True (Qwen3: RMSNorm per head of q and
    k) or ``"full"`` (OLMoE: one RMSNorm over the whole q and k projections)."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool | str):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, config.num_heads,
                                  config.num_kv_heads, qkv_bias, dtype)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size,
                                        o_bias, dtype)
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.full_qk_norm = qk_norm == "full"
        if self.full_qk_norm:
            d, eps = self.head_dim, config.rms_norm_eps
            self.q_norm = ShardedRMSNorm(config.num_heads * d, eps, dtype)
            self.k_norm = ShardedRMSNorm(config.num_kv_heads * d, eps, dtype,
                                         replicas=self.qkv_proj.kv_replicas)
        elif qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_id)

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


class LlamaMLP(nn.Module):
    """SwiGLU MLP of width ``intermediate_size`` (default: the config's); with
    ``reduce_results=False`` the output is this rank's partial sum (see
    ``RowParallelLinear``)."""

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
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, options: dict,
                 make_mlp=None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, dtype, **options)
        self.mlp = (LlamaMLP(config, dtype) if make_mlp is None
                    else make_mlp(config, layer_id, dtype))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

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
        q, k, v, residual = self.pre_attn(hidden, residual, rope, positions)
        return self.post_attn(self.self_attn.attn(q, k, v, fb), residual)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, options: dict, make_mlp=None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, options, make_mlp)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_parameters)
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


class LlamaForCausalLM(CausalLM):
    """Causal LM over the paged KV cache.

    Args:
        config: HF ``PretrainedConfig`` (llama-like fields; a multimodal config's
            ``text_config`` is used) or a ``ModelConfig``.
        dtype: parameter and activation dtype. Parameters are created uninitialised on the
            current default device (build it under ``with torch.device(dev):``); the RoPE table
            stays fp32.
    """

    #: (ferry fused param, HF checkpoint part, shard id), for the loader and quantization
    stacked_params = STACKED_PARAMS

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model_config = mc = ModelConfig.from_hf(config)
        self.dtype = dtype
        self.model = LlamaModel(mc, dtype, self._options(mc), self._mlp)
        self.tie_word_embeddings = mc.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabEmbedding(mc.vocab_size, mc.hidden_size, dtype)

    @staticmethod
    def _options(config: ModelConfig) -> dict:
        bias = config.attention_bias
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def _mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        """The MLP of decoder layer ``layer_id`` (a hook: MoE models return their block)."""
        return LlamaMLP(config, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """One model step.

        Args:
            input_ids: [T] int64 token ids of the new tokens.
            positions: [T] int64 positions of those tokens in their sequences.
            forward_batch: the step's ``ForwardBatch`` (KV pool, backend, logits_indices).
        Returns:
            float32 logits ``[len(logits_indices), vocab]``, or ``[T, vocab]`` when
            ``forward_batch.logits_indices`` is None.
        """
        hidden = self.model(input_ids, positions, forward_batch)
        if self.capture_hidden is not None:
            self.hidden_out = hidden if self.capture_hidden == "last" else \
                torch.cat(self.model.aux_hidden, dim=-1)
        return self.compute_logits(hidden, forward_batch.logits_indices)

    def set_capture_hidden(self, mode: str | None) -> None:
        """See :meth:`engine.models.base.CausalLM.set_capture_hidden`; ``"aux"`` keeps the
        inputs of layers ``(2, L // 2, L - 3)`` (SGLang's and vLLM's EAGLE-3 default)."""
        if mode not in (None, "last", "aux"):
            raise ValueError(f"unknown hidden-state capture {mode!r}")
        n = len(self.model.layers)
        if mode == "aux" and n < 3:
            raise ValueError(f"EAGLE-3 reads the inputs of layers 2, L/2 and L-3: the target "
                             f"needs at least 3 layers, it has {n}")
        self.model.aux_layers = (2, n // 2, n - 3) if mode == "aux" else ()
        self.capture_hidden = mode
        self.hidden_out = None

    # ---- the contract's piecewise split and LM head -------------------------------------

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def piece(self, i: int, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
              attn_out: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        return self.model.piece(i, positions, input_ids, attn_out, residual)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    # ---- weights -------------------------------------------------------------------------

    def expected_weights(self) -> set[str]:
        """Keys that a complete checkpoint must fill: ``name`` or ``name:shard`` for fused.

        Parameters marked ``derived`` (FP8 scales computed from the float weights at load
        time) are not expected; an FP8 checkpoint's ``weight_scale`` tensors are."""
        keys = set()
        for name, p in self.named_parameters():
            if getattr(p, "derived", False):
                continue
            fused = [(part, shard) for f, part, shard in STACKED_PARAMS if f".{f}." in name]
            if fused:
                keys.update(f"{name}:{shard}" for _, shard in fused)
            else:
                keys.add(name)
        return keys

    def hf_weight_names(self) -> list[str]:
        """The HF checkpoint names (unfused) of every weight this model needs."""
        parts = {(fused, str(shard)): part for fused, part, shard in STACKED_PARAMS}
        names = []
        for key in sorted(self.expected_weights()):
            name, _, shard = key.partition(":")
            if shard:
                fused = next(f for f, _, s in STACKED_PARAMS
                             if f".{f}." in name and str(s) == shard)
                name = name.replace(f".{fused}.", f".{parts[(fused, shard)]}.")
            names.append(name)
        return names

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full (unsplit) shape of each HF checkpoint tensor the model needs (dummy
        weights are drawn at these shapes, so every tensor-parallel size sees the same
        model)."""
        return {name: self._hf_weight_shape(name) for name in self.hf_weight_names()}

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        """The full shape of HF checkpoint tensor ``name`` (MLP width ``inter``, default the
        config's ``intermediate_size``)."""
        mc = self.model_config
        h, d = mc.hidden_size, mc.head_dim
        inter = inter or mc.intermediate_size
        rows = {"q_proj": mc.num_heads * d, "k_proj": mc.num_kv_heads * d,
                "v_proj": mc.num_kv_heads * d, "gate_proj": inter, "up_proj": inter}
        parts = name.split(".")
        kind, leaf = parts[-2], parts[-1]
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return (mc.vocab_size, h)
        if kind in ("q_norm", "k_norm"):
            return (d,)
        if kind.endswith("norm"):
            return (h,)
        if kind in rows:
            return (rows[kind], h) if leaf == "weight" else (rows[kind],)
        if kind == "o_proj":
            return (h, mc.num_heads * d) if leaf == "weight" else (h,)
        if kind == "down_proj":
            return (h, inter) if leaf == "weight" else (h,)
        raise ValueError(f"no known shape for checkpoint tensor {name}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors (any float dtype, any device).

        Fused parameters get each part through their ``weight_loader``; RoPE buffers are
        skipped, as is ``lm_head.weight`` when the embeddings are tied. Unknown names are
        logged and skipped, as are FP8 checkpoints' static scales (``STATIC_SCALE_SUFFIXES``).

        Returns:
            the keys loaded (see :meth:`expected_weights`).
        Raises:
            ValueError: a tensor of the wrong shape, or an FP8 tensor for a parameter that
                is not FP8 (an FP8 embedding or LM head).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        static_scales = 0
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name.endswith(STATIC_SCALE_SUFFIXES):
                static_scales += 1
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            for fused, part, shard in STACKED_PARAMS:
                if f".{part}." in name:
                    pname = name.replace(f".{part}.", f".{fused}.")
                    if pname in params:
                        p = params[pname]
                        _check_fp8(name, p, tensor)
                        _load(name, p.weight_loader, p, tensor, shard)
                        loaded.add(f"{pname}:{shard}")
                        break
            else:
                p = params.get(name)
                if p is None:
                    unexpected.append(name)
                    continue
                _check_fp8(name, p, tensor)
                _load(name, getattr(p, "weight_loader", default_weight_loader), p, tensor)
                loaded.add(name)
        if static_scales:
            logger.info("skipped %d static activation/KV scales of the FP8 checkpoint: "
                        "activations are quantized per token at run time", static_scales)
        if unexpected:
            logger.warning("skipped %d checkpoint tensors with unknown names: %s%s",
                           len(unexpected), ", ".join(unexpected[:8]),
                           " ..." if len(unexpected) > 8 else "")
        return loaded


def _load(name: str, loader, param: torch.Tensor, tensor, *shard) -> None:
    """``loader(param, tensor, *shard)``; a ValueError names the checkpoint tensor."""
    try:
        loader(param, tensor, *shard)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _check_fp8(name: str, param: torch.Tensor, tensor) -> None:
    fp8 = torch.float8_e4m3fn
    if getattr(tensor, "dtype", None) == fp8 and param.dtype != fp8:
        raise ValueError(f"{name} is FP8 in the checkpoint, but ferry loads it as "
                         f"{str(param.dtype).removeprefix('torch.')}: FP8 linear weights need "
                         "the checkpoint's quantization_config (their scales), and FP8 "
                         "embeddings, norms and LM heads are not supported")


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral = Llama layers; the loader caps the context at ``sliding_window`` (see loader)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: bias on the q/k/v projections, none on o_proj."""

    @staticmethod
    def _options(config: ModelConfig) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): per-head RMSNorm on q and k before RoPE; explicit ``head_dim``."""

    @staticmethod
    def _options(config: ModelConfig) -> dict:
        bias = config.attention_bias
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
