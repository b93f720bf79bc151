"""ferry's C++ CPU kernels (``kernels/cpu/ops.cpp``), built on first use.

:func:`load` compiles the file with ``torch.utils.cpp_extension`` (g++ ``-O3
-march=native -mprefer-vector-width=512``: GCC's default 256-bit vectors on AVX-512 CPUs
left SiLU-and-mul at 2.9 ms instead of 1.2 for 2048 x 3072 bf16; ninja; ~13 s on two
cores, once: the build is cached under ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, keyed by the source, torch
version and this CPU's instruction-set flags) and registers ``torch.ops.ferry_cpu``. Where
it cannot build (no compiler, ``FERRY_CPU_KERNELS=0``) it returns False once, logging why,
and the CPU runs the torch references of :mod:`kernels.reference` instead.
``python -m kernels.cpu_ops`` builds it ahead of time (``make install`` does).

Ops (CPU tensors, float32 or bfloat16; math in fp32 with the references' roundings):

- :func:`decode_attention` ``(q [B, Hq, D], k_buffer/v_buffer [slots, Hkv, D], o [B, Hq, D],
  req_to_token [R, C] int32, rows [B] int64, seq_lens [B] int64, sm_scale)``: reads each
  request's K/V rows straight from the paged cache (no gather), softmax in fp32; a task is a
  whole request (every KV head, each slot's row read once) when there are at least 4
  requests per thread, else one (request, KV head) with the G query heads of its group.
  Optional ``sliding_window`` (only the last W tokens are read), ``logit_softcap`` and
  ``sinks`` as in :func:`kernels.reference.decode_attention_ref`.
- :func:`rms_norm`, :func:`silu_and_mul`, :func:`rotary_inplace`: the signatures of the
  Triton small ops (:mod:`kernels.fused_ops`, :mod:`kernels.rotary`), so
  :func:`engine.layers.op_implementations` can set them as ``impl``.
- ``torch.ops.ferry_cpu.wq_linear`` / ``wq_dequant`` (``kernels/cpu/wq.cpp``): products
  with and dequantization of :mod:`kernels.quant.reference`'s q4/q8 weight layouts (used by
  ``engine.layers.quantization.wq``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from kernels.attention_variants import check_variants

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "ops.cpp"
#: the weight-only low-bit linear kernels (``wq_linear``, ``wq_dequant``), in the same library
SOURCES = (SOURCE, SOURCE.with_name("wq.cpp"))
_STATE: dict = {}


def _cpu_flags_tag() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


#: a build lock older than this is a killed build's (a build takes ~15-60 s): removed
STALE_LOCK_S = 600.0


def clear_stale_lock(build_dir: str | os.PathLike, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir/lock`` when it is older than ``max_age_s`` seconds.

    torch's ``cpp_extension.load`` waits, without a limit, for the lock file that a build
    holds; a build killed before it ends (a server stopped during its first start) leaves the
    file behind and every later start would hang there. Returns True when a lock was removed.
    """
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age < max_age_s:
        return False
    logger.warning("removing a stale build lock of ferry's CPU kernels (%s, %.0f s old: a "
                   "build that was killed)", lock, age)
    with contextlib.suppress(OSError):
        lock.unlink()
    return True


def load(verbose: bool = False) -> bool:
    """Build (once) and load the kernels; True when ``torch.ops.ferry_cpu`` is usable."""
    if "ok" in _STATE:
        return _STATE["ok"]
    ok = False
    if os.environ.get("FERRY_CPU_KERNELS", "1") == "0":
        logger.info("FERRY_CPU_KERNELS=0: the CPU runs the torch reference kernels")
    else:
        try:
            from torch.utils import cpp_extension

            # the venv's ninja (a dependency) when the venv's bin is not on PATH
            bindir = os.path.dirname(sys.executable)
            if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
            name = f"ferry_cpu_ops_{_cpu_flags_tag()}"
            with contextlib.suppress(Exception):  # a private helper of torch's: best effort
                clear_stale_lock(cpp_extension._get_build_directory(name, verbose=False))
            cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], is_python_module=False,
                               extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512",
                                             "-fno-trapping-math", "-fopenmp"],
                               extra_ldflags=["-fopenmp"], verbose=verbose)
            ok = hasattr(torch.ops.ferry_cpu, "decode_attention")
        except Exception as e:  # noqa: BLE001 - any build failure means: use the references
            logger.warning("ferry's C++ CPU kernels did not build (%s: %s); the CPU runs the "
                           "slower torch reference kernels", type(e).__name__,
                           str(e).strip().splitlines()[-1][:300] if str(e).strip() else "")
    _STATE["ok"] = ok
    return ok


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     o: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float, *,
                     sliding_window: int | None = None, logit_softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged KV cache; writes and returns ``o`` [B, Hq, D].

    The variants are :func:`kernels.reference.decode_attention_ref`'s: ``sliding_window``
    (the last W tokens are read, the query's own included), ``logit_softcap`` and ``sinks``
    (``[Hq]`` contiguous float32); None: off.

    Raises:
        ValueError: a variant out of range (:func:`kernels.attention_variants.check_variants`).
        RuntimeError: shapes, strides or dtypes outside the contract above.
    """
    check_variants(q.shape[1], sliding_window, logit_softcap, sinks)
    torch.ops.ferry_cpu.decode_attention(q, k_buffer, v_buffer, o, req_to_token, rows,
                                         seq_lens, sm_scale, sliding_window or 0,
                                         logit_softcap or 0.0, sinks)
    return o


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """:func:`kernels.reference.rms_norm_ref` (same contract: new tensors; with ``residual``
    returns ``(out, x + residual)``); x [..., H] with contiguous rows."""
    shape = x.shape
    res = torch.ops.ferry_cpu.rms_norm(
        x.reshape(-1, shape[-1]), weight, eps,
        None if residual is None else residual.reshape(-1, shape[-1]))
    if residual is None:
        return res[0].view(shape)
    return res[0].view(shape), res[1].view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.reference.silu_and_mul_ref`: x [..., 2*I] -> new [..., I]."""
    shape = x.shape
    out = torch.ops.ferry_cpu.silu_and_mul(x.reshape(-1, shape[-1]))
    return out.view(*shape[:-1], shape[-1] // 2)


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, head_dim: int):
    """:func:`kernels.reference.rotary_ref`'s math, in place on q [T, Hq*D] and k [T, Hkv*D]
    (rows may be strided views of the fused qkv output); returns ``(q, k)``."""
    torch.ops.ferry_cpu.rotary(q, k, positions, cos_sin_cache, head_dim)
    return q, k


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("ferry CPU kernels:", "built" if load(verbose="-v" in sys.argv) else "unavailable")
