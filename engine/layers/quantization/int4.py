"""AWQ and GPTQ 4-bit linear weights, kept 4-bit (W4A16 on GPUs, W4A32 on the CPU).

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
  ``desc_act: true`` (act-order: ``g_idx`` is not ``k // G``) is refused, as is a
  ``g_idx`` tensor that is not ``k // G``.

Anything else (other ``bits``, ``group_size`` -1 or not a multiple of 32, AWQ's GEMV /
Marlin / exllama versions, ``zero_point: false``, GPTQ's ``dynamic`` per-module rules or the
old Marlin serialization) is a start-up error naming the field.

ferry's layout: at load every packed tensor is unpacked and transposed to rows of W, then
kept in :mod:`kernels.quant.quant_ref`'s ``q4`` layout (uint8 nibbles ``[N, K/2]``) with
float32 ``weight_scale = s`` and ``weight_min = -s * z`` (``[N, K/G]``), so ``s * q + min``
is ``(q - z) * s`` exactly in fp32 (an fp16 scale times an integer below 17 has at most 15
significant bits). The CPU's C++ kernels and the Triton kernel of the GGUF blocks run it
unchanged (:mod:`engine.layers.quantization.wq`). Bytes per weight: 4.5 bits (AWQ's own
files: 4.16); fp16 scales with a 4-bit zero would need a ``(q - z) * s`` kernel variant.

Every packed tensor is converted whole (one HF part), then the layer's own loader places it:
fused q/k/v and gate/up parts are rows of the fused weight, column-parallel ranks take rows
of N, row-parallel ranks take columns of K in whole groups (a ``--tp-size`` whose split of
K cuts a group is refused at start-up).

Quantized at load (``--quantization awq|gptq`` on a float checkpoint or dummy weights, or a
checkpoint config with ``--load-format dummy``): round-to-nearest per group of 128 (the
config's ``group_size`` when it has one): ``awq`` asymmetric (AutoAWQ's
``pseudo_quantize_tensor`` without the activation-aware scale search: ``s = (max - min) /
15`` in fp16, ``z = round(-min / s)``), ``gptq`` symmetric (GPTQ's quantizer with
``sym``: ``s = 2 * amax / 15``, ``z = 8``), into the same layout: for benchmarks with dummy
weights, not a calibrated quantization.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.layers.quantization.wq import WeightOnlyMethod
from kernels.quant.quant_ref import pack_q4

logger = logging.getLogger(__name__)

#: nibble i of an AWQ word holds column 8j + AWQ_PACK_ORDER[i] of its 8
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: column c of an AWQ word is in nibble AWQ_UNPACK_ORDER[c]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
#: the group size of weights quantized at load when the config gives none
DEFAULT_GROUP = 128
INT4_METHODS = ("awq", "gptq")

_SHIFTS = tuple(range(0, 32, 4))


def _refuse(msg: str) -> ValueError:
    return ValueError(f"unsupported quantization_config: {msg}")


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
        method: ``"awq"`` or ``"gptq"``.
        group_size: weights per scale along K (a multiple of 32).
        checkpoint: the checkpoint holds packed tensors (``qweight``, ``qzeros``, ``scales``);
            False: float weights are quantized while they load.
        zero_offset: added to every stored zero (GPTQ v1: 1).
        source: where the scheme came from (for the log and errors).
        ignore: module names kept in the run dtype (AWQ's ``modules_to_not_convert``: a
            module is kept when one entry is a substring of its name, vLLM's rule).
    """

    method: str
    group_size: int = DEFAULT_GROUP
    checkpoint: bool = True
    zero_offset: int = 0
    source: str = ""
    ignore: list[str] = field(default_factory=list)

    def is_ignored(self, hf_module: str) -> bool:
        return any(entry in hf_module for entry in self.ignore)

    def linear_method(self) -> Int4LinearMethod:
        return Int4LinearMethod(self)

    def describe(self) -> str:
        what = (f"{self.method.upper()} checkpoint" if self.checkpoint
                else f"{self.method.upper()}-style, quantized at load time")
        return f"4-bit linear layers ({self.source}: {what}, groups of {self.group_size})"


def _group_size(qc: dict, method: str) -> int:
    g = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or g % 32:
        raise _refuse(f"{method} group_size {g!r}: ferry loads groups that are a positive "
                      "multiple of 32 (per-channel, group_size -1, is not supported)")
    return g


def _bits(qc: dict, method: str) -> None:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(f"{method} bits {bits!r}: ferry loads 4-bit weights only")


def parse_awq(qc: dict) -> Int4Config:
    """An AWQ ``quantization_config`` (module docstring).

    Raises:
        ValueError: bits, group_size, version or zero_point ferry cannot load, naming it.
    """
    _bits(qc, "awq")
    group = _group_size(qc, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version {qc.get('version')!r}: ferry loads the GEMM layout "
                      "(version 'gemm')")
    if qc.get("zero_point", True) is not True:
        raise _refuse("awq zero_point false: ferry loads AWQ weights with zero points")
    return Int4Config("awq", group, True, 0, "quant_method awq",
                      list(qc.get("modules_to_not_convert") or []))


def parse_gptq(qc: dict) -> Int4Config:
    """A GPTQ ``quantization_config`` (module docstring).

    Raises:
        ValueError: bits, group_size, desc_act, checkpoint_format, dynamic or a Marlin
            serialization ferry cannot load, naming it.
    """
    _bits(qc, "gptq")
    group = _group_size(qc, "gptq")
    if qc.get("desc_act"):
        raise _refuse("gptq desc_act true (act-order: g_idx permutes the groups along K) is "
                      "not supported; ferry loads desc_act false checkpoints")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
    if qc.get("is_marlin_format"):
        raise _refuse("gptq is_marlin_format true: the Marlin serialization is not supported")
    if qc.get("dynamic"):
        raise _refuse("gptq dynamic (per-module overrides) is not supported")
    return Int4Config("gptq", group, True, 1 if fmt == "gptq" else 0,
                      f"quant_method gptq ({fmt})")


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


#: checkpoint tensor names of a layer -> the dtype of ferry's row-layout parameter
_CKPT_PARAMS = {"qweight": torch.uint8, "scales": torch.float32, "qzeros": torch.uint8}


class Int4LinearMethod(WeightOnlyMethod):
    """A ``LinearBase``'s AWQ/GPTQ quant method (module docstring); the product is
    :class:`~engine.layers.quantization.wq.WeightOnlyMethod`'s over the ``q4`` layout."""

    source = "AWQ/GPTQ"

    def __init__(self, config: Int4Config):
        self.config = config

    def _check_split(self, layer: nn.Module) -> None:
        g, k = self.config.group_size, layer.input_size
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
        (filled by :meth:`pack`). From a checkpoint: ``qweight [N, K/2]`` uint8, ``scales``
        fp32 and ``qzeros`` uint8 ``[N, K/G]`` in rows of W (and an empty ``g_idx`` whose
        loader only checks the checkpoint's), renamed into the q4 layout after loading.

        Raises:
            ValueError: K not a multiple of the group size (naming --tp-size when a
                row-parallel split causes it).
        """
        self._check_split(layer)
        layer.wq_dtype = dtype
        g = self.config.group_size
        if not self.config.checkpoint:
            self.set_format(layer, "q4", g, torch.float32)
            return
        n, k = layer.output_size, layer.input_size
        shapes = {"qweight": (n, k // 2), "scales": (n, k // g), "qzeros": (n, k // g)}
        for name, dt in _CKPT_PARAMS.items():
            p = nn.Parameter(torch.empty(shapes[name], dtype=dt), requires_grad=False)
            p.weight_loader = (lambda prm, t, s=None, _n=name:
                               self.load_packed(layer, _n, prm, t, s))
            setattr(layer, name, p)
        if self.config.method == "gptq":
            p = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
            p.weight_loader = lambda prm, t, s=None: self.check_g_idx(layer, t)
            p.derived = True  # optional in a checkpoint
            layer.g_idx = p
        layer.wq_format = "q4"
        layer.wq_group_size = g
        layer.wq_path = "torch"

    def pack(self, layer: nn.Module, loaded) -> dict[str, torch.Tensor]:
        """A float weight ``[N, K]`` quantized at load (:func:`quantize_rtn`) -> the q4
        layout's full tensors."""
        w = _full(loaded)
        if not w.is_floating_point():
            raise ValueError(f"{type(layer).__name__}: expected a float weight to quantize, "
                             f"got {w.dtype}")
        q, s, z = quantize_rtn(w, self.config.group_size, self.config.method == "gptq")
        s32 = s.float()
        return {"weight": pack_q4(q), "weight_scale": s32, "weight_min": -s32 * z.float()}

    def to_rows(self, name: str, loaded) -> torch.Tensor:
        """One checkpoint tensor (``qweight``, ``qzeros`` or ``scales``) -> ferry's rows of
        W (``[N, K/2]`` q4 nibbles, ``[N, K/G]`` zeros with the offset added, or fp32 scales).

        Raises:
            ValueError: a tensor of the wrong dtype for its name.
        """
        t = _full(loaded)
        if name == "scales":
            if not t.is_floating_point():
                raise ValueError(f"scales is {t.dtype}, expected a float tensor")
            return t.t().float()
        if t.dtype != torch.int32:
            raise ValueError(f"{name} is {t.dtype}, expected int32 (8 packed 4-bit values)")
        if name == "qzeros":
            z = unpack_awq(t) if self.config.method == "awq" else nibbles(t)
            return (z + self.config.zero_offset).t()
        q = unpack_awq(t) if self.config.method == "awq" else unpack_gptq_qweight(t)
        return pack_q4(q.t())

    def load_packed(self, layer: nn.Module, name: str, param: nn.Parameter, loaded,
                    shard_id=None) -> None:
        """Load checkpoint tensor ``name`` through the layer's own loader (fused parts,
        tensor-parallel shards) once in rows of W."""
        layer.weight_loader(param, self.to_rows(name, loaded), shard_id)

    def check_g_idx(self, layer: nn.Module, loaded) -> None:
        """A GPTQ ``g_idx [K]`` must be ``k // group_size`` (no act-order).

        Raises:
            ValueError: any other g_idx.
        """
        t = _full(loaded).to(torch.int64).reshape(-1)
        want = torch.arange(t.numel(), device=t.device) // self.config.group_size
        if not torch.equal(t, want):
            raise ValueError("g_idx is not k // group_size (act-order / desc_act weights "
                             "are not supported)")

    def process_weights_after_loading(self, layer: nn.Module, device_type: str,
                                      name: str = "") -> None:
        """Checkpoint tensors -> the q4 layout (``weight``, ``weight_scale = s``,
        ``weight_min = -s * z``), then the matmul path.

        Raises:
            ValueError: a scale that is NaN or infinite.
        """
        if self.config.checkpoint and "qweight" in layer._parameters:
            s = layer.scales.data
            if not bool(torch.isfinite(s).all()):
                raise ValueError(f"{name or type(layer).__name__}: the checkpoint's scales "
                                 "have NaN or infinite values")
            mins = -(s * layer.qzeros.data.float())
            weight = layer.qweight.data
            for n in ("qweight", "scales", "qzeros", "g_idx"):
                layer._parameters.pop(n, None)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(s, requires_grad=False)
            layer.weight_min = nn.Parameter(mins, requires_grad=False)
        super().process_weights_after_loading(layer, device_type, name)
