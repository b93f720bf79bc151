"""``OutputProcessor``: the result side of a scheduler step. It reads a launched step's sampled
ids back, appends them to their requests, records logprobs, prompt logprobs and TTFT, checks
stop conditions (EOS, stop token ids, stop strings and regexes, ``max_tokens``, the context)
and collects each request's ``StepOutput`` for the detokenizer. A speculative verify step's
accepted runs (``engine/speculative/worker.py``) come in through ``emit_run``.
``Scheduler`` (``scheduler.py``) owns one and calls it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.executor.schedule_batch import ScheduleBatch
from engine.scheduler.grammar_queue import grammar_finish
from engine.scheduler.request import FinishReason, Req


class StepOutput:
    """What one step produced for one request: new tokens (possibly none) and its finish."""

    __slots__ = ("req", "new_token_ids", "finished_reason", "pooled")

    def __init__(self, req: Req, new_token_ids: list[int], finished_reason: FinishReason | None,
                 pooled: list[float] | None = None):
        self.req = req
        self.new_token_ids = new_token_ids
        self.finished_reason = finished_reason
        self.pooled = pooled  # a pooling request's answer (an embedding or a score)


#: TTFT parts summed over requests (``Scheduler.stats``, reported by /server_info): seconds
#: from the server's arrival to the scheduler's receipt (HTTP, tokenization, IPC), and from
#: the receipt to the first token read back on the host (waiting, prefill, sampling)
STATS_TTFT_ZERO = {"first_tokens": 0, "ttft_queue_s_sum": 0.0, "ttft_engine_s_sum": 0.0}


class OutputProcessor:
    """Turns a finished step into request state and ``StepOutput`` s.

    Args:
        tokenizer: decodes the output's tail for stop strings and regexes (None: those are
            not checked).
        eos_ids: token ids that end generation unless ``ignore_eos``.
        max_context_len: the runner's context limit (tokens); a request ends there.
        stats: the scheduler's stats dict (``generation_tokens`` and the TTFT sums of
            ``STATS_TTFT_ZERO``).
        finish: the scheduler's ``(req, reason)`` callback that ends a request (frees its KV
            and adapter).
    """

    def __init__(self, tokenizer, eos_ids: list[int], max_context_len: int, stats: dict,
                 finish: Callable[[Req, FinishReason], None]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_context_len = max_context_len
        self.stats = stats
        self.finish = finish
        self.outputs: list[StepOutput] = []  # since the last ``take``

    def take(self) -> list[StepOutput]:
        """The outputs collected since the last call (and forget them)."""
        out, self.outputs = self.outputs, []
        return out

    def pooled(self, req: Req, answer: list[float]) -> None:
        """Report ``req``, a pooling request that ended with ``answer``."""
        self.outputs.append(StepOutput(req, [], req.finished_reason, answer))

    def aborted(self, req: Req) -> None:
        """Report ``req``, ended by an abort, with no new tokens."""
        self.outputs.append(StepOutput(req, [], req.finished_reason))

    def prompt_logprobs(self, batch: ScheduleBatch, logits, rows) -> None:
        """Log-probabilities of the prompt tokens (echo): the logits at position j score
        prompt token j + 1. Each entry is ``(logprob, [[id, logprob], ...top k], rank)``:
        the top-k alternatives (k = prompt_logprobs) and the prompt token's own rank in the
        vocabulary (1 + the tokens more likely than it; vLLM's ``rank``), top k or not."""
        import torch

        for i, req in enumerate(batch.reqs):
            if not batch.all_rows[i]:
                continue
            r0, n = rows[i]
            p = batch.prefix_lens[i]
            prompt = req.origin_input_ids
            m = min(n, len(prompt) - 1 - p)  # rows whose next token is still in the prompt
            skip = len(req.prompt_logprobs) - 1 - p  # rows done before a preemption
            if skip < 0 or m - skip <= 0:
                continue
            k = req.sampling_params.prompt_logprobs
            for a in range(r0 + skip, r0 + m, 128):  # 128 rows of log-softmax at a time
                b = min(a + 128, r0 + m)
                lp = torch.log_softmax(logits[a:b].float(), dim=-1)
                nxt = torch.tensor(prompt[p + 1 + a - r0: p + 1 + b - r0], device=lp.device)
                chosen_t = lp.gather(1, nxt[:, None])
                ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
                chosen = chosen_t[:, 0].tolist()
                if k:
                    top_lp, top_id = lp.topk(k, dim=-1)
                    top = [[[x, y] for x, y in zip(ids, lps)]
                           for ids, lps in zip(top_id.tolist(), top_lp.tolist())]
                else:
                    top = [[] for _ in range(b - a)]
                req.prompt_logprobs.extend(zip(chosen, top, ranks))

    def process(self, rec: _InFlight) -> bool:
        """Read a launched step back into its requests; True when one of them finished."""
        ids, lp = rec.result.host()
        now = time.time()
        any_finished = False
        for req, idx, k in rec.slots:
            if req.finished:
                continue  # aborted, or finished one step earlier while this step was in flight
            tok = ids[k]
            req.output_ids[idx] = tok
            self.stats["generation_tokens"] += 1
            if lp is not None and req.sampling_params.logprobs is not None:
                top = req.sampling_params.logprobs
                tops = [[lp[1][k][j], lp[2][k][j]] for j in range(top)] if lp[1] else []
                req.logprobs.append((lp[0][k], tops))
            if req.first_token_time is None:
                self._first_token(req, now)
            reason = self.check_finished(req, tok, idx + 1)
            if reason is not None:
                del req.output_ids[idx + 1:]  # a placeholder of a step launched after this one
                self.finish(req, reason)
                any_finished = True
            self.outputs.append(StepOutput(req, [tok], reason))
        return any_finished

    def _first_token(self, req: Req, now: float) -> None:
        req.first_token_time = now
        st = self.stats
        st["first_tokens"] += 1
        st["ttft_queue_s_sum"] += max(0.0, req.recv_time - req.arrival_time)
        st["ttft_engine_s_sum"] += now - req.recv_time

    def emit_run(self, req: Req, toks: list[int], logprobs: list | None) -> None:
        """Append a verify step's run of tokens (speculative decoding) with the stop checks
        after each: a stop inside the run cuts it there, and ``max_tokens`` is never passed."""
        if req.finished:
            return
        if req.first_token_time is None:
            self._first_token(req, time.time())
        reason, n = None, 0
        for n, tok in enumerate(toks, 1):
            req.output_ids.append(tok)
            if logprobs is not None:
                req.logprobs.append(logprobs[n - 1])
            reason = self.check_finished(req, tok, len(req.output_ids))
            if reason is not None:
                break
        self.stats["generation_tokens"] += n
        if reason is not None:
            self.finish(req, reason)
        self.outputs.append(StepOutput(req, toks[:n], reason))

    def check_finished(self, req: Req, tok: int, n_out: int) -> FinishReason | None:
        """Stop conditions after the ``n_out``-th generated token ``tok``.

        EOS, stop token ids and stop strings count only from the ``min_tokens``-th token on;
        a stop string counts where it ends in the text this token completes (an occurrence
        that ended earlier, before ``min_tokens``, stays part of the text), which is where
        the detokenizer cuts the text, so usage counts exactly the tokens behind the text.
        """
        sp = req.sampling_params
        if req.grammar is not None and (done := grammar_finish(req, tok)) is not None:
            return done
        if n_out >= sp.min_tokens:
            if tok in sp.stop_token_ids:
                return FinishReason("stop", matched=tok)
            if not sp.ignore_eos and tok in self.eos_ids:
                return FinishReason("stop", matched=tok)
            if req.stop_window and self.tokenizer is not None:
                start = max(0, n_out - req.stop_window)
                tail = self._stop_text(req.output_ids[start:n_out], sp)
                # what the window held before this token: a match must end beyond it
                before = len(self._stop_text(req.output_ids[start:n_out - 1], sp))
                # the stop string that cuts the text is the one that starts first (as the
                # detokenizer cuts), not the first of the list
                hits = [(i, k) for k, s in enumerate(sp.stop)
                        if (i := tail.find(s, max(0, before - len(s) + 1))) != -1]
                if hits:
                    return FinishReason("stop", matched=sp.stop[min(hits)[1]])
            if sp.stop_regex and self.tokenizer is not None:
                if (done := self._stop_regex(req, n_out)) is not None:
                    return done
        if n_out >= req.max_new_tokens:
            return FinishReason("length")
        if len(req.origin_input_ids) + n_out >= self.max_context_len:
            return FinishReason("length")
        return None

    def _stop_regex(self, req: Req, n_out: int) -> FinishReason | None:
        """``stop`` naming the pattern when the text of the first ``n_out`` generated tokens
        holds a ``stop_regex`` match: the detokenizer's own incremental state
        (``IncrementalDetokenizer``) fed the same tokens, so both stop at the same token and
        cut the text at the same place."""
        from engine.tokenizer.detokenizer import IncrementalDetokenizer

        sp = req.sampling_params
        st = req.stop_regex_state
        if st is None:
            st = req.stop_regex_state = IncrementalDetokenizer(
                self.tokenizer, None, sp.skip_special_tokens, sp.spaces_between_special_tokens,
                stop_regex=sp.stop_regex)
        if n_out > len(st.ids):
            st.step(req.output_ids[len(st.ids):n_out])
        return FinishReason("stop", matched=st.matched_regex) if st.stopped else None

    def _stop_text(self, ids: list[int], sp) -> str:
        """The text of ``ids`` as the stop-string check sees it: the window may start or end
        inside a multi-byte character, whose pieces decode to U+FFFD, text the detokenizer
        never shows (a leading partial character is trimmed, a trailing one dropped)."""
        if not ids:
            return ""
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        return text.strip("\ufffd")


class _InFlight:
    """A launched step: its sample result and (req, output index, sampled row) per request."""

    __slots__ = ("result", "slots")

    def __init__(self, result, slots):
        self.result = result
        self.slots = slots
