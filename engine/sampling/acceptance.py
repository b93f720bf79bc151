"""Acceptance of draft tokens (speculative decoding): which drafts the target keeps, and the
token it emits where the run ends. Beside the sampler, whose logits processing it reuses so
the target distribution at each position is exactly the one ``sample`` would draw from.

The verify forward gives logits for R rows; row r scores the position of draft ``d_r`` (or,
with ``d_r = -1``, the position after the last draft: the bonus row). Each row's
``SamplingBatchInfo`` is the one of a normal step at that position: its ``steps`` (min_tokens,
seeded noise) and its output ids (penalties) include the drafts before it.

- Greedy rows (temperature 0 or top_k 1): the draft is accepted iff it is the argmax; the
  emitted token is the argmax (speculation changes nothing in the output).
- Sampled rows: rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers
  via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
  with Speculative Sampling"). With target probabilities p (after bias, penalties,
  min_tokens, grammar mask, temperature, top-k/top-p/min-p: ``sample``'s pipeline) and draft
  probabilities q, the draft d is accepted with probability min(1, p(d) / q(d)); else the
  emitted token is drawn from the residual norm(max(p - q, 0)). NGRAM's draft is a point
  mass (q = one-hot of d): accept with probability p(d), else draw from p with d removed,
  renormalised. Either way the emitted token is distributed as p.

Randomness: one Gumbel noise row per position from the sampler's ``race_noise`` (seeded rows
hash (seed, step, token id), so they are reproducible and independent of the batch).

- Point-mass drafts (NGRAM, ``draft_probs`` None): the row draws the token a plain decode
  step would, ``t = argmax(log p + g)`` (the sampler's race with the same noise), and the
  draft is accepted iff ``t == d``; a rejected row emits t. This is the rejection sampling
  above, coupled to the decode step's noise: P(accept) = P(t = d) = p(d) = min(1, p(d)/1),
  and given a rejection t is distributed as p without d, renormalised (the residual). So the
  output at every position is exactly the token a decode step draws there: a seeded
  request's output is a function of (seed, position) and its logits alone, the same
  whether a step verifies drafts or decodes, and whether speculation runs for that step
  (``--speculative-max-batch-size``, back-off) or not at all.
- Drafts with probabilities q: the coin is ``u = exp(-exp(-g[d]))``, uniform on (0, 1), and
  the residual is drawn by the race ``argmax(log residual + g)``; a rejected row's residual
  never contains d (after a rejection p(d) < q(d)), so the coin and the draw use disjoint,
  independent noise. Lossless as well, but a rejected position's token depends on q, so it
  is not the decode step's token.
"""

from __future__ import annotations

import torch

from engine.sampling.sampler import (
    SamplingBatchInfo,
    apply_cuts,
    apply_logits_processors,
    apply_min_tokens_ban,
    race_noise,
    row_argmax,
)

_NEG_INF = float("-inf")


def target_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """``sample``'s logits processing (bias, penalties, grammar mask, then the min_tokens
    ban): [R, V] float32, a new tensor."""
    masked = info.vocab_mask is not None
    x = apply_logits_processors(logits, info, min_tokens_ban=not masked) \
        if info.needs_processing else logits.float().clone()
    if masked:
        from engine.sampling.grammar import apply_vocab_mask

        apply_vocab_mask(x, *info.vocab_mask)
        apply_min_tokens_ban(x, info)
    return x


def residual_logits(p: torch.Tensor, drafts: torch.Tensor,
                    q: torch.Tensor | None) -> torch.Tensor:
    """Log of the residual distribution max(p - q, 0) (unnormalised) per row: the
    correction that makes a rejected position's token follow p. ``q`` None: NGRAM's point
    mass on ``drafts`` (p with the draft removed). Rows without a draft (``drafts < 0``)
    keep p (the bonus token is a plain sample)."""
    has = (drafts >= 0).unsqueeze(1)
    if q is None:
        r = p.scatter(1, drafts.clamp(min=0).unsqueeze(1), 0.0)
    else:
        r = (p - q).clamp(min=0.0)
    r = torch.where(has, r, p)
    return torch.log(r)


def verify_drafts(logits: torch.Tensor, info: SamplingBatchInfo, drafts: torch.Tensor,
                  draft_probs: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject the draft of every row, and draw the token emitted if the run ends
    there. No host sync.

    Args:
        logits: [R, V] raw target logits (float), one row per verified position.
        info: ``SamplingBatchInfo`` of the R rows (see the module docstring).
        drafts: [R] int64, the draft token scored by each row, -1 for a bonus row.
        draft_probs: [R, V] float32 draft probabilities q, or None for point-mass drafts.
    Returns:
        ``(accepted [R] bool, emitted [R] int64)``: ``accepted`` is False on bonus rows;
        ``emitted`` is the residual draw (the decode step's draw for point-mass drafts, and
        the plain sample on a bonus row). A request
        keeps its leading accepted drafts, then the ``emitted`` token of its first row that
        is not accepted.
    """
    x = target_logits(logits, info)
    top = row_argmax(x)
    greedy_acc = (drafts >= 0) & (top == drafts)
    if info.is_all_greedy:
        return greedy_acc, top
    z = apply_cuts(x / info.temperatures, info)
    g = race_noise(info, z.shape[1])
    if draft_probs is None:
        acc, emitted = _coupled_point_mass(z, g, drafts)
    else:
        acc, emitted = _rejection_sampled(z, g, drafts, draft_probs)
    if info.greedy_mask is not None:
        acc = torch.where(info.greedy_mask, greedy_acc, acc)
        emitted = torch.where(info.greedy_mask, top, emitted)
    return acc, emitted


def _coupled_point_mass(z: torch.Tensor, g: torch.Tensor, drafts: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Point-mass drafts: the decode step's draw ``t = argmax(z + g)`` per row, accepted
    iff it is the draft (see the module docstring). ``z`` [R, V] float32 cut, temperature-
    scaled logits; ``g`` [R, V] float32 noise; ``drafts`` [R] int64. Returns
    ``(accepted [R] bool, t [R] int64)``."""
    t = row_argmax(z + g)
    return (drafts >= 0) & (t == drafts), t


def _rejection_sampled(z: torch.Tensor, g: torch.Tensor, drafts: torch.Tensor,
                       draft_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts with probabilities q (``draft_probs`` [R, V] float32): the coin
    min(1, p(d)/q(d)) and the residual draw (module docstring). Shapes as
    ``_coupled_point_mass``."""
    has = drafts >= 0
    d = drafts.clamp(min=0).unsqueeze(1)
    p = torch.softmax(z, dim=-1)
    pd = p.gather(1, d).squeeze(1)
    u = torch.exp(-torch.exp(-g.gather(1, d).squeeze(1)))
    qd = draft_probs.gather(1, d).squeeze(1)
    # p(d) >= q(d): min(1, p/q) = 1, accepted whatever u rounds to (u can round to 1.0)
    acc = has & ((u * qd < pd) | (pd >= qd))
    return acc, row_argmax(residual_logits(p, drafts, draft_probs) + g)
