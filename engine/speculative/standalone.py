"""``StandaloneProposer`` (``--speculative-algorithm STANDALONE``): a smaller model with the
target's vocabulary drafts the chain, greedily, with its own KV cache.

The draft model is a second ``ModelRunner`` on the same device (same dtype, page size and
attention backend; its pool holds what a speculative step's requests can, at most the
target's token count: ``draft_pool_tokens``), built from
``--speculative-draft-model-path``. Its vocabulary must be the target's: the same
``vocab_size`` and, where both directories ship a tokenizer, the same token -> id map
(checked at start-up, :func:`check_same_vocabulary`).
"""

from __future__ import annotations

import logging

import torch

from engine.args import ServerArgs, num_draft_tokens, prefill_budget
from engine.speculative.draft import DraftSeq, ModelProposer, draft_pool_tokens

logger = logging.getLogger(__name__)


def draft_args(args: ServerArgs, max_total_tokens: int) -> ServerArgs:
    """The target's ``args`` turned into the draft model's: its path, no speculation of its
    own, a KV pool of ``max_total_tokens``."""
    return args.replace(model_path=args.speculative_draft_model_path,
                        speculative_algorithm=None, speculative_draft_model_path=None,
                        speculative_num_draft_tokens=None, speculative_num_steps=None,
                        speculative_eagle_topk=None, max_total_tokens=max_total_tokens,
                        quantization=None, tokenizer_path=None)


def check_same_vocabulary(target_vocab: int, draft_vocab: int, target_tokenizer,
                          draft_path: str) -> None:
    """Raise ``ValueError`` naming ``--speculative-draft-model-path`` unless the draft speaks
    the target's vocabulary (its ``vocab_size``; the tokenizers' maps where both exist)."""
    if draft_vocab != target_vocab:
        raise ValueError(f"--speculative-draft-model-path {draft_path}: the draft model's "
                         f"vocabulary has {draft_vocab} ids, the target's {target_vocab}; "
                         "STANDALONE needs a draft with the target's tokenizer")
    if target_tokenizer is None:
        return
    from engine.tokenizer.tokenizer import load_tokenizer

    try:
        draft_tok = load_tokenizer(draft_path)
    except Exception:  # a draft directory without a tokenizer: the sizes matched
        logger.info("draft model %s has no tokenizer of its own: vocabulary checked by size",
                    draft_path)
        return
    if draft_tok.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"--speculative-draft-model-path {draft_path}: the draft's tokenizer "
                         "maps tokens to other ids than the target's; STANDALONE needs the "
                         "same tokenizer")


class StandaloneProposer(ModelProposer):
    """Greedy chains from a draft ``ModelRunner`` (see the module docstring).

    Args:
        args: the server arguments (the draft path, the prefill budget).
        target: the target's runner (device, pool size, vocabulary).
        tokenizer: the target's tokenizer (the vocabulary check), or None.
    Raises:
        ValueError: the draft's vocabulary differs from the target's.
    """

    def __init__(self, args: ServerArgs, target, tokenizer=None):
        from engine.executor.model_runner import ModelRunner

        self.runner = ModelRunner(draft_args(args, draft_pool_tokens(args, target)))
        check_same_vocabulary(target.vocab_size, self.runner.vocab_size, tokenizer,
                              args.speculative_draft_model_path)
        super().__init__(self.runner.kv_pool, self.runner.req_to_token_pool,
                         prefill_budget(args, target.device_type))
        self.k = num_draft_tokens(args)
        logger.info("STANDALONE draft model %s: %d layers, KV pool of %d tokens",
                    args.speculative_draft_model_path, self.runner.num_layers,
                    self.runner.max_total_tokens)

    def catch_up(self, seq: DraftSeq, req):
        """The request's tokens the draft has no KV for, up to and including its last one;
        KV of tokens that are no longer the request's (a cut run) is dropped first. None
        (and its KV freed) once the chain would run past the draft model's context."""
        L = req.seq_len
        if L + self.k > self.runner.max_context_len:  # past the draft model's context
            self.drop(req.rid)
            return None
        e = min(seq.kv_len, L - 1)
        if e and seq.ids[:e] != req.tokens(0, e):
            e = next(i for i, (a, b) in enumerate(zip(seq.ids, req.tokens(0, e))) if a != b)
        self.truncate(seq, e)
        return req.tokens(e, L - e), None

    def forward(self, batch, seqs, hidden):
        logits = self.runner.forward(batch)
        return torch.argmax(logits, dim=-1), None
