"""AWQ, GPTQ and compressed-tensors 4-bit linear weights, kept 4-bit (W4A16 on GPUs, W4A32
on the CPU).

Checkpoint layouts (a linear weight is ``W [N, K]``, out x in; ``G`` the group size along K;
an int32 word holds 8 nibbles, nibble ``i`` in bits ``4i .. 4i+3``):

- **AWQ** (AutoAWQ's GEMM kernels; ``quant_method: awq``, ``version: gemm``): ``qweight
  [K, N/8]`` and ``qzeros [K/G, N/8]`` int32, packed along N in AWQ's interleaved order:
  nibble ``i`` of word ``j`` holds column ``8j + AWQ_PACK_ORDER[i]`` with
  ``AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)`` (AutoAWQ's ``pack``; vLLM's and SGLang's
  AWQ dequantizers undo it with the inverse order ``(0, 4, 1, 5, 2, 6, 3, 7)``);
  ``scales [K/G, N]`` fp16; ``W[n, k] = (q - z) * s`` of k's group.
- **GPTQ** (AutoGPTQ, GPTQModel, optimum; ``quant_method: gptq``, ``bits: 4``): ``qweight
  [K/8, N]`` int32 packed along K in order (nibble ``i`` of row ``r`` is ``k = 8r + i``),
  ``qzeros [K/G, N/8]`` packed along N in order, ``scales [K/G, N]``, ``g_idx [K]``.
  ``checkpoint_format: gptq`` (v1, the default) stores every zero minus one, so
  ``W = (q - (z + 1)) * s`` (vLLM's and exllama's GPTQ kernels add the 1 back;
  ``sym: true`` checkpoints store 7 for the zero 8); ``gptq_v2`` stores ``z`` itself.
  With ``desc_act: true`` (act-order) ``g_idx[k]`` is the group of input ``k`` in any
  order (every group ``G`` members); otherwise it must be ``k // G``.
- **compressed-tensors** ``format: pack-quantized`` (llm-compressor's W4A16; weights
  ``{type: int, num_bits: 4, strategy: group}``): ``weight_packed [N, K/8]`` int32 packed
  along K in order, each code stored as its signed value plus 8 (compressed-tensors'
  ``pack_to_int32``), ``weight_scale [N, K/G]``, ``weight_shape``, and for
  ``symmetric: false`` ``weight_zero_point [N/8, K/G]`` packed along N the same way (else
  the zero is 8); ``W = (q - z) * s`` on the stored codes; ``actorder: group`` adds
  ``weight_g_idx [K]`` (act-order, as GPTQ's).

Anything else (other ``bits``, ``group_size`` -1 or not a multiple of 32, AWQ's GEMV /
Marlin / exllama versions, ``zero_point: false``, GPTQ's ``dynamic`` per-module rules or the
old Marlin serialization) is a start-up error naming the field: the configs are parsed in
:mod:`engine.layers.quantization.int4_config`.

ferry's layout: at load every packed tensor is unpacked and transposed to rows of W, then
kept in :mod:`kernels.quant.reference`'s ``q4`` layout (uint8 nibbles ``[N, K/2]``) with
float32 ``weight_scale = s`` and ``weight_min = -s * z`` (``[N, K/G]``), so ``s * q + min``
is ``(q - z) * s`` exactly in fp32 (an fp16 or bf16 scale times an integer up to 16 has at
most 16 significant bits). The CPU's C++ kernels and the Triton kernel of the GGUF blocks run it
unchanged (:mod:`engine.layers.quantization.wq`). Bytes per weight: 4.5 bits (AWQ's own
files: 4.16); fp16 scales with a 4-bit zero would need a ``(q - z) * s`` kernel variant.

Act-order: the codes are stored with K sorted by group (a stable sort of ``g_idx``, so the
groups are contiguous again) and the layer gathers its activations in that order
(``wq_perm``, one ``index_select`` per matmul), as vLLM's GPTQ kernels do; fused q/k/v and
gate/up parts must share their ``g_idx`` (GPTQ derives it from the layer input, which they
share), and a row-parallel layer with act-order is refused at ``--tp-size`` above 1.

Every packed tensor is converted whole (one HF part), then the layer's own loader places it:
fused q/k/v and gate/up parts are rows of the fused weight, column-parallel ranks take rows
of N, row-parallel ranks take columns of K in whole groups (a ``--tp-size`` whose split of
K cuts a group is refused at start-up).

Quantized at load (``--quantization awq|gptq`` on a float checkpoint or dummy weights, or a
checkpoint config with ``--load-format dummy``): round-to-nearest per group of 128 (the
config's ``group_size`` when it has one; 64 or 32 in a layer whose K is not a multiple): ``awq`` asymmetric (AutoAWQ's
``pseudo_quantize_tensor`` without the activation-aware scale search: ``s = (max - min) /
15`` in fp16, ``z = round(-min / s)``), ``gptq`` symmetric (GPTQ's quantizer with
``sym``: ``s = 2 * amax / 15``, ``z = 8``), into the same layout: for benchmarks with dummy
weights, not a calibrated quantization.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.layers.quantization.wq import WeightOnlyMethod
from kernels.quant.reference import pack_q4, unpack_q4

logger = logging.getLogger(__name__)

#: nibble i of an AWQ word holds column 8j + AWQ_PACK_ORDER[i] of its 8
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: column c of an AWQ word is in nibble AWQ_UNPACK_ORDER[c]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
#: the group size of weights quantized at load when the config gives none
DEFAULT_GROUP = 128

_SHIFTS = tuple(range(0, 32, 4))


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., W]`` -> uint8 ``[..., W * 8]``: nibble ``i`` of word ``j`` at ``8j + i``."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device)
    q = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return q.to(torch.uint8).reshape(*words.shape[:-1], words.shape[-1] * 8)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """An AWQ ``qweight [K, N/8]`` or ``qzeros [K/G, N/8]`` -> uint8 ``[K or K/G, N]`` in
    column order."""
    q = nibbles(words)
    order = torch.tensor(AWQ_UNPACK_ORDER, device=q.device)
    return q.view(*q.shape[:-1], -1, 8).index_select(-1, order).reshape(q.shape)


def unpack_gptq_qweight(words: torch.Tensor) -> torch.Tensor:
    """A GPTQ ``qweight [K/8, N]`` -> uint8 ``[K, N]``."""
    return nibbles(words.t().contiguous()).t().contiguous()


@dataclass
class Int4Config:
    """AWQ/GPTQ 4-bit linear layers of a model.

    Attributes:
        method: ``"awq"``, ``"gptq"`` or ``"compressed-tensors"`` (pack-quantized).
        group_size: weights per scale along K (a multiple of 32).
        checkpoint: the checkpoint holds packed tensors (``qweight``, ``qzeros``, ``scales``);
            False: float weights are quantized while they load.
        zero_offset: added to every stored zero (GPTQ v1: 1).
        source: where the scheme came from (for the log and errors).
        ignore: module names kept in the run dtype (AWQ's ``modules_to_not_convert``: a
            module is kept when one entry is a substring of its name, vLLM's rule;
            compressed-tensors' ``ignore``: exact names or ``re:`` patterns).
        symmetric: the checkpoint has no zeros (compressed-tensors ``symmetric``: 8).
        act_order: GPTQ's ``desc_act`` / compressed-tensors' ``actorder: group``: a
            ``g_idx`` gives each input's group (module docstring).
    """

    method: str
    group_size: int = DEFAULT_GROUP
    checkpoint: bool = True
    zero_offset: int = 0
    source: str = ""
    ignore: list[str] = field(default_factory=list)
    symmetric: bool = False
    act_order: bool = False

    def is_ignored(self, hf_module: str) -> bool:
        if self.method == "compressed-tensors":  # exact names or re: patterns
            return any(re.match(e[3:], hf_module) if e.startswith("re:") else e == hf_module
                       for e in self.ignore)
        return any(entry in hf_module for entry in self.ignore)

    def linear_method(self) -> Int4LinearMethod:
        return Int4LinearMethod(self)

    def describe(self) -> str:
        what = (f"{self.method.upper()} checkpoint" if self.checkpoint
                else f"{self.method.upper()}-style, quantized at load time")
        return f"4-bit linear layers ({self.source}: {what}, groups of {self.group_size})"


def quantize_rtn(w: torch.Tensor, group: int, symmetric: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization per group of ``group`` weights along K.

    Args:
        w: ``[N, K]`` float, ``K % group == 0``.
        symmetric: GPTQ's ``sym`` (``s = 2 * amax / 15``, ``z = 8``); else AWQ's asymmetric
            min/max (``s = (max - min) / 15``, ``z = round(-min / s)``).
    Returns:
        ``(q [N, K] uint8 in 0..15, s [N, K/G] float16, z [N, K/G] uint8)``, ``W ~ (q - z) * s``.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    if symmetric:
        amax = g.abs().amax(-1)
        s = (amax * (2 / 15)).clamp(min=1e-6).half()
        z = torch.full_like(s, 8, dtype=torch.float32)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).clamp(min=1e-6).half()
        z = (-lo / s.float()).round().clamp(0, 15)
    q = (g / s.float().unsqueeze(-1)).round() + z.unsqueeze(-1)
    q = q.clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q, s, z.to(torch.uint8)


def _full(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.materialize()


#: a format's tensor names for the codes, the scales and the zeros of a layer
TENSOR_NAMES = {"awq": ("qweight", "scales", "qzeros"), "gptq": ("qweight", "scales", "qzeros"),
                "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point")}
#: a format's per-layer tensors that are only checked (act-order indices, the weight's shape)
CHECKED_NAMES = {"gptq": ("g_idx",), "compressed-tensors": ("weight_g_idx", "weight_shape")}
#: a format's act-order indices
G_IDX_NAMES = {"gptq": "g_idx", "compressed-tensors": "weight_g_idx"}


class Int4LinearMethod(WeightOnlyMethod):
    """A ``LinearBase``'s AWQ/GPTQ quant method (module docstring); the product is
    :class:`~engine.layers.quantization.wq.WeightOnlyMethod`'s over the ``q4`` layout."""

    source = "AWQ/GPTQ"

    def __init__(self, config: Int4Config):
        self.config = config

    def _check_split(self, layer: nn.Module, g: int) -> None:
        k = layer.input_size
        if k % g == 0:
            return
        if not layer.shards_output and layer.tp_size > 1:
            raise ValueError(f"--tp-size {layer.tp_size} splits the input size "
                             f"{k * layer.tp_size} of a row-parallel {type(layer).__name__} "
                             f"into {k} per rank, which cuts its quantization groups of {g}")
        raise ValueError(f"{type(layer).__name__}: input size {k} is not a multiple of the "
                         f"quantization group_size {g}")

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Quantized at load: ``weight``/``weight_scale``/``weight_min`` in the q4 layout
        (filled by :meth:`pack`). From a checkpoint: parameters named like the format's
        tensors (:data:`TENSOR_NAMES`) in rows of W: the codes uint8 ``[N, K/2]``, the scales
        fp32 and the zeros uint8 ``[N, K/G]`` (a symmetric compressed-tensors checkpoint has
        no zeros: 8, not expected), plus empty parameters whose loaders only check
        :data:`CHECKED_NAMES`; renamed into the q4 layout after loading.

        Raises:
            ValueError: K not a multiple of the group size (naming --tp-size when a
                row-parallel split causes it).
        """
        layer.wq_dtype = dtype
        cfg = self.config
        g = cfg.group_size
        if not cfg.checkpoint:  # the largest of G, 64, 32 that divides K (SmolLM2: K = 576)
            g = next((c for c in (g, 64, 32) if c <= g and layer.input_size % c == 0), g)
            self._check_split(layer, g)
            self.set_format(layer, "q4", g, torch.float32)
            return
        self._check_split(layer, g)
        n, k = layer.output_size, layer.input_size
        q_name, s_name, z_name = TENSOR_NAMES[cfg.method]
        for name, kind, shape, dt in ((q_name, "q", (n, k // 2), torch.uint8),
                                      (s_name, "s", (n, k // g), torch.float32),
                                      (z_name, "z", (n, k // g), torch.uint8)):
            p = nn.Parameter(torch.empty(shape, dtype=dt), requires_grad=False)
            p.weight_loader = (lambda prm, t, s=None, _k=kind:
                               self.load_packed(layer, _k, prm, t, s))
            setattr(layer, name, p)
        if cfg.symmetric:
            getattr(layer, z_name).data.fill_(8)
            getattr(layer, z_name).derived = True
        for name in CHECKED_NAMES.get(cfg.method, ()):
            if cfg.act_order and name == G_IDX_NAMES[cfg.method]:
                self._create_g_idx(layer, name)
                continue
            p = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
            p.weight_loader = (lambda prm, t, s=None, _n=name:
                               self.check_tensor(layer, _n, t))
            p.derived = True  # optional in a checkpoint
            setattr(layer, name, p)
        layer.wq_format = "q4"
        layer.wq_group_size = g
        layer.wq_path = "torch"

    def _create_g_idx(self, layer: nn.Module, name: str) -> None:
        """Act-order: ``name`` [K] int32, expected in the checkpoint, shared by fused parts.

        Raises:
            ValueError: a row-parallel layer split over ranks (naming --tp-size).
        """
        if not layer.shards_output and layer.tp_size > 1:
            raise ValueError(f"--tp-size {layer.tp_size}: act-order weights (desc_act / "
                             f"actorder group) of a row-parallel {type(layer).__name__} "
                             "cannot be split along K; use --tp-size 1")
        p = nn.Parameter(torch.full((layer.input_size,), -1, dtype=torch.int32),
                         requires_grad=False)
        p.weight_loader = lambda prm, t, s=None: self.load_g_idx(layer, name, prm, t)
        setattr(layer, name, p)

    def load_g_idx(self, layer: nn.Module, name: str, param: nn.Parameter, loaded) -> None:
        """Keep an act-order ``g_idx``; every part of a fused layer must bring the same.

        Raises:
            ValueError: a wrong shape, or fused parts with different indices.
        """
        t = _full(loaded).to(torch.int32).reshape(-1)
        if t.numel() != param.numel():
            raise ValueError(f"{name} has {t.numel()} entries, expected {param.numel()}")
        t = t.to(param.device)
        if bool((param.data >= 0).all()) and not torch.equal(param.data, t):
            raise ValueError(f"the parts of the fused {type(layer).__name__} have different "
                             f"{name} (act-order), which one matmul cannot share")
        param.data.copy_(t)

    def _apply_act_order(self, layer: nn.Module, name: str, label: str) -> None:
        """Sort K by group: permute the codes' columns and keep the order in ``wq_perm``.

        Raises:
            ValueError: a g_idx whose groups do not have group_size members each.
        """
        g = getattr(layer, name).data.long()
        perm = torch.argsort(g, stable=True)
        want = torch.arange(g.numel(), device=g.device) // self.config.group_size
        if not torch.equal(g[perm], want):
            raise ValueError(f"{label}: {name} does not give each group "
                             f"{self.config.group_size} inputs")
        if torch.equal(perm, torch.arange(g.numel(), device=g.device)):
            return
        codes = unpack_q4(layer.weight.data)
        layer.weight.data = pack_q4(codes.index_select(1, perm))
        layer.register_buffer("wq_perm", perm, persistent=False)

    def pack(self, layer: nn.Module, loaded) -> dict[str, torch.Tensor]:
        """A float weight ``[N, K]`` quantized at load (:func:`quantize_rtn`) -> the q4
        layout's full tensors."""
        w = _full(loaded)
        if not w.is_floating_point():
            raise ValueError(f"{type(layer).__name__}: expected a float weight to quantize, "
                             f"got {w.dtype}")
        sym = self.config.method == "gptq" or self.config.symmetric
        q, s, z = quantize_rtn(w, layer.wq_group_size, sym)
        s32 = s.float()
        return {"weight": pack_q4(q), "weight_scale": s32, "weight_min": -s32 * z.float()}

    def to_rows(self, kind: str, loaded) -> torch.Tensor:
        """One checkpoint tensor -> ferry's rows of W: ``kind`` ``"q"`` (codes) -> ``[N, K/2]``
        q4 nibbles, ``"s"`` (scales) -> fp32 ``[N, K/G]``, ``"z"`` (zeros) -> uint8
        ``[N, K/G]`` with the format's offset added.

        Raises:
            ValueError: a tensor of the wrong dtype for its kind.
        """
        t = _full(loaded)
        method = self.config.method
        what = TENSOR_NAMES[method]["qsz".index(kind)]
        if kind == "s":
            if not t.is_floating_point():
                raise ValueError(f"{what} is {t.dtype}, expected a float tensor")
            return (t if method == "compressed-tensors" else t.t()).float()
        if kind == "z" and method == "compressed-tensors" and t.dtype == torch.int8:
            return (t.to(torch.int16) + 8).to(torch.uint8)  # unpacked signed zero points
        if t.dtype != torch.int32:
            raise ValueError(f"{what} is {t.dtype}, expected int32 (8 packed 4-bit values)")
        if kind == "z":
            if method == "awq":
                return unpack_awq(t).t()
            if method == "gptq":
                return (nibbles(t) + self.config.zero_offset).t()
            return nibbles(t.t().contiguous()).t()       # packed along N: [N/8, K/G]
        if method == "awq":
            return pack_q4(unpack_awq(t).t())
        if method == "gptq":
            return pack_q4(unpack_gptq_qweight(t).t())
        return pack_q4(nibbles(t))                        # [N, K/8] along K

    def load_packed(self, layer: nn.Module, kind: str, param: nn.Parameter, loaded,
                    shard_id=None) -> None:
        """Load one checkpoint tensor through the layer's own loader (fused parts,
        tensor-parallel shards) once in rows of W (:meth:`to_rows`)."""
        layer.weight_loader(param, self.to_rows(kind, loaded), shard_id)

    def check_tensor(self, layer: nn.Module, name: str, loaded) -> None:
        """A ``g_idx``/``weight_g_idx [K]`` must be ``k // group_size`` (no act-order); a
        ``weight_shape`` must give the layer's full input size.

        Raises:
            ValueError: any other value, naming the tensor.
        """
        t = _full(loaded).to(torch.int64).reshape(-1)
        if name == "weight_shape":
            k = layer.input_size * (1 if layer.shards_output else layer.tp_size)
            if t.numel() != 2 or int(t[1]) != k:
                raise ValueError(f"weight_shape {t.tolist()} does not match the layer's "
                                 f"input size {k}")
            return
        want = torch.arange(t.numel(), device=t.device) // self.config.group_size
        if not torch.equal(t, want):
            raise ValueError(f"{name} is not k // group_size (act-order / desc_act weights "
                             "are not supported)")

    def process_weights_after_loading(self, layer: nn.Module, device_type: str,
                                      name: str = "") -> None:
        """Checkpoint tensors -> the q4 layout (``weight``, ``weight_scale = s``,
        ``weight_min = -s * z``), then the matmul path.

        Raises:
            ValueError: a scale that is NaN or infinite.
        """
        q_name, s_name, z_name = TENSOR_NAMES.get(self.config.method, ("",) * 3)
        if self.config.checkpoint and q_name in layer._parameters:
            s = getattr(layer, s_name).data
            if not bool(torch.isfinite(s).all()):
                raise ValueError(f"{name or type(layer).__name__}: the checkpoint's {s_name} "
                                 "have NaN or infinite values")
            mins = -(s * getattr(layer, z_name).data.float())
            weight = getattr(layer, q_name).data
            layer.weight = nn.Parameter(weight, requires_grad=False)
            if self.config.act_order:
                self._apply_act_order(layer, G_IDX_NAMES[self.config.method],
                                      name or type(layer).__name__)
            for n in (q_name, s_name, z_name, *CHECKED_NAMES.get(self.config.method, ())):
                layer._parameters.pop(n, None)
            layer.weight_scale = nn.Parameter(s, requires_grad=False)
            layer.weight_min = nn.Parameter(mins, requires_grad=False)
        super().process_weights_after_loading(layer, device_type, name)
