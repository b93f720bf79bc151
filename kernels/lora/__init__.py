"""Batched LoRA for mixed-adapter batches: the segmented shrink/expand Triton ops
(:mod:`kernels.lora.lora_triton`) and their torch reference, the CPU path
(:mod:`kernels.lora.reference`)."""
