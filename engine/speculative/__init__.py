"""Speculative decoding: propose draft tokens per request, score them in one target
forward, keep what the target agrees with.

- ``proposer.py``: the proposer interface (a request's tokens -> up to k draft ids) and
  ``NgramProposer`` (``--speculative-algorithm NGRAM``: prompt lookup).
- ``draft.py``: what the model proposers share: a draft KV cache of their own kept in step
  with the accepted tokens, and the greedy chain (a catch-up extend, then decodes).
- ``standalone.py``: ``StandaloneProposer`` (``STANDALONE``: a smaller model, same vocabulary).
- ``eagle.py``: EAGLE-1/2 and EAGLE-3 draft heads (checkpoint loading, forward) and
  ``EagleProposer`` (``EAGLE``, ``EAGLE3``), fed by the target's hidden states.
- ``mtp.py``: ``MtpProposer`` (``MTP``, alias ``NEXTN``): the target checkpoint's own
  multi-token-prediction layer (DeepSeek-V3, Qwen3-Next / Qwen3.5) as an EAGLE-style head.
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


def create_proposer(args: ServerArgs, runner=None, tokenizer=None) -> Proposer | None:
    """The proposer of ``--speculative-algorithm`` (None when speculation is off).

    Args:
        runner: the target's model runner (a draft model or head is built beside it).
        tokenizer: the target's tokenizer (STANDALONE checks the draft's against it).
    Raises:
        ValueError, FileNotFoundError: a draft model that does not fit the target, naming
            ``--speculative-draft-model-path``.
    """
    algo = args.speculative_algorithm
    if algo is None:
        return None
    if algo == "NGRAM":
        return NgramProposer(args.speculative_ngram_min_match_window_size,
                             args.speculative_ngram_max_match_window_size)
    if runner is None:
        raise ValueError(f"--speculative-algorithm {algo} needs the target's model runner")
    if algo == "STANDALONE":
        from engine.speculative.standalone import StandaloneProposer

        return StandaloneProposer(args, runner, tokenizer)
    if algo in ("EAGLE", "EAGLE3"):
        from engine.speculative.eagle import EagleProposer

        return EagleProposer(args, runner)
    if algo == "MTP":
        from engine.speculative.mtp import MtpProposer

        return MtpProposer(args, runner)
    raise ValueError(f"--speculative-algorithm {algo} is not implemented")


__all__ = ["NgramProposer", "Proposer", "create_proposer"]
