"""Pooling: what an embedding or a scoring model answers instead of a sampled token.

A pooling engine runs each prompt's prefill only (no decode step, no sampling) and turns the
final normed hidden states of its tokens (the model's ``hidden_out``, see
:meth:`engine.models.base.CausalLM.set_capture_hidden`) into one float32 vector:

- ``embed``: the pooled hidden state (``last`` token, ``mean`` of all tokens or the first,
  ``cls``), L2-normalised when the checkpoint says so (sentence-transformers' ``Normalize``
  module, or a decoder embedder such as Qwen3-Embedding);
- ``classify``: a cross-encoder (``*ForSequenceClassification``): the last token's hidden
  state through the ``score`` head ``[num_labels, hidden]``; with one label the score is
  ``sigmoid(logit)`` (what sentence-transformers' ``CrossEncoder`` and vLLM's score API
  return for such a model), with more the raw logits;
- ``yes_no``: a causal reranker (Qwen3-Reranker): ``softmax([logit_no, logit_yes])[yes]``
  of the last token's LM-head logits.

A prompt prefilled in chunks folds each chunk into its ``PoolState`` (a sum and a count for
``mean``, the first row for ``cls``, the last row for ``last``), so chunking changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

TASKS = ("embed", "classify", "yes_no")
POOLING = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingSpec:
    """How a pooling engine answers (one per served model).

    Attributes:
        task: ``embed``, ``classify`` or ``yes_no`` (see the module docstring).
        pooling: ``last``, ``mean`` or ``cls`` (``embed`` only; the others read the last
            token).
        normalize: L2-normalise the embedding.
        matryoshka: the embedder may be truncated (``/v1/embeddings``' ``dimensions``).
        matryoshka_dims: the truncations it was trained for (empty: any).
        num_labels: rows of the ``score`` head (``classify``).
        yes_no_ids: the ``(no, yes)`` token ids (``yes_no``).
    """

    task: str
    pooling: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dims: tuple[int, ...] = ()
    num_labels: int = 1
    yes_no_ids: tuple[int, ...] = ()

    @property
    def needs_every_row(self) -> bool:
        """Whether the pooled value reads rows other than the last (``mean``, ``cls``): then
        a cached prefix would hide rows, so the engine runs without the radix cache."""
        return self.task == "embed" and self.pooling != "last"

    def describe(self) -> dict:
        """What the server needs to know (``ReadyOut.pooling``)."""
        return {"task": self.task, "pooling": self.pooling, "normalize": self.normalize,
                "matryoshka": self.matryoshka, "matryoshka_dims": list(self.matryoshka_dims),
                "num_labels": self.num_labels}


class PoolState:
    """One request's pooled hidden state so far (float32 ``[hidden]`` tensors)."""

    __slots__ = ("total", "count", "first", "last")

    def __init__(self):
        self.total: torch.Tensor | None = None
        self.count = 0
        self.first: torch.Tensor | None = None
        self.last: torch.Tensor | None = None


class Pooler(nn.Module):
    """The pooling head of a pooling engine (the loader attaches it as ``model.pooler``).

    Args:
        spec: the engine's ``PoolingSpec``.
        hidden_size: the model's hidden width.
        dtype: the ``score`` head's dtype (``classify``; loaded from ``score.weight``).
    """

    def __init__(self, spec: PoolingSpec, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.score = nn.Parameter(torch.empty(spec.num_labels, hidden_size, dtype=dtype),
                                  requires_grad=False) if spec.task == "classify" else None
        if self.score is not None:  # not one of the model's checkpoint names (the loader's
            self.score.derived = True  # pooling step fills it from ``score.weight``)

    def update(self, state: PoolState | None, rows: torch.Tensor, first: bool) -> PoolState:
        """Fold one chunk of a prompt into its state.

        Args:
            state: the request's state (None before its first chunk).
            rows: ``[n, hidden]`` final normed hidden states of the chunk's tokens.
            first: the chunk starts at position 0.
        """
        st = state or PoolState()
        if self.spec.task == "embed" and self.spec.pooling == "mean":
            s = rows.float().sum(0)
            st.total = s if st.total is None else st.total + s
            st.count += rows.shape[0]
        elif self.spec.task == "embed" and self.spec.pooling == "cls":
            if first:
                st.first = rows[0].float()
        else:
            st.last = rows[-1].float()
        return st

    def finish(self, states: list[PoolState], last_logits: torch.Tensor | None) -> torch.Tensor:
        """The answers of the requests whose prompt is complete.

        Args:
            states: their states, B of them.
            last_logits: ``[B, vocab]`` float32 logits of their last tokens (``yes_no``).
        Returns:
            float32 ``[B, hidden]`` embeddings, ``[B, num_labels]`` scores, or ``[B, 1]``
            P(yes).
        """
        spec = self.spec
        if spec.task == "yes_no":
            no, yes = spec.yes_no_ids
            return torch.softmax(last_logits[:, [no, yes]].float(), dim=-1)[:, 1:]
        if spec.task == "embed" and spec.pooling == "mean":
            x = torch.stack([s.total / s.count for s in states])
        elif spec.task == "embed" and spec.pooling == "cls":
            x = torch.stack([s.first for s in states])
        else:
            x = torch.stack([s.last for s in states])
        if spec.task == "classify":
            logits = x @ self.score.float().t()
            return torch.sigmoid(logits) if spec.num_labels == 1 else logits
        return F.normalize(x, dim=-1) if spec.normalize else x
