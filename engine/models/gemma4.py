"""Gemma 4 (text): ``Gemma4ForCausalLM``, and the language model of a
``Gemma4ForConditionalGeneration`` checkpoint (its vision and audio towers skipped, one log
line), on Gemma 3's pieces (:class:`engine.models.gemma.GemmaForCausalLM`: the embedding
scale, the final logit soft-cap, the multimodal checkpoint's prefixes).

What differs from Gemma 3 (HF ``modeling_gemma4.py``, transformers 5.24):

- norms: plain ``w`` RMSNorm (not ``1 + w``) everywhere, q and k normed per head, v normed
  per head without a weight (:class:`engine.layers.norm.UnitRMSNorm`); softmax scale 1 (no
  ``query_pre_attn_scalar``), no attention soft-cap;
- global (``full_attention``) layers have their own head size (``global_head_dim``, 512
  on the published models) and, with ``attention_k_eq_v``, their own K/V heads
  (``num_global_key_value_heads``) and no ``v_proj``: v is the raw k projection (ferry
  loads ``k_proj`` into both its k and v rows); HF keeps both in ``per_layer_config``;
- rotary per layer type: sliding layers ``default`` (10k), global layers
  ``proportional`` (1M; only the first quarter of the frequency pairs turn,
  :func:`engine.layers.rotary.proportional_inv_freq`) over the global head size;
- KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V; each reads the K/V
  of the last earlier layer of its type (HF's ``kv_sharing_modes``: ``store`` / ``reuse``).
  Their :class:`engine.layer_spec.LayerSpec` names that layer in ``kv_source_layer``: the
  pool gives them no memory (their ``k_buffers[i]`` is the source's,
  :func:`engine.kv.pool.build_kv_pool`), and they project q only. With
  ``use_double_wide_mlp`` their MLP is twice as wide;
- per-layer input embeddings (``hidden_size_per_layer_input`` > 0, the E2B/E4B models): a
  second embedding table and a projection of the embeddings give each layer a P-wide input,
  gated into the stream after the MLP (:mod:`engine.models.gemma4_layers`);
- every layer's output stream is scaled by its ``layer_scalar`` (a checkpoint buffer).

- the MoE variant (``enable_moe_block``, 26B-A4B): beside the dense MLP, a router (its own
  norm and scales, :class:`engine.models.gemma4_layers.Gemma4Router`) and GeGLU experts
  (:class:`engine.layers.moe.FusedMoE`, ``gelu_tanh``) on the stream, each branch with its
  own norms, summed before the post-feedforward norm.

Not run (refused at construction, one line): bidirectional attention
(``use_bidirectional_attention: all``), and a model whose every layer shares K/V. Refused at
start-up (:func:`engine.executor.preflight.check_gemma4_flags`): LoRA and EAGLE heads (the
KV-sharing layers have no k/v projections, the decoder has no hidden-state hook).
Piecewise graphs are skipped (per-layer head sizes and the per-layer inputs do not fit
their one-buffer pieces); decode graphs run. The weighted norms are ferry's
:class:`engine.layers.norm.RMSNorm` (its fused kernels): in bf16 the normed value is
rounded before the weight is applied, one rounding more than HF's ``Gemma4RMSNorm`` (the
same in fp32); the weightless v and router norms run as torch ops.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RotarySpec
from engine.layers.linear import ReplicatedLinear, VocabEmbedding, embedding_scale
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig
from engine.models.gemma import SLIDING_TYPE, GemmaForCausalLM, text_config
from engine.models.gemma4_layers import Gemma4DecoderLayer

#: checkpoint prefixes of the towers ferry does not run: vision, audio and their embedders
_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                   "model.embed_audio.", "vision_tower.", "audio_tower.")


def _layer_shape(text, i: int, layer_type: str) -> tuple[int, int]:
    """``(head_dim, num_kv_heads)`` of layer ``i`` (HF's ``per_layer_config``; the global
    fields where a config lacks it)."""
    per = getattr(text, "per_layer_config", None)
    if per is not None:
        lc = per[i]
        return int(lc.head_dim), int(lc.num_key_value_heads)
    if layer_type == SLIDING_TYPE:
        return int(text.head_dim), int(text.num_key_value_heads)
    heads = getattr(text, "num_global_key_value_heads", None) \
        if getattr(text, "attention_k_eq_v", False) else None
    return int(getattr(text, "global_head_dim", None) or text.head_dim), \
        int(heads or text.num_key_value_heads)


def kv_sources(text) -> list[int | None]:
    """Per layer, the layer whose K/V it reads (HF ``reuse`` layers: the last earlier
    ``store`` layer of the same type), None for a layer with its own.

    Raises:
        ValueError: every layer shares (nothing computes the K/V).
    """
    n = text.num_hidden_layers
    shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
    if shared >= n:
        raise ValueError(f"Gemma4: num_kv_shared_layers {shared} leaves no layer computing K/V")
    types = list(text.layer_types)
    first = n - shared
    last_of = {t: max(i for i in range(first) if types[i] == t) for t in set(types[:first])}
    return [None if i < first else last_of[types[i]] for i in range(n)]


def _rope(text, layer_type: str) -> tuple[float, dict]:
    """``(base, parameters)`` of a layer type's rotary (``rope_parameters[type]``)."""
    params = dict((getattr(text, "rope_parameters", None) or {}).get(layer_type) or {})
    params["rope_type"] = params.get("rope_type") or "default"
    return float(params.get("rope_theta", 10000.0)), params


class Gemma4Model(nn.Module):
    """Embedding (scaled), per-layer inputs, the decoder layers, final norm, one rotary table
    per layer type.

    The per-layer inputs (PLE, when ``hidden_size_per_layer_input`` P > 0): for each token
    one P-wide input per layer, ``(norm(W x / sqrt(H)) + E_ple[id] * sqrt(P)) / sqrt(2)``
    with ``x`` the scaled token embedding; parameters (HF's names) ``embed_tokens_per_layer``
    [V_ple, L*P] (split by vocabulary rows under tensor parallelism),
    ``per_layer_model_projection`` [L*P, H], ``per_layer_projection_norm`` [P].

    Args:
        config: the model's shape; text: the HF text config; specs: one per layer.
        dtype: parameter dtype.
    """

    def __init__(self, config: ModelConfig, text, specs: list[LayerSpec], dtype: torch.dtype):
        super().__init__()
        self.config_hidden = h = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, h, dtype)
        self.embed_scale = embedding_scale(h, dtype)
        self.ple_size = ple = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)
        n = config.num_layers
        if ple:
            self.embed_tokens_per_layer = VocabEmbedding(
                int(getattr(text, "vocab_size_per_layer_input", None) or config.vocab_size),
                n * ple, dtype)
            self.ple_embed_scale = embedding_scale(ple, dtype)
            self.per_layer_model_projection = ReplicatedLinear(h, n * ple, False, dtype)
            self.per_layer_projection_norm = RMSNorm(ple, config.rms_norm_eps, dtype)
        wide = bool(getattr(text, "use_double_wide_mlp", False))
        moe = (int(text.num_experts), int(text.top_k_experts), int(text.moe_intermediate_size)) \
            if getattr(text, "enable_moe_block", False) else None
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, s, i, dtype, config.intermediate_size
                               * (2 if wide and s.kv_source_layer is not None else 1), ple, moe)
            for i, s in enumerate(specs))
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype)
        tables: dict[tuple, RotaryEmbedding] = {}
        ropes = []
        for layer_type, spec in zip(text.layer_types, specs):
            base, params = _rope(text, layer_type)
            key = (layer_type, spec.head_dim)
            if key not in tables:
                tables[key] = RotaryEmbedding(spec.head_dim, config.max_position_embeddings,
                                              base, params)
            ropes.append(tables[key])
        self.rotary_embs = nn.ModuleList(tables.values())
        self.layer_ropes = tuple(ropes)
        #: the step's per-layer inputs [T, L, P] between pieces (eager piecewise runs)
        self._ple: torch.Tensor | None = None

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [T] -> (scaled embeddings [T, H], per-layer inputs [T, L, P] or None)."""
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        if not self.ple_size:
            return hidden, None
        t, n, p = input_ids.shape[0], len(self.layers), self.ple_size
        tokens = self.embed_tokens_per_layer(input_ids) * self.ple_embed_scale
        proj = self.per_layer_model_projection(hidden) * self.config_hidden ** -0.5
        proj = self.per_layer_projection_norm(proj.view(t, n, p))
        return hidden, (proj + tokens.view(t, n, p)) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final normed hidden states [T, hidden]."""
        hidden, ple = self.embed(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, self.layer_ropes[i], positions, fb,
                                     None if ple is None else ple[:, i])
        return self.norm(hidden, residual)[0]

    def piece(self, i: int, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
              attn_out: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """Piece ``i`` of the forward (:meth:`engine.models.base.CausalLM.piece`); the
        per-layer inputs of piece 0 are kept on the model for the later pieces (eager use:
        the piecewise graphs are not captured for this family)."""
        if i == 0:
            (hidden, self._ple), residual = self.embed(input_ids), None
        else:
            ple = None if self._ple is None else self._ple[:, i - 1]
            hidden, residual = self.layers[i - 1].post_attn(attn_out, residual, ple)
        if i == len(self.layers):
            return self.norm(hidden, residual)[0]
        return self.layers[i].pre_attn(hidden, residual, self.layer_ropes[i], positions)


class Gemma4ForCausalLM(GemmaForCausalLM):
    """Gemma 4's text decoder (module docstring).

    Raises:
        NotImplementedError: bidirectional attention (one line).
        ValueError: every layer sharing K/V.
    """

    family = "Gemma4"
    skipped_prefixes = _TOWER_PREFIXES
    #: the piecewise graphs' one q/k/v buffer does not fit per-layer head sizes
    supports_piecewise_graphs = False
    lora_refusal = "LoRA adapters are not supported yet (its KV-sharing layers project q only)"
    eagle_refusal = "EAGLE heads are not supported yet (no hidden-state hook)"

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        text = text_config(config)
        if getattr(text, "use_bidirectional_attention", None) == "all":
            raise NotImplementedError("Gemma4: use_bidirectional_attention='all' is not "
                                      "supported (ferry's attention is causal)")
        self.kv_sources = kv_sources(text)
        super().__init__(config, dtype)

    def _build_model(self, mc: ModelConfig, dtype: torch.dtype) -> Gemma4Model:
        return Gemma4Model(mc, text_config(self.config), self.layer_specs(), dtype)

    def set_capture_hidden(self, mode: str | None) -> None:
        """Refused for any mode but None (no EAGLE hook on this family yet).

        Raises:
            NotImplementedError: a mode other than None.
        """
        if mode is not None:
            raise NotImplementedError("Gemma4 does not expose hidden states for EAGLE heads yet")
        self.capture_hidden = None

    def layer_specs(self) -> list[LayerSpec]:
        """Per layer: SLIDING (window ``sliding_window``) or FULL, the layer's head size and
        K/V heads, scale 1, its type's rotary, and ``kv_source_layer`` on the KV-sharing
        layers."""
        text = text_config(self.config)
        window = int(text.sliding_window)
        specs = []
        for i, (layer_type, src) in enumerate(zip(text.layer_types, self.kv_sources)):
            sliding = layer_type == SLIDING_TYPE
            d, heads = _layer_shape(text, i, layer_type)
            base, params = _rope(text, layer_type)
            specs.append(LayerSpec(
                attention=AttentionKind.SLIDING if sliding else AttentionKind.FULL,
                cache=CacheKind.PAGED_KV, head_dim=d, v_head_dim=d, num_kv_heads=heads,
                sliding_window=window if sliding else None, scale=1.0,
                rotary=RotarySpec(kind=params["rope_type"], base=base,
                                  partial_factor=float(params.get("partial_rotary_factor",
                                                                  1.0))),
                kv_source_layer=src))
        return specs

    # ---- weights -------------------------------------------------------------------------

    def _k_eq_v(self, layer: int) -> bool:
        text = text_config(self.config)
        return bool(getattr(text, "attention_k_eq_v", False)) \
            and text.layer_types[layer] != SLIDING_TYPE and self.kv_sources[layer] is None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`GemmaForCausalLM.load_weights` (multimodal prefixes, towers skipped),
        with ``k_proj`` also loaded as the ``v_proj`` of the global layers of an
        ``attention_k_eq_v`` model (their checkpoint has none), and the MoE variant's
        stacked experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
        [E, H, I]) into each layer's :class:`engine.layers.moe.FusedMoE`.

        Raises:
            ValueError: a tensor of the wrong shape.
        """
        experts: set[str] = set()

        def split():
            for name, tensor in weights:
                if name.endswith(_EXPERT_NAMES) and ".layers." in name:
                    experts.add(self._load_experts(name, tensor))
                    continue
                yield name, tensor
                if ".self_attn.k_proj." in name and self._k_eq_v(_layer_of(name)):
                    yield name.replace(".k_proj.", ".v_proj."), tensor

        return super().load_weights(split()) | experts

    def _load_experts(self, name: str, tensor) -> str:
        """One layer's stacked expert tensor (HF layout) -> its key in
        :meth:`expected_weights`."""
        i = _layer_of(name)
        moe = self.model.layers[i].experts
        gate_up = name.endswith(_EXPERT_NAMES[0])
        for e in range(moe.num_experts):
            t = tensor.narrow(0, e, 1)[0]   # a lazy (tensor-parallel) tensor reads one expert
            if gate_up:
                half = t.shape[0] // 2
                moe.weight_loader(moe.w13_weight, t.narrow(0, 0, half), e, "gate")
                moe.weight_loader(moe.w13_weight, t.narrow(0, half, half), e, "up")
            else:
                moe.weight_loader(moe.w2_weight, t, e, "down")
        return f"model.layers.{i}.experts.{'w13_weight' if gate_up else 'w2_weight'}"

    def hf_weight_names(self) -> list[str]:
        """The checkpoint's names: those of the model's parameters (the experts' under
        HF's stacked names), less the ``v_proj`` of ``attention_k_eq_v`` global layers
        (loaded from ``k_proj``)."""
        names = []
        for n in super().hf_weight_names():
            if ".self_attn.v_proj." in n and self._k_eq_v(_layer_of(n)):
                continue
            names.append(n.replace(".experts.w13_weight", ".experts.gate_up_proj")
                         .replace(".experts.w2_weight", ".experts.down_proj"))
        return names

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        """The full shape of checkpoint tensor ``name``: the per-layer head sizes, the wide
        MLPs, the per-layer input tensors."""
        mc, text = self.model_config, text_config(self.config)
        h, n = mc.hidden_size, mc.num_layers
        p = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)
        top = {"model.embed_tokens_per_layer.weight":
               (int(getattr(text, "vocab_size_per_layer_input", None) or mc.vocab_size), n * p),
               "model.per_layer_model_projection.weight": (n * p, h),
               "model.per_layer_projection_norm.weight": (p,)}
        if name in top:
            return top[name]
        if ".layers." not in name:
            return super()._hf_weight_shape(name)
        i = _layer_of(name)
        kind = name.split(".")[-2]
        if name.endswith(".layer_scalar"):
            return (1,)
        if kind == "experts" or kind == "router" or ".router." in name:
            return self._moe_shape(name)
        if "layernorm" in kind:
            return (h,)
        if kind == "per_layer_input_gate":
            return (p, h)
        if kind == "per_layer_projection":
            return (h, p)
        d, heads = _layer_shape(text, i, text.layer_types[i])
        rows = {"q_proj": mc.num_heads * d, "k_proj": heads * d, "v_proj": heads * d}
        if kind in rows:
            return (rows[kind], h)
        if kind in ("q_norm", "k_norm"):
            return (d,)
        if kind == "o_proj":
            return (h, mc.num_heads * d)
        wide = bool(getattr(text, "use_double_wide_mlp", False)) \
            and self.kv_sources[i] is not None
        return super()._hf_weight_shape(name, mc.intermediate_size * (2 if wide else 1))


    def _moe_shape(self, name: str) -> tuple[int, ...]:
        """The full shape of an MoE checkpoint tensor (experts, router)."""
        text, h = text_config(self.config), self.model_config.hidden_size
        e, i = int(text.num_experts), int(text.moe_intermediate_size)
        shapes = {".experts.gate_up_proj": (e, 2 * i, h), ".experts.down_proj": (e, h, i),
                  ".router.proj.weight": (e, h), ".router.scale": (h,),
                  ".router.per_expert_scale": (e,)}
        return next(v for k, v in shapes.items() if name.endswith(k))


#: the MoE variant's stacked expert tensors (HF names)
_EXPERT_NAMES = (".experts.gate_up_proj", ".experts.down_proj")


def _layer_of(name: str) -> int:
    """The layer index in a checkpoint name ``...layers.<i>....``."""
    return int(name.split(".layers.")[1].split(".")[0])


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """A multimodal Gemma 4 checkpoint served as its language model (the vision and audio
    towers are skipped at load time)."""
