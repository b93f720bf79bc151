"""Fused mixture-of-experts: the Triton op (:mod:`kernels.moe.fused_moe`) with its launch
tables (:mod:`kernels.moe.moe_config`), the Triton router (:mod:`kernels.moe.routing`) and
their torch references, the CPU path (:mod:`kernels.moe.reference`)."""
