"""Final-row selection and the LM head projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                   logits_indices: torch.Tensor | None) -> torch.Tensor:
    """Logits of the rows that are sampled.

    Args:
        hidden: final normed hidden states [T, hidden] (run dtype).
        lm_head_weight: [vocab, hidden] (the embedding table when tied).
        logits_indices: [B] int64 rows of ``hidden`` to project, or None for all T rows.
    Returns:
        [B or T, vocab] float32. The matmul runs in the run dtype, then is cast.
    """
    if logits_indices is not None:
        hidden = hidden.index_select(0, logits_indices)
    return F.linear(hidden, lm_head_weight).float()
