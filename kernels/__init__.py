"""ferry's kernels: Triton ops, their torch references and the C++ CPU ops.

Layout by meaning: the attention and small-op kernels at the top (``decode_attention``,
``extend_attention``, ``kv_store``, ``fused_ops``, ``rotary``; ``cpu_ops`` loads the C++ CPU
kernels of ``cpu/``), the fused mixture-of-experts in :mod:`kernels.moe`, the weight-only
4-bit/8-bit GEMMs in :mod:`kernels.quant`, the FP8 quantizer and small-M FP8 linear (with the
FP8 numbers the engine's layers share) in :mod:`kernels.fp8`, batched LoRA in
:mod:`kernels.lora`, multi-head latent attention (DeepSeek's MLA) in :mod:`kernels.mla`.

Torch references, one naming: each package keeps the torch versions of its ops in a module
called ``reference`` (:mod:`kernels.reference`, :mod:`kernels.moe.reference`,
:mod:`kernels.quant.reference`, :mod:`kernels.fp8.reference`, :mod:`kernels.lora.reference`,
:mod:`kernels.mla.reference`).
They define the semantics the Triton ops must match, they are what the CPU runs, and the tests
compare the kernels with them; they import no Triton.

``kernels`` sits below the engine: it imports nothing of ``engine``, ``server`` or ``bench``
(a kernel takes what it needs of the device as arguments), and its modules import each other
without a circle (``.importlinter``).
"""
