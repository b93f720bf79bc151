"""Multi-head latent attention (DeepSeek-V2/V3's MLA) kernels.

``reference`` is the torch path (the absorbed form, one request at a time: the CPU and the
tests' oracle; no Triton import); ``decode`` the Triton absorbed-form decode over the
latent pool (split-KV, one tile load per block of heads; its launch configs per head count
and latent dtype in ``decode_config``); ``prefill`` the Triton extend in
the MHA form over the decompressed K/V (why each form where: its module docstring).
"""
