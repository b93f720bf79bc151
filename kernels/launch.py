"""What the Triton kernels' launch tables change on XPU (one rule, used by every table).

triton-xpu runs a Triton "warp" as a SYCL sub-group of 32 lanes (``XPUOptions.warp_size``),
except in a kernel whose ``tl.dot`` lowers to DPAS: that module is compiled with 16-lane
sub-groups (the ``triton-annotate-module`` pass overwrites ``threads-per-warp``). With CUDA's
``num_warps`` such a program has half of CUDA's threads for the same tile, so each thread
holds twice the tile's registers, spills, and the large-GRF rebuild that follows halves the
resident work-groups. The XPU entry of a ``tl.dot`` kernel therefore doubles ``num_warps``
(capped at 32 sub-groups) and takes triton-xpu's default of 2 pipeline stages; a kernel
without ``tl.dot`` keeps CUDA's ``num_warps`` (its sub-groups are 32 lanes, as CUDA's warps).
None of this is tuned on an XPU: ``bench/kernels/bench_kernels.py`` and ``bench/kernels/sweep_decode.py``
are the tools for it (docs/deployment.md, "First run on an Intel GPU").
"""

from __future__ import annotations


def dot_kernel_options(num_warps: int, num_stages: int, device_type: str) -> dict:
    """``{"num_warps", "num_stages"}`` of a ``tl.dot`` kernel: CUDA's values as given (the CPU
    interpreter too); on XPU twice the warps (at most 32) and 2 stages."""
    if device_type == "xpu":
        return {"num_warps": min(num_warps * 2, 32), "num_stages": 2}
    return {"num_warps": num_warps, "num_stages": num_stages}
