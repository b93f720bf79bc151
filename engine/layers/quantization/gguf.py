"""GGUF linear weights kept in their blocks: Q4_0, Q4_1, Q8_0 and Q4_K.

GGUF (llama.cpp) stores a linear weight ``[N, K]`` row by row in blocks of 32 or 256 weights
(ggml's ``ggml-common.h``; gguf-py's ``gguf/quants.py`` dequantizes them):

- ``Q4_0`` (18 bytes): fp16 ``d``, then 16 bytes of nibbles; weight ``d * (q - 8)``;
- ``Q4_1`` (20 bytes): fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; weight ``d * q + m``;
- ``Q8_0`` (34 bytes): fp16 ``d``, 32 int8; weight ``d * q``;
- ``Q4_K`` (144 bytes per 256 weights, :func:`_repack_q4_k`): 8 groups of 32 with 6-bit
  scales and mins under fp16 super-scales;

a Q4_0/Q4_1 nibble byte ``j`` holds weight ``j`` (low) and ``j + 16`` (high) of its block.
At load time :func:`repack` splits the blocks into :mod:`kernels.quant.reference`'s layouts,
which keep that nibble order: Q4_0 and Q4_1 become ``q4`` (uint8 nibbles ``[N, K/2]``, fp16 scales and mins
``[N, K/32]``; a Q4_0 block's min is ``-8 * d``, exact in fp16 and giving the same fp32
weights, so Q4_0 costs 5 bits a weight here instead of 4.5), Q8_0 becomes ``q8`` (int8
``[N, K]``, fp16 scales), Q4_K becomes ``q4`` with 32-weight groups and float32 scales
and mins (its nibbles reordered; 6 bits a weight here instead of 4.5). The weights are the
checkpoint's, bit for bit.

The loader (``engine.loader.gguf``) hands the linear layers :class:`GgufBlocks` (raw block
rows, the q/k row permutation of llama.cpp's converter already undone on whole rows) and
builds the model with :class:`GgufConfig`'s plan: a fused layer (q/k/v, gate/up) keeps its
blocks when all its parts are Q4_0/Q4_1/Q4_K or all are Q8_0; any other type (Q6_K, F16,
a mix of 4- and 8-bit parts...) is dequantized into the run dtype as before, with a logged
note naming the types. Embeddings and norms are loaded as before (the embedding table
dequantized; see ``engine.loader.loader`` for the LM head).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from engine.layers.quantization.wq import WeightOnlyMethod
from kernels.quant.reference import pack_q4

logger = logging.getLogger(__name__)

Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12
#: ggml type id -> (name, bytes per block, ferry layout)
BLOCK_TYPES = {Q4_0: ("Q4_0", 18, "q4"), Q4_1: ("Q4_1", 20, "q4"), Q8_0: ("Q8_0", 34, "q8"),
               Q4_K: ("Q4_K", 144, "q4")}
#: weights per block (32 unless listed)
BLOCK_WEIGHTS = {Q4_K: 256}
#: ferry's group size (weights per scale) for every kept type
BLOCK = 32


def scale_dtype(ggml_types) -> torch.dtype:
    """The scale and min dtype of a layer whose parts have these types: float32 when one is
    Q4_K (its scales ``d * sc`` need up to 17 bits), else float16 (Q4_0/Q4_1/Q8_0's own)."""
    return torch.float32 if Q4_K in set(ggml_types) else torch.float16


def ggml_type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"ggml type {ggml_type}"


class GgufBlocks:
    """A GGUF tensor kept as raw block rows ``data [N, K / 32 * block_bytes]`` uint8.

    It behaves like a lazy float tensor for layers that do not keep blocks (``shape``,
    ``narrow`` and ``materialize`` dequantize with gguf-py), and :func:`repack` turns it into
    ferry's layout.
    """

    dtype = None

    def __init__(self, data: np.ndarray, ggml_type: int, shape: tuple[int, int]):
        self.data = data
        self.ggml_type = ggml_type
        self.shape = tuple(shape)

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    def dim(self) -> int:
        return len(self.shape)

    def materialize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize

        w = dequantize(self.data, GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.materialize().narrow(dim, start, length)


def repack(blocks: GgufBlocks) -> dict[str, torch.Tensor]:
    """Q4_0/Q4_1/Q8_0 block rows -> ``{"weight", "weight_scale"[, "weight_min"]}`` in the
    ``q4``/``q8`` layout (module docstring).

    Raises:
        ValueError: another block type, or a Q4_0 scale whose ``-8 * d`` overflows fp16.
    """
    if blocks.ggml_type not in BLOCK_TYPES:
        raise ValueError(f"GGUF {blocks.type_name} blocks cannot be kept (Q4_0, Q4_1, Q8_0, "
                         "Q4_K)")
    if blocks.ggml_type == Q4_K:
        return _repack_q4_k(blocks)
    _, nbytes, fmt = BLOCK_TYPES[blocks.ggml_type]
    n, k = blocks.shape
    nb = k // BLOCK
    raw = torch.from_numpy(np.array(blocks.data)).view(n, nb, nbytes)  # a copy: mmap is read-only
    d = raw[..., 0:2].contiguous().view(torch.float16).view(n, nb)
    if fmt == "q8":
        q = raw[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return {"weight": q, "weight_scale": d}
    if blocks.ggml_type == Q4_0:
        m = d * -8
        if not bool(torch.isfinite(m).all()):
            raise ValueError("a Q4_0 scale too large for fp16 once multiplied by -8")
        qs = raw[..., 2:]
    else:
        m = raw[..., 2:4].contiguous().view(torch.float16).view(n, nb)
        qs = raw[..., 4:]
    return {"weight": qs.reshape(n, k // 2).contiguous(), "weight_scale": d, "weight_min": m}


def _repack_q4_k(blocks: GgufBlocks) -> dict[str, torch.Tensor]:
    """Q4_K super-blocks (ggml's ``block_q4_K``, 144 bytes per 256 weights: fp16 ``d`` and
    ``dmin``, 12 bytes of 6-bit scales ``sc`` and mins ``m`` for 8 sub-blocks of 32, then
    128 bytes of nibbles, 32 per pair of sub-blocks: the low nibbles are sub-block ``2p``,
    the high ones ``2p + 1``; weight ``d * sc * q - dmin * m``) -> q4 with 32-weight groups
    and float32 ``scale = d * sc``, ``min = -dmin * m`` (both exact in fp32)."""
    n, k = blocks.shape
    nb = k // 256
    raw = torch.from_numpy(np.array(blocks.data)).view(n, nb, 144)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()          # [n, nb, 1]
    dmin = raw[..., 2:4].contiguous().view(torch.float16).float()
    b = raw[..., 4:16].to(torch.int32)
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1)     # [n, nb, 8]
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    qs = raw[..., 16:].reshape(n, nb, 4, 1, 32)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(n, k)           # sub-blocks in order
    return {"weight": pack_q4(codes), "weight_scale": (d * sc).reshape(n, nb * 8),
            "weight_min": (-(dmin * mn)).reshape(n, nb * 8)}


@dataclass
class GgufConfig:
    """GGUF blocks kept for the linear layers.

    Attributes:
        types: HF weight name (``model.layers.0.self_attn.q_proj.weight``) -> ggml type id
            of its GGUF tensor, filled by the loader once the names are mapped.
        source: why blocks are kept (``"GGUF (default on the CPU)"``, ``"--quantization gguf"``).
    """

    types: dict[str, int] = field(default_factory=dict)
    source: str = "GGUF"
    ignore: list[str] = field(default_factory=list)

    def is_ignored(self, hf_module: str) -> bool:
        return False

    def linear_method(self) -> GgufLinearMethod:
        return GgufLinearMethod(self)

    def layout_of(self, hf_weights: list[str]) -> tuple[str | None, str]:
        """The layout a fused layer with these HF weights keeps (``"q4"``, ``"q8"``, or None:
        dequantize), and the GGUF types of its parts (for the log)."""
        types = [self.types.get(w) for w in hf_weights]
        names = "/".join(sorted({ggml_type_name(t) for t in types if t is not None}))
        fmts = {BLOCK_TYPES[t][2] if t in BLOCK_TYPES else None for t in types}
        if len(fmts) == 1 and None not in fmts:
            return fmts.pop(), names
        return None, names


class GgufLinearMethod(WeightOnlyMethod):
    """Linear layers over GGUF Q4_0/Q4_1/Q8_0 blocks (module docstring)."""

    source = "GGUF blocks"

    def __init__(self, config: GgufConfig):
        self.config = config

    def pack(self, layer: nn.Module, loaded) -> dict[str, torch.Tensor]:
        if not isinstance(loaded, GgufBlocks):
            raise ValueError(f"{type(layer).__name__}: expected GGUF blocks, got a "
                             f"{getattr(loaded, 'dtype', type(loaded))} tensor")
        fmt = BLOCK_TYPES.get(loaded.ggml_type, (None, None, None))[2]
        if fmt != layer.wq_format:
            raise ValueError(f"{type(layer).__name__}: GGUF {loaded.type_name} blocks in a "
                             f"layer planned as {layer.wq_format}")
        return repack(loaded)


def plan_layers(model: nn.Module, config: GgufConfig, dtype: torch.dtype) -> tuple[int, int]:
    """Give each GGUF linear layer its layout from the types of its parts, or return it to
    ``dtype`` (dequantized weights) when they cannot be kept. Returns ``(kept, dequantized)``."""
    stacked = getattr(model, "stacked_params", ())
    kept, dropped, notes = 0, 0, {}
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), GgufLinearMethod):
            continue
        parent, _, leaf = name.rpartition(".")
        parts = [f"{parent}.{part}" if parent else part
                 for fused, part, _ in stacked if fused == leaf] or [name]
        hf = [f"{p}.weight" for p in parts]
        fmt, names = config.layout_of(hf)
        if fmt is None:
            module.drop_quantization(dtype)
            notes[names] = notes.get(names, 0) + 1
            dropped += 1
        else:
            sdtype = scale_dtype(config.types.get(w) for w in hf)
            if fmt != module.wq_format or module.weight_scale.dtype != sdtype:
                module.quant_method.set_format(module, fmt, BLOCK, sdtype)
            kept += 1
    for names, count in notes.items():
        logger.warning("%d linear layers with GGUF %s weights are dequantized to %s (blocks "
                       "are kept for Q4_0, Q4_1 and Q8_0, one layout per fused layer)", count,
                       names or "unknown", str(dtype).removeprefix("torch."))
    return kept, dropped
