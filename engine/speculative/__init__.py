"""Speculative decoding: propose draft tokens per request, score them in one target
forward, keep what the target agrees with.

- ``proposer.py``: the proposer interface (a request's tokens -> up to k draft ids) and
  ``NgramProposer`` (``--speculative-algorithm NGRAM``: prompt lookup).
- ``worker.py``: ``SpecWorker``, the verify step the scheduler runs instead of a 1-token
  decode when requests speculate: KV slots for the drafts, the verify ``ScheduleBatch``
  (an EXTEND of ``[last token, d1..dk]`` per request over its cached prefix, logits for
  every position), acceptance (``engine/sampling/acceptance.py``), the rejected slots back
  to the pool.

It sits between the scheduler, which drives it, and the executor, the KV manager and the
sampling stage, which it uses (``.importlinter``).
"""

from __future__ import annotations

from engine.args import ServerArgs
from engine.speculative.proposer import NgramProposer, Proposer


def create_proposer(args: ServerArgs) -> Proposer | None:
    """The proposer of ``--speculative-algorithm`` (None when speculation is off)."""
    algo = args.speculative_algorithm
    if algo is None:
        return None
    if algo == "NGRAM":
        return NgramProposer(args.speculative_ngram_min_match_window_size,
                             args.speculative_ngram_max_match_window_size)
    raise ValueError(f"--speculative-algorithm {algo} is not implemented yet")


__all__ = ["NgramProposer", "Proposer", "create_proposer"]
