"""Mixture-of-experts MLP: a router, stacked expert weights, an optional shared expert.

:class:`SparseMoeBlock` is the MLP of an MoE decoder layer (Qwen2/Qwen3-MoE, Mixtral,
OLMoE)::

    router_logits = gate(x)                           # [T, E], replicated linear H -> E
    topk_weights, topk_ids = select_experts(router_logits, top_k, renormalize)
    out = fused_moe(x, w13_weight, w2_weight, topk_weights, topk_ids)
    out += sigmoid(shared_expert_gate(x)) * shared_expert(x)      # Qwen2-MoE only
    out = all_reduce(out)                                          # tensor parallelism

With a gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE) the loader folds the gate's
one row into the router (:func:`fold_shared_gates`, after the weights load): one GEMM
``x @ [gate; shared_expert_gate; 0...]^T`` gives the E router logits and the gate logit
(the router reads the first E columns as a strided view), and
``addcmul(out, sigmoid(logit), shared)`` scales and adds the shared expert: two launches
instead of the gate's GEMV (cuBLAS: two kernels at N = 1), sigmoid, multiply and add.
``FERRY_MOE_FOLD_SHARED_GATE=0`` keeps them apart.

``select_experts`` is softmax over all experts in fp32, top-k, and (``renormalize``, HF's
``norm_topk_prob``; always for Mixtral) division by the top-k sum, as in transformers'
``*TopKRouter``. The router's matmul runs in the model dtype (as in transformers) and its
logits are upcast to fp32 inside the routing (the Triton router reads them as they are: no
separate cast launch).

Expert parameters (:class:`FusedMoE`), this rank's part of every expert:

    w13_weight [E, 2 * I_local, H]   rows [0, I_local): gate (w1), [I_local, 2 I_local): up (w3)
    w2_weight  [E, H, I_local]       down (w2)

with ``I_local = moe_intermediate_size / tp_size``: tensor parallelism splits each expert's
intermediate dimension (Megatron-style, like the dense MLP: gate/up column-parallel, down
row-parallel), so every rank runs every expert on every token and the outputs are partial
sums. The block all-reduces once, after adding the shared expert's partial output (its
``down_proj`` is built with ``reduce_results=False``), so an MoE layer costs one all-reduce
like a dense one.

Expert parallelism (``--ep-size N``, equal to ``--tp-size``; :mod:`engine.layers.moe_ep`)
instead gives rank ``r`` the experts ``[r E/N, (r+1) E/N)`` whole: ``w13_weight
[E/N, 2I, H]``, ``w2_weight [E/N, H, I]``; routing over all E experts is unchanged, the pairs
of other ranks' experts are skipped (sentinel id -1), and the same single all-reduce sums
the ranks' partial outputs (the shared expert stays TP-split).

The experts' computation is :class:`FusedMoE`'s ``impl``, which
:func:`engine.layers.select_ops` sets like the small ops' (``engine.device.use_triton``
decides): the Triton :func:`kernels.moe.fused_moe.fused_moe` on GPUs (through
:func:`triton_fused_moe`, which passes the device's name for its tuned-config table; no host
sync, so the block runs inside captured graphs), and
:func:`kernels.moe.reference.fused_moe_torch` on the CPU and under ``--disable-fused-ops``
(it syncs with the host: a GPU model with ``--disable-fused-ops`` must also run without
graphs).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import all_reduce, get_tp
from engine.layers.linear import ReplicatedLinear, full_tensor, linear
from engine.layers.moe_ep import check_ep, current_ep_size, localize_topk
from engine.layers.moe_fp8 import Fp8BlockExperts
from engine.layers.quantization import quantization_scope
from kernels.moe.reference import fused_moe_torch, select_experts

#: HF checkpoint part -> :meth:`FusedMoE.weight_loader` shard id
EXPERT_SHARDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                 "w1": "gate", "w3": "up", "w2": "down"}


@dataclass(frozen=True)
class ExpertOptions:
    """gpt-oss's expert switches (the defaults: plain SwiGLU experts without bias).

    Attributes:
        bias: ``w13_bias [E, 2I_local]`` and ``w2_bias [E, H]`` (the down bias is added on
            one rank per expert under tensor parallelism).
        activation: ``"silu"``, ``"gelu_tanh"`` (Gemma 4's GeGLU experts) or
            ``"swiglu_oai"`` (the clamped SwiGLU,
            :func:`kernels.moe.reference.swiglu_oai`).
        swiglu_alpha, swiglu_limit: its constants.
        mxfp4: the weights stay MXFP4 (:mod:`kernels.moe.mxfp4`): ``w13_weight`` /
            ``w2_weight`` hold the uint8 blocks ``[E, 2I_local, H/32, 16]`` /
            ``[E, H, I_local/32, 16]`` and ``w13_scales`` / ``w2_scales`` their e8m0 scales.
        fp8_block: ``(bn, bk)``: block-wise FP8 experts (:mod:`engine.layers.moe_fp8`: e4m3
            weights and ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``); with
            ``fp8_checkpoint`` False float expert tensors are quantized as they load.
    """

    bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False
    fp8_block: tuple[int, int] | None = None
    fp8_checkpoint: bool = True


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FusedMoE(nn.Module):
    #: the block-FP8 expert state (:class:`engine.layers.moe_fp8.Fp8BlockExperts`) or None
    fp8_experts = None

    """The routed experts of one layer, stacked (see the module docstring for the layout).

    Args:
        num_experts: E (all experts, over every rank).
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: one expert's full width I (split over the ranks unless
            ``ep_size > 1``).
        renormalize: divide the top-k routing weights by their sum.
        dtype: parameter dtype.
        tp_size, tp_rank: the tensor-parallel group (default: :func:`get_tp`'s).
        ep_size: 1 (tensor parallelism over I) or ``tp_size`` (this rank holds
            ``E / ep_size`` whole experts, from expert ``tp_rank * E / ep_size``); default
            :func:`engine.layers.moe_ep.current_ep_size`.
        options: the gpt-oss options (:class:`ExpertOptions`; default: none of them).

    Raises:
        ValueError: I not divisible by ``tp_size`` (without expert parallelism; with MXFP4
            weights ``I / tp_size`` must be a multiple of 32), ``top_k`` outside ``[1, E]``,
            or an ``ep_size`` that is neither 1 nor ``tp_size`` or does not divide E.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, tp_size: int | None = None,
                 tp_rank: int | None = None, ep_size: int | None = None,
                 options: ExpertOptions | None = None):
        super().__init__()
        g = get_tp()
        self.tp_size = g.size if tp_size is None else tp_size
        self.tp_rank = g.rank if tp_rank is None else tp_rank
        self.ep_size = current_ep_size() if ep_size is None else ep_size
        check_ep(num_experts, self.ep_size, self.tp_size)
        #: ranks that split each expert's intermediate dimension (1 under expert parallelism)
        self.i_split = 1 if self.ep_size > 1 else self.tp_size
        if intermediate_size % self.i_split:
            raise ValueError(f"the experts' intermediate size {intermediate_size} is not "
                             f"divisible by --tp-size {self.tp_size}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        #: global id of this rank's first expert (0 without expert parallelism)
        self.first_expert = self.tp_rank * self.num_local_experts if self.ep_size > 1 else 0
        self.top_k = top_k
        self.renormalize = renormalize
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        i_local = intermediate_size // self.i_split
        e_local = self.num_local_experts
        self.options = opts = options or ExpertOptions()
        if opts.mxfp4:
            if i_local % 32 or hidden_size % 32:
                raise ValueError(f"MXFP4 experts need hidden size {hidden_size} and the "
                                 f"per-rank intermediate size {i_local} multiples of 32")
            u8 = torch.uint8
            self.w13_weight = _param(torch.empty(e_local, 2 * i_local, hidden_size // 32, 16,
                                                 dtype=u8))
            self.w13_scales = _param(torch.empty(e_local, 2 * i_local, hidden_size // 32,
                                                 dtype=u8))
            self.w2_weight = _param(torch.empty(e_local, hidden_size, i_local // 32, 16,
                                                dtype=u8))
            self.w2_scales = _param(torch.empty(e_local, hidden_size, i_local // 32, dtype=u8))
        elif opts.fp8_block:
            self.fp8_experts = Fp8BlockExperts(self, opts.fp8_block, opts.fp8_checkpoint, dtype)
        else:
            self.w13_weight = _param(torch.empty(e_local, 2 * i_local, hidden_size,
                                                 dtype=dtype))
            self.w2_weight = _param(torch.empty(e_local, hidden_size, i_local, dtype=dtype))
            self.w13_weight.weight_loader = self.weight_loader
            self.w2_weight.weight_loader = self.weight_loader
        if opts.bias:
            self.w13_bias = _param(torch.empty(e_local, 2 * i_local, dtype=dtype))
            self.w2_bias = _param(torch.empty(e_local, hidden_size, dtype=dtype))
        self.impl = fused_moe_torch

    def _extras(self) -> dict:
        """The keyword arguments of the options for ``impl`` (none by default)."""
        o = self.options
        extras = {}
        if o.bias:
            # the down bias once per pair: on the rank that holds the expert (EP), on rank 0
            # of the ranks that split it (TP: the outputs are partial sums)
            extras["w13_bias"] = self.w13_bias
            extras["w2_bias"] = self.w2_bias if self.ep_size > 1 or self.tp_rank == 0 else None
        if o.activation != "silu":
            extras.update(activation=o.activation, swiglu_alpha=o.swiglu_alpha,
                          swiglu_limit=o.swiglu_limit)
        if o.mxfp4:
            extras.update(w13_scales=self.w13_scales, w2_scales=self.w2_scales)
        return extras

    def expert_bytes(self) -> int:
        """Bytes of this rank's expert weights (MXFP4: 4.25 bits a weight), biases included."""
        return sum(p.numel() * p.element_size() for n, p in self.named_parameters()
                   if n.startswith(("w13_", "w2_")))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] any float dtype (all experts; upcast to fp32 by
        the routing) -> [T, H] in x's dtype: this rank's partial sum (all-reduced by the
        caller)."""
        route_and_run = getattr(self.impl, "route_and_run", None)
        if route_and_run is not None and self.ep_size == 1 and self.fp8_experts is None:
            # the Triton impl: at decode sizes its kernels route for themselves
            return route_and_run(x, self.w13_weight, self.w2_weight, router_logits,
                                 self.top_k, self.renormalize, **self._extras())
        # the Triton impl brings its one-launch router (kernels.moe.routing.fused_topk)
        route = getattr(self.impl, "router", select_experts)
        topk_weights, topk_ids = route(router_logits, self.top_k, self.renormalize)
        return self.run_routed(x, topk_weights, topk_ids)

    def run_routed(self, x: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] with its chosen experts (``topk_ids`` [T, K] int32, global ids) and
        their fp32 weights [T, K] -> [T, H]: this rank's partial sum (a family with its own
        routing, DeepSeek's grouped top-k, calls this)."""
        if self.ep_size > 1:
            topk_weights, topk_ids = localize_topk(topk_weights, topk_ids, self.first_expert,
                                                   self.num_local_experts)
        if self.fp8_experts is not None:
            return self.fp8_experts.run(self, x, topk_weights, topk_ids,
                                        _device_name(x.device.type)
                                        if x.device.type != "cpu" else None)
        return self.impl(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                         **self._extras())

    def weight_loader(self, param: nn.Parameter, loaded, expert_id: int, shard_id: str) -> None:
        """Load one Hub per-expert tensor: ``gate`` ([I, H]) and ``up`` ([I, H]) into the
        gate/up rows of ``w13_weight[expert_id]``, ``down`` ([H, I]) into
        ``w2_weight[expert_id]``; this rank's slice of I only (``loaded`` may be a lazy
        safetensors slice). Under expert parallelism another rank's expert is skipped
        (nothing is read) and a local one is loaded whole.

        Raises:
            ValueError: a bad expert id or shard id, or a tensor of the wrong shape.
        """
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} is outside [0, {self.num_experts})")
        full_i, h = self.intermediate_size, self.hidden_size
        n = full_i // self.i_split
        local = expert_id - self.first_expert
        if shard_id in ("gate", "up"):
            want, dim, param_of = (full_i, h), 0, self.w13_weight
        elif shard_id == "down":
            want, dim, param_of = (h, full_i), 1, self.w2_weight
        else:
            raise ValueError(f"expert shard id must be 'gate', 'up' or 'down', got {shard_id!r}")
        if param is not param_of:
            raise ValueError(f"expert shard {shard_id!r} does not load into this parameter")
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {shard_id} tensor has shape {tuple(loaded.shape)}, "
                             f"expected {want}")
        if not 0 <= local < self.num_local_experts:
            return                                   # another rank's expert
        dst = param_of.data[local]
        if shard_id != "down":
            dst = dst.narrow(0, 0 if shard_id == "gate" else n, n)
        part = loaded.narrow(dim, self.tp_rank * n, n) if self.i_split > 1 else loaded
        dst.copy_(full_tensor(part))


#: the folded router weight's rows are padded to a multiple of this (the logits' row
#: stride stays 16-byte aligned in 16-bit dtypes)
FOLD_ROW_ALIGN = 8


def fold_enabled() -> bool:
    """Whether :func:`fold_shared_gates` folds (``FERRY_MOE_FOLD_SHARED_GATE``, default on;
    ``0`` keeps the shared expert's gate a GEMM of its own)."""
    return os.environ.get("FERRY_MOE_FOLD_SHARED_GATE", "1") != "0"


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ an optional shared expert), one all-reduce.

    Args:
        hidden_size, num_experts, top_k, intermediate_size, renormalize, dtype: as
            :class:`FusedMoE`.
        shared_expert: a module x [T, H] -> [T, H] whose output is a per-rank partial sum
            (an MLP whose down projection has ``reduce_results=False``), or None.
        shared_expert_gate: scale the shared expert by ``sigmoid(x @ w^T)`` (a replicated
            linear H -> 1, Qwen2-MoE's ``shared_expert_gate``).
        router_bias: a bias on the router (gpt-oss).
        options: the experts' :class:`ExpertOptions`.

    Parameter names follow transformers: ``gate`` (the router), ``experts.w13_weight`` /
    ``experts.w2_weight``, ``shared_expert.*``, ``shared_expert_gate``.

    After :meth:`fold_shared_gate` (called by the loader through :func:`fold_shared_gates`)
    the router and the shared gate are one GEMM; the two parameters stay (as views of the
    folded weight, so a later in-place load still lands in it).
    """

    #: ``[E_pad, H]``: the router's E rows, the shared gate's row, zero rows up to a
    #: multiple of :data:`FOLD_ROW_ALIGN`; None while unfolded
    router_gate_weight: torch.Tensor | None = None

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, shared_expert: nn.Module | None = None,
                 shared_expert_gate: bool = False, router_bias: bool = False,
                 options: ExpertOptions | None = None):
        super().__init__()
        with quantization_scope(None):   # the router stays in the run dtype
            self.gate = ReplicatedLinear(hidden_size, num_experts, router_bias, dtype)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size,
                                renormalize, dtype, options=options)
        self.tp_size = self.experts.tp_size
        self.shared_expert = shared_expert
        with quantization_scope(None):
            self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, False, dtype)
                                       if shared_expert is not None and shared_expert_gate
                                       else None)

    def fold_shared_gate(self) -> bool:
        """Fold the shared gate's row into the router (once its weights are loaded): one
        ``[E_pad, H]`` weight (:attr:`router_gate_weight`) whose GEMM gives the E router
        logits and the gate logit; ``gate.weight`` and ``shared_expert_gate.weight`` become
        views of it (rows ``[0, E)`` and ``E``) and are no longer CPU-packable.

        The old path stays (returns False, nothing changes) without a shared gate, with a
        router bias, a quantized (non-float) or oneDNN-packed router or gate, or the two in
        different dtypes or devices. Tensor and expert parallelism fold as they are (both
        linears are replicated; the routing reads all E logits on every rank).

        Returns:
            whether the block is folded (True again on a folded block).
        """
        gate, seg = self.gate, self.shared_expert_gate
        if self.router_gate_weight is not None:
            return True
        if seg is None or gate.bias is not None or gate.quant_method is not None \
                or seg.quant_method is not None:
            return False
        w, s = gate.weight, seg.weight
        if w.is_mkldnn or s.is_mkldnn or w.dtype != s.dtype or w.device != s.device \
                or not w.dtype.is_floating_point:
            return False
        e, h = w.shape
        rows = -(-(e + 1) // FOLD_ROW_ALIGN) * FOLD_ROW_ALIGN
        fused = torch.zeros(rows, h, dtype=w.dtype, device=w.device)
        fused[:e].copy_(w.data)
        fused[e:e + 1].copy_(s.data)
        w.data = fused[:e]
        s.data = fused[e:e + 1]
        gate.packable = seg.packable = False   # the views must stay views
        self.router_gate_weight = fused
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] (summed over the ranks)."""
        fused = self.router_gate_weight
        if fused is not None and self.gate.lora is None and self.shared_expert_gate.lora is None:
            e = self.experts.num_experts
            logits = linear(x, fused)                              # [T, E_pad]
            out = self.experts(x, logits[:, :e])                   # a strided [T, E] view
            out = torch.addcmul(out, torch.sigmoid(logits[:, e:e + 1]), self.shared_expert(x))
        else:
            out = self.experts(x, self.gate(x))
            if self.shared_expert is not None:
                shared = self.shared_expert(x)
                if self.shared_expert_gate is not None:
                    shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
                out = out + shared
        return all_reduce(out) if self.tp_size > 1 else out


def fold_shared_gates(model: nn.Module) -> int:
    """:meth:`SparseMoeBlock.fold_shared_gate` on every MoE block of a loaded ``model`` (the
    loader calls it after the weights load), unless ``FERRY_MOE_FOLD_SHARED_GATE=0``.

    Returns:
        the number of blocks folded.
    """
    if not fold_enabled():
        return 0
    return sum(m.fold_shared_gate() for m in model.modules()
               if isinstance(m, SparseMoeBlock) and m.shared_expert_gate is not None)


def triton_fused_moe():
    """:func:`kernels.moe.fused_moe.fused_moe` (imported here: it needs Triton) as a ``FusedMoE``
    ``impl``: the same arguments as :func:`kernels.moe.reference.fused_moe_torch`, plus the
    device's name for the tuned launch-config table (looked up once per device type; with
    gpt-oss's options, :func:`kernels.moe.fused_moe_mxfp4.fused_moe_oai`), its
    ``router``: :func:`kernels.moe.routing.fused_topk`, the routing in one launch, and its
    ``route_and_run``: routing and experts from the router logits, which at decode sizes
    (``kernels.moe.fused_moe_decode.use_decode_path``; plain SwiGLU experts, no expert
    parallelism) is :func:`kernels.moe.fused_moe_decode.fused_moe_decode_routed`: two
    launches for the whole layer after the router GEMM; MXFP4 experts (gpt-oss) at
    ``M <= kernels.moe.fused_moe_mxfp4_gemv.GEMV_MAX_M`` take
    :func:`kernels.moe.fused_moe_mxfp4_gemv.fused_moe_oai_gemv_routed`, likewise two
    (``gemv_self_routes``; else ``fused_topk`` and the GEMV path, three)."""
    from kernels.moe.fused_moe import fused_moe
    from kernels.moe.fused_moe_decode import fused_moe_decode_routed, use_decode_path
    from kernels.moe.fused_moe_mxfp4_gemv import fused_moe_oai_gemv_routed, gemv_self_routes
    from kernels.moe.routing import fused_topk

    def run(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, **extras) -> torch.Tensor:
        if extras:  # gpt-oss's biases, clamped SwiGLU, MXFP4 weights
            from kernels.moe.fused_moe_mxfp4 import fused_moe_oai

            return fused_moe_oai(x, w13, w2, topk_weights, topk_ids, **extras,
                                 device_name=_device_name(x.device.type))
        return fused_moe(x, w13, w2, topk_weights, topk_ids,
                         device_name=_device_name(x.device.type))

    def route_and_run(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      router_logits: torch.Tensor, top_k: int, renormalize: bool,
                      **extras) -> torch.Tensor:
        if not extras and use_decode_path(x.shape[0]):
            return fused_moe_decode_routed(x, w13, w2, router_logits, top_k, renormalize)
        if extras.get("w13_scales") is not None and gemv_self_routes(x.shape[0]):
            return fused_moe_oai_gemv_routed(x, w13, w2, router_logits, top_k, renormalize,
                                             **extras)
        weights, ids = fused_topk(router_logits, top_k, renormalize)
        return run(x, w13, w2, weights, ids, **extras)

    run.router = fused_topk  # select_experts in one launch, for FusedMoE.forward
    run.route_and_run = route_and_run  # routing + experts: two launches at decode sizes
    return run


@functools.cache
def _device_name(device_type: str) -> str:
    from engine import device as devmod

    return devmod.device_name(device_type)
