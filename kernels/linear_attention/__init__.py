"""Linear-attention ops: the gated delta rule (Qwen3-Next's Gated DeltaNet) and its short conv.

``reference`` holds the pure-torch versions (the CPU path and the semantics): the chunked
gated delta rule for prefill, the per-token recurrence for decode, and the depthwise causal
conv1d with its per-request state (prefill and one-step update), all over packed varlen
batches with per-request initial states.
"""

from kernels.linear_attention.reference import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)

__all__ = [
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
    "chunk_gated_delta_rule_ref",
    "recurrent_gated_delta_rule_ref",
]
