"""Weight-only 4-bit/8-bit quantized GEMMs: the layouts and their torch references
(:mod:`kernels.quant.reference`) and the Triton GEMMs over them (:mod:`kernels.quant.wq_triton`,
the decode GEMV :mod:`kernels.quant.wq_gemv`), and the K-major 4-bit layout with its GEMV and
tensor-core GEMM (:mod:`kernels.quant.w4_tc`)."""
