"""Launch configurations of the MLA decode kernel (``kernels/mla/decode.py``), per head count
and latent dtype.

A configuration (:class:`MLADecodeConfig`) is ``BLOCK_H`` query heads per program (the
``tl.dot`` M: every head of a block shares each latent tile it loads), ``BLOCK_N`` tokens a
tile, ``num_warps``, ``num_stages`` and ``SPLIT_V``: 1, or 2 for two programs per head block
that each accumulate half of the 512 value columns (both compute the whole score tile). Its
tag, as the sweep prints it and :meth:`MLADecodeConfig.parse` reads it:
``BLOCK_H x BLOCK_N x warps x stages [v SPLIT_V]``, e.g. ``64x64x4x2v2``.

:data:`MLA_DECODE_TABLE` (parsed from the tags of :data:`MLA_DECODE_TAGS`) is keyed by
``(most heads of the bucket, kv kind)``: buckets 16, 32, 64 and None (more), kinds
``"16bit"`` (bf16/fp16 latent) and ``"fp8"`` (an e4m3/e5m2 latent: fp16 dots). An fp32
latent (CPU tests, benchmarks) keeps :data:`FP32_CONFIG`. The pre-table kernel's one
configuration is :data:`LEGACY_CONFIG` (``16x32x4x2``), kept for the comparison
(``python -m bench.kernels.bench_mla --configs legacy,default``).

Why these (H200: 132 SMs, 228 KB shared memory and 64K registers an SM, 989 TFLOP/s dense
bf16, 4.8 TB/s; swept on one on 2026-12-03 with ``bench/h200_run.sh mla-sweep``, which
prints the measured table: the 16-head rows are its picks, the others it confirmed within
1.04x of each shape's best; figures in docs/benchmarks.md). Work of one decode token of one head: scores over ``R + P = 576`` and
values over ``R = 512``, ``2 x (576 + 512) = 2,176`` FLOPs on a 1,152-byte bf16 row (576 in
FP8) that every head shares. 128 heads: 242 FLOP/byte (484 in FP8), above the ridge point
(206): compute-bound, and the head blocks decide how often each tile is re-read and
re-converted; 16 heads: 30 FLOP/byte, memory-bound.

- 128 and 64 heads, 16-bit: ``64x64x4x2v2``. ``BLOCK_H = 64`` is Hopper's ``wgmma`` M (one
  warpgroup; M = 16 or 32 run ``mma.sync`` at a fraction of the rate), so 128 heads re-read
  a tile twice instead of 8 times. The fp32 accumulator ``[64, 512]`` is 256 registers a
  thread on 4 warps (ptxas for sm_90a: 3.8 KB of spills), so the value columns are split
  over two programs (``SPLIT_V = 2``: ``[64, 256]``, 128 registers) that read the same tile
  (launched side by side: L2 hits) and both compute the ``[64, 64]`` scores: the score dot
  runs as 64x64x16 ``wgmma`` (A = q and B = the tile from shared memory, 4 KB per 131
  kFLOP: balanced against 128 B/clk of shared memory), the value dot as 64x256x16. One tile
  ``[64, 576]`` bf16 is 72 KB, two stages 144 KB, q 72 KB: 216 KB, one program an SM
  (ptxas: 255 registers, 68 bytes of spills: 8 reloads a tile against its 40 ``wgmma``).
  The alternative of 8 warps without the split (``64x32x8x2``) makes Triton give both
  warpgroups the whole score dot (a dot that feeds a dot keeps its warps along M), at N =
  16 per instruction, which is shared-memory bound; it is in the sweep. Roofline at bs64 x
  4k: 302 MB = 63 us of latent, 73 GFLOP of useful dots = 74 us at 989 TFLOP/s; the
  split-V score work is done twice (111 GFLOP executed): 113 us at peak, so ~150-250 us is
  the target (was 676).
- 128 and 64 heads, FP8: the same ``64x64x4x2v2`` (ptxas: 184 KB of shared memory, the
  e4m3 stages and the fp16 tile the dots read; 128 bytes of spills). Every program converts
  every tile it reads (e4m3 -> fp16, one ``cvt`` per pair, ~16 a clock an SM: ~1,150 clocks
  a ``[64, 576]`` tile, as long as its score dot), and with FLOPs the bound at 128 heads
  (484 FLOP/byte in FP8) halving the bytes does not pay for that: expect FP8 near bf16 here,
  not 2x (``64x32x4x3v2``, 8 bytes of spills, and ``64x32x8x2``, one program converting
  per tile and head block, are in the sweep). Before this table the FP8 path was slower
  than bf16 because the tile's cast moved after the shared-memory stage (one
  ``ld.shared.b8`` per element of the ``p @ c`` operand, 128 a thread a tile) and its loads
  no longer pipelined: the ``tl.where`` anchor in the kernel fixes both.
- 32 heads: ``32x32x8x2`` (one block: each tile read once; ``mma.sync``, 185 registers); FP8
  ``16x32x8x2`` (at 32 heads the FP8 build spills 0.5 KB).
- 16 heads (V2-Lite, V3 at TP 8): ``16x64x8x2``: one block; memory-bound, so 64-token
  tiles (72 KB a tile, 94 KB with two stages) on 8 warps (123 registers: two programs an
  SM), twice the bytes in flight of ``16x32x4x2``; FP8 ``16x32x8x2`` (224 registers, 100
  KB, no spills).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MLADecodeConfig:
    """One launch configuration of the MLA decode stage 1 (module docstring).

    Attributes:
        block_h: query heads per program (16, 32 or 64; the ``tl.dot`` M).
        block_n: tokens per tile (a power of two >= 16).
        num_warps, num_stages: Triton launch options (CUDA's; XPU doubles the warps).
        split_v: 1, or 2: two programs per head block, each half of the value columns.
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    split_v: int = 1

    def __post_init__(self):
        if self.block_h not in (16, 32, 64):
            raise ValueError(f"block_h must be 16, 32 or 64, got {self.block_h}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.split_v not in (1, 2):
            raise ValueError(f"split_v must be 1 or 2, got {self.split_v}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("num_warps and num_stages must be >= 1")

    @property
    def tag(self) -> str:
        """``"64x64x4x2v2"`` (``v1`` is left out)."""
        v = f"v{self.split_v}" if self.split_v != 1 else ""
        return f"{self.block_h}x{self.block_n}x{self.num_warps}x{self.num_stages}{v}"

    @classmethod
    def parse(cls, tag: str) -> MLADecodeConfig:
        """The config of a tag (``"16x32x4x2"``, ``"64x64x4x2v2"``; ``"legacy"``).

        Raises:
            ValueError: not such a tag, or values :class:`MLADecodeConfig` refuses.
        """
        if tag == "legacy":
            return LEGACY_CONFIG
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)(?:v(\d+))?", tag.strip())
        if not m:
            raise ValueError(f"MLA decode config {tag!r} is not BLOCK_HxBLOCK_NxWARPSxSTAGES"
                             "[vSPLIT_V]")
        h, n, w, s, v = m.groups()
        return cls(int(h), int(n), int(w), int(s), int(v or 1))


#: the kernel before the table (issue 46's measurements): 16 heads a program, 32-token tiles
LEGACY_CONFIG = MLADecodeConfig(16, 32, 4, 2)
#: a latent in fp32 (ieee dots: twice the shared memory and registers of bf16)
FP32_CONFIG = MLADecodeConfig(16, 16, 8, 2)
#: where the table's does not fit the device's shared memory (the 64-head rows need up to
#: 216 KB; an A100 has 163 KB a block, sm_89 99 KB), the first of these that does: the
#: pre-table kernel (56 KB in bf16, 100 KB in FP8 on sm_90a), then 37 KB / 60 KB
SMALL_SMEM_CONFIGS = (LEGACY_CONFIG, MLADecodeConfig(16, 16, 4, 2))

#: (most heads of the bucket or None, kv kind) -> tag of the configuration (module
#: docstring); ``bench.kernels.bench_mla --sweep`` prints a dict in this form to paste here
MLA_DECODE_TAGS: dict[tuple[int | None, str], str] = {
    (16, "16bit"): "16x64x4x2", (16, "fp8"): "16x64x8x2",
    (32, "16bit"): "32x32x8x2", (32, "fp8"): "16x32x8x2",
    (64, "16bit"): "64x64x4x2v2", (64, "fp8"): "64x64x4x2v2",
    (None, "16bit"): "64x64x4x2v2", (None, "fp8"): "64x64x4x2v2",
}
#: :data:`MLA_DECODE_TAGS` parsed
MLA_DECODE_TABLE: dict[tuple[int | None, str], MLADecodeConfig] = {
    k: MLADecodeConfig.parse(v) for k, v in MLA_DECODE_TAGS.items()}


def head_bucket(num_heads: int) -> int | None:
    """The table's bucket of ``num_heads``: 16, 32, 64, or None above 64."""
    for top in (16, 32, 64):
        if num_heads <= top:
            return top
    return None


def kv_kind(kv_fp8: bool) -> str:
    """``"fp8"`` or ``"16bit"``: the table's second key."""
    return "fp8" if kv_fp8 else "16bit"


def mla_decode_config(num_heads: int, kv_fp8: bool = False,
                      dtype: torch.dtype | None = None,
                      device_type: str = "cuda") -> MLADecodeConfig:
    """The table's configuration for ``num_heads`` query heads (per rank) over a latent
    that is FP8 (``kv_fp8``) or of ``dtype`` (None: 16-bit); :data:`FP32_CONFIG` for an
    fp32 latent; on XPU :data:`LEGACY_CONFIG` (the table is the H200's: its 64-head rows
    want more shared local memory than an Xe core has). A host function of shapes, safe
    in graph capture."""
    if device_type == "xpu":
        return LEGACY_CONFIG
    if not kv_fp8 and dtype == torch.float32:
        return FP32_CONFIG
    return MLA_DECODE_TABLE[(head_bucket(num_heads), kv_kind(kv_fp8))]


def table_line(picks: dict[tuple[int | None, str], str]) -> str:
    """``{(bucket, kind): tag}`` as one Python dict literal, buckets in order (16, 32, 64,
    None), to paste as :data:`MLA_DECODE_TAGS` (the sweep's summary); keys not in
    ``picks`` keep the current table's tag."""
    merged = {**MLA_DECODE_TAGS, **picks}
    keys = sorted(merged, key=lambda k: (k[0] or 1 << 30, k[1]))
    return "{" + ", ".join(f"({k[0]}, {k[1]!r}): {merged[k]!r}" for k in keys) + "}"


__all__ = ["FP32_CONFIG", "LEGACY_CONFIG", "MLADecodeConfig", "MLA_DECODE_TABLE", "MLA_DECODE_TAGS",
           "SMALL_SMEM_CONFIGS",
           "head_bucket", "kv_kind", "mla_decode_config", "table_line"]
