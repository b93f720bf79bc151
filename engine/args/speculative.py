"""Speculative decoding's flags (SGLang's names; ``engine/speculative/``) and their checks;
``ServerArgs`` takes them flat (``engine/args/fields.py``'s ``take_fields``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.args.fields import flag

#: --speculative-algorithm's choices (SGLang's names)
SPECULATIVE_ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "STANDALONE", "MTP", "NEXTN")
SPECULATIVE_BUILT = ("NGRAM", "EAGLE", "EAGLE3", "STANDALONE", "MTP")
#: SGLang's other names of an algorithm (``ServerArgs`` keeps the name on the right)
SPECULATIVE_ALIASES = {"NEXTN": "MTP"}
#: the algorithms whose drafts come from a model (a draft forward per draft token)
SPECULATIVE_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "MTP")
#: the algorithms that need --speculative-draft-model-path (MTP reads the target's own
#: checkpoint unless one is given)
SPECULATIVE_DRAFT_PATH_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
#: --speculative-num-draft-tokens when not given
DEFAULT_NUM_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class SpeculativeArgs:
    """The speculative-decoding group of ``ServerArgs`` (its fields' ``help`` is the flags')."""

    speculative_algorithm: str | None = flag(
        None, "speculative decoding: NGRAM (draft tokens copied from the request's own prompt "
              "and output, no draft model), EAGLE / EAGLE3 (a draft head over the target's "
              "hidden states), STANDALONE (a smaller model with the same vocabulary) or MTP (the "
              "target checkpoint's own multi-token-prediction layer: DeepSeek-V3, "
              "Qwen3-Next / Qwen3.5; NEXTN is an alias); unset: off", SPECULATIVE_ALGORITHMS)
    speculative_num_draft_tokens: int | None = flag(
        None, "draft tokens proposed per request and step; one verify forward scores them "
              f"all (default: {DEFAULT_NUM_DRAFT_TOKENS}; EAGLE/EAGLE3/STANDALONE: "
              "--speculative-num-steps, or that plus 1 as SGLang counts the verified token)",
        ge=1, le=64)
    speculative_num_steps: int | None = flag(
        None, "EAGLE/EAGLE3/STANDALONE/MTP: draft forwards per step, one draft token each (a "
              "chain; default: --speculative-num-draft-tokens, else "
              f"{DEFAULT_NUM_DRAFT_TOKENS})", ge=1, le=64)
    speculative_eagle_topk: int | None = flag(
        None, "EAGLE/EAGLE3/MTP: candidates per draft step (1 = a chain, the only shape "
              "built)",
        ge=1, le=64)
    speculative_draft_model_path: str | None = flag(
        None, "EAGLE, EAGLE3, STANDALONE: the draft model's checkpoint; MTP: a checkpoint "
              "holding the MTP layer's tensors under the target's names (default: the "
              "target's own)")
    speculative_ngram_min_match_window_size: int = flag(
        1, "NGRAM: shortest suffix of the request matched against its earlier tokens", ge=1)
    speculative_ngram_max_match_window_size: int = flag(
        12, "NGRAM: longest suffix matched (the longest window with a match wins; its most "
            "recent match is copied)", ge=1)
    speculative_max_batch_size: int = flag(
        8, "speculate only in decode steps of at most this many requests (larger batches "
           "are compute-bound: a step decodes one token per request)", ge=1)


def num_draft_tokens(args) -> int:
    """Draft tokens per request and speculative step (0 when speculation is off): a model
    proposer's chain is ``--speculative-num-steps`` long (one token per draft forward)."""
    if not args.speculative_algorithm:
        return 0
    if args.speculative_algorithm in SPECULATIVE_MODEL_ALGORITHMS and args.speculative_num_steps:
        return args.speculative_num_steps
    return args.speculative_num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS


def speculative_error(a) -> str | None:
    """What is wrong with the combination of --speculative-* flags of ``a`` (a
    ``ServerArgs``: its --tp-size and --nnodes too), or None."""
    algo = a.speculative_algorithm
    if algo is None:
        given = [f for f in ("speculative_num_draft_tokens", "speculative_num_steps",
                             "speculative_eagle_topk", "speculative_draft_model_path")
                 if getattr(a, f) is not None]
        if given:
            return (f"--{given[0].replace('_', '-')} needs --speculative-algorithm "
                    f"(one of {', '.join(SPECULATIVE_ALGORITHMS)})")
        return None
    if algo in SPECULATIVE_DRAFT_PATH_ALGORITHMS and not a.speculative_draft_model_path:
        return f"--speculative-algorithm {algo} needs --speculative-draft-model-path"
    if algo == "NGRAM" and a.speculative_draft_model_path:
        return ("--speculative-draft-model-path is not used by --speculative-algorithm NGRAM "
                "(it drafts from the request's own tokens)")
    if algo not in ("EAGLE", "EAGLE3", "MTP") and a.speculative_eagle_topk not in (None, 1):
        return f"--speculative-eagle-topk applies to EAGLE and EAGLE3 (and MTP), not to {algo}"
    if a.speculative_eagle_topk not in (None, 1):
        return ("--speculative-eagle-topk above 1 (a draft tree) is not built: ferry's EAGLE "
                "drafts a chain (--speculative-eagle-topk 1)")
    if algo == "NGRAM" and a.speculative_num_steps is not None:
        return ("--speculative-num-steps is not used by --speculative-algorithm NGRAM (it "
                "proposes --speculative-num-draft-tokens per step without a draft forward)")
    steps, drafts = a.speculative_num_steps, a.speculative_num_draft_tokens
    if steps is not None and drafts is not None and drafts not in (steps, steps + 1):
        return (f"--speculative-num-draft-tokens {drafts} does not fit --speculative-num-steps "
                f"{steps}: a chain of {steps} draft forwards proposes {steps} tokens (pass "
                f"{steps}, or {steps + 1} counting the verified token as SGLang does)")
    if algo in SPECULATIVE_MODEL_ALGORITHMS and (a.tp_size > 1 or a.nnodes > 1):
        return (f"--speculative-algorithm {algo} with --tp-size {a.tp_size} is not built: "
                "the draft model runs on rank 0 only (use NGRAM, or --tp-size 1)")
    if a.speculative_ngram_min_match_window_size > a.speculative_ngram_max_match_window_size:
        return ("--speculative-ngram-min-match-window-size must be <= "
                "--speculative-ngram-max-match-window-size, got "
                f"{a.speculative_ngram_min_match_window_size} > "
                f"{a.speculative_ngram_max_match_window_size}")
    if algo not in SPECULATIVE_BUILT:
        return (f"--speculative-algorithm {algo} is not implemented yet (built: "
                f"{', '.join(SPECULATIVE_BUILT)})")
    return None
