"""Multi-token prediction (``--speculative-algorithm MTP``, SGLang's ``NEXTN``): the target
checkpoint's own MTP layer drafts, on the EAGLE machinery (:class:`EagleProposer`).

An MTP layer reads, for position j, the target's final normed hidden state of position j
and the embedding of token j + 1, and predicts token j + 2 (DeepSeek-V3 report, section
2.2): ``x = proj(concat(norm_e(embed(token)), norm_h(hidden)))``, one full decoder layer
of the target's kind, a final norm, the target's LM head. Its normed output is both what
the LM head reads and the ``hidden`` of the next draft step, so one layer drafts a chain
of ``--speculative-num-steps`` tokens (as SGLang reuses it). Embedding and LM head are the
target's (the checkpoints' copies of them are the same tensors).

The checkpoint layouts (DeepSeek-V3's ``model.layers.{L}.``, Qwen3-Next's and Qwen3.5's
``mtp.``) are in ``engine/models/mtp.py``; DeepSeek's input norms are RMSNorms, Qwen's
zero-centred (1 + w) RMSNorms.

The decoder layer and its final norm are built and loaded as a one-layer model of the
target's own class (:func:`load_mtp_head`: the target's config cut to that layer, the
checkpoint's tensors renamed onto it through ``load_model``'s ``weight_map``, so expert
stacking, block-FP8 and dummy weights work as for the target); its own KV (a latent pool
for MLA) lives in the proposer's pool, its attention in a backend built for its layer.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.args import ServerArgs
from engine.models.mtp import (
    MTP_INPUT_NAMES,
    mini_config,
    mtp_layer_is_moe,
    mtp_layout,
    mtp_refusal,
    mtp_weight_map,
)
from engine.speculative.draft import draft_pool_tokens
from engine.speculative.eagle import EagleProposer

logger = logging.getLogger(__name__)


class MtpHead(nn.Module):
    """The MTP layer as an EAGLE head (``forward``/``greedy`` as :class:`EagleHead`).

    Args:
        mini: the one-layer model of the target's class holding the MTP decoder layer
            (``model.layers[0]``) and its final norm (``model.norm``).
        style: the layout (``"deepseek"``: RMSNorm inputs, a DeepSeek layer; ``"qwen3_next"``:
            (1 + w) RMSNorms, a hybrid full-attention layer).
        target: the target model (its embedding and LM head).
        dtype: the run dtype.
    """

    eagle3 = False

    def __init__(self, mini, style: str, target, dtype: torch.dtype):
        super().__init__()
        from engine.layers.linear import ReplicatedLinear
        from engine.layers.norm import GemmaRMSNorm, RMSNorm

        mc = target.model_config
        h = mc.hidden_size
        norm = RMSNorm if style == "deepseek" else GemmaRMSNorm
        with torch.device(next(mini.parameters()).device):
            self.norm_embed = norm(h, mc.rms_norm_eps, dtype)
            self.norm_hidden = norm(h, mc.rms_norm_eps, dtype)
            self.proj = ReplicatedLinear(2 * h, h, False, dtype)
        self.mini = mini
        self.style = style
        self.__dict__["target"] = target  # not a submodule: its weights are not the head's
        self.mc = mc
        self.hidden_size = h
        self.dtype = dtype
        self.num_layers = 1

    def load_inputs(self, own: dict) -> None:
        """The input norms and projection from ``own`` (checkpoint name -> tensor).

        Raises:
            ValueError: a missing tensor, or one of the wrong shape.
        """
        from engine.models.weights import check_fp8

        names = MTP_INPUT_NAMES[self.style]
        for name, mod in zip(names, (self.norm_embed, self.norm_hidden, self.proj)):
            t = own.get(f"{name}.weight")
            if t is None:
                raise ValueError(f"the MTP layer lacks {name}.weight")
            scale = own.get(f"{name}.weight_scale_inv")
            if scale is not None and t.dtype == torch.float8_e4m3fn:
                t = self._dequantize(t, scale)
            check_fp8(f"{name}.weight", mod.weight, t)
            if tuple(t.shape) != tuple(mod.weight.shape):
                raise ValueError(f"the MTP layer's {name}.weight is {tuple(t.shape)}, "
                                 f"expected {tuple(mod.weight.shape)}")
            mod.weight.data.copy_(t)

    def _dequantize(self, wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A block-FP8 checkpoint's e4m3 projection ``[N, K]`` with its per-block scales
        (``quantization_config.weight_block_size``, default 128 x 128) -> float32."""
        from kernels.fp8.reference import dequantize_weight_blocks

        qc = getattr(self.mini.config, "quantization_config", None) or {}
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        bn, bk = qc.get("weight_block_size") or (128, 128)
        return dequantize_weight_blocks(wq, scale, int(bk), int(bn))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                fb) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over T rows: input_ids [T] int64 (token j + 1 for row j), positions
        [T] int64, hidden [T, H] (the target's normed state of row j, or this head's output
        of the previous draft step) -> ``(for_logits, next_hidden)``, both the normed
        output [T, H]."""
        emb = self.target.model.embed_tokens(input_ids)
        x = self.proj(torch.cat([self.norm_embed(emb),
                                 self.norm_hidden(hidden.to(emb.dtype))], dim=-1))
        model = self.mini.model
        layer = model.layers[0]
        if self.style == "deepseek":
            x, residual = layer(x, None, positions, fb)
        else:
            x, residual = layer(x, None, model.rotary_emb, positions, fb)
        out = model.norm(x, residual)[0]
        return out, out

    def greedy(self, for_logits: torch.Tensor) -> torch.Tensor:
        """Rows [B, H] -> the greedy next token of each through the target's LM head [B]
        int64."""
        return torch.argmax(self.target.compute_logits(for_logits, None), dim=-1)


def load_mtp_head(args: ServerArgs, target) -> MtpHead:
    """Build and load the MTP head of the target runner's model.

    Raises:
        ValueError: as :func:`mtp_refusal` (one line), or a checkpoint tensor that does not
            fit.
    """
    from engine.layers import select_ops, small_ops_kind
    from engine.loader.loader import load_model
    from engine.loader.weights import hash_uniform

    model = target.model
    config = model.config
    path = args.speculative_draft_model_path or args.model_path
    dummy = args.load_format == "dummy"
    why = mtp_refusal(type(model), config, path, dummy)
    if why:
        raise ValueError(f"--speculative-algorithm MTP: {why}")
    layout = mtp_layout(type(model), config)
    moe = mtp_layer_is_moe(config)
    own: dict = {}
    mini, _ = load_model(path, "dummy" if dummy else "safetensors", dtype=target.dtype,
                         device=target.device, seed=args.seed + 1, config=mini_config(
                             config, layout, moe), progress=False,
                         quantization=args.quantization,
                         weight_map=mtp_weight_map(layout, model.model_config.hidden_size, own))
    head = MtpHead(mini, layout.style, model, target.dtype)
    if dummy:  # seeded inputs: ones for the norms, N(0, 0.02)-like for the projection
        for name, mod in zip(MTP_INPUT_NAMES[layout.style],
                             (head.norm_embed, head.norm_hidden, head.proj)):
            w = mod.weight
            own[f"{name}.weight"] = torch.ones_like(w) if "norm" in name else \
                hash_uniform(w.numel(), args.seed + len(name), w.device).mul_(0.035).view_as(w)
    head.load_inputs(own)
    if target.device_type == "cpu":  # oneDNN's blocked layout, as the runner packs the target's
        from engine.layers.linear import pack_cpu_weights

        pack_cpu_weights(head)
    select_ops(head, small_ops_kind(target.device_type, args.disable_fused_ops))
    logger.info("MTP head: %s layer %s* (%s), %s", type(model).__name__, layout.prefix,
                "MoE" if moe else "dense", "dummy weights" if dummy else path)
    return head.eval()


class MtpProposer(EagleProposer):
    """Greedy chains from the target checkpoint's MTP layer (:class:`MtpHead`), fed by the
    target's final normed hidden states like an EAGLE-1/2 head (:class:`EagleProposer`
    supplies the hidden-state bookkeeping, the draft KV and the chain).

    Args:
        args: the server arguments; target: the target's runner.
    Raises:
        ValueError: the model has no MTP layer (one line), or as :func:`load_mtp_head`.
    """

    def _load_head(self, args: ServerArgs, target) -> MtpHead:
        return load_mtp_head(args, target)

    def _head_kv(self, args: ServerArgs, target):
        """The MTP layer's own cache (a latent pool for an MLA layer) and a backend built for
        its layer."""
        from engine.attention import create_attention_backend
        from engine.kv.pool import build_kv_pool

        mini = self.head.mini
        specs = mini.layer_specs()
        pool = build_kv_pool(specs, draft_pool_tokens(args, target), args.page_size,
                             target.kv_dtype, target.device)
        d = mini.model_config.head_dim
        backend = create_attention_backend(
            target.attention_backend_name, mini.q_size // d, mini.kv_size // d, d,
            device_type=target.device_type, device=target.device,
            fused_ops=not args.disable_fused_ops, layer_specs=specs, kv_dtype=target.kv_dtype)
        return pool, backend

    def _log_head(self, args: ServerArgs) -> None:
        from engine.args import num_draft_tokens

        logger.info("MTP: a chain of %d draft token(s) per step from the checkpoint's MTP "
                    "layer", num_draft_tokens(args))
