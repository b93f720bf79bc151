"""FP8 (e4m3) kernels: the per-token activation quantizer and the small/medium-M FP8 linear in
Triton (:mod:`kernels.fp8.fp8_triton`), the block-wise FP8 GEMM and its per-token-group
quantizer (:mod:`kernels.fp8.block_triton`), their torch references
(:mod:`kernels.fp8.reference`) and the FP8 numbers they share with the engine's FP8 layers
(:mod:`kernels.fp8.constants`)."""
