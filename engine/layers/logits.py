"""Final-row selection and the LM head projection."""

from __future__ import annotations

import torch

from engine.distributed import all_gather_last_dim, get_tp
from engine.layers.linear import linear


def compute_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                   logits_indices: torch.Tensor | None,
                   vocab_size: int | None = None) -> torch.Tensor:
    """Logits of the rows that are sampled.

    Args:
        hidden: final normed hidden states [T, hidden] (run dtype).
        lm_head_weight: [vocab, hidden] (the embedding table when tied); with tensor
            parallelism this rank's rows [ceil(vocab / tp), hidden] of it; on the CPU
            possibly oneDNN's prepacked copy (``engine.layers.linear.pack_cpu_weights``).
        logits_indices: [B] int64 rows of ``hidden`` to project, or None for all T rows.
        vocab_size: the full vocabulary (needed with tensor parallelism, where the gathered
            logits carry padding columns past it).
    Returns:
        [B or T, vocab] float32, the same on every rank. The matmul runs in the run dtype,
        then is cast (after the all-gather).
    """
    if logits_indices is not None:
        hidden = hidden.index_select(0, logits_indices)
    logits = linear(hidden, lm_head_weight)
    if get_tp().size > 1:
        logits = all_gather_last_dim(logits)
        if vocab_size is not None and logits.shape[-1] != vocab_size:
            logits = logits[:, :vocab_size]
    return logits.float()


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Soft-capping ``cap * tanh(x / cap)`` (Gemma 2's ``final_logit_softcapping`` on the
    logits): x any shape and float dtype -> a new tensor of the same shape and dtype, in
    ``(-cap, cap)``."""
    return torch.tanh(x / cap) * cap
