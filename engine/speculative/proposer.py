"""Draft-token proposers: given a request's tokens, guess the next few.

Every proposer answers one question per request, ``propose(tokens, k)``: up to ``k`` token
ids that probably follow ``tokens`` (the request's prompt plus output). The verify step
(``engine/speculative/worker.py``) scores them all with one target forward and keeps the
run the target agrees with, so a bad guess costs compute, never correctness.

``NgramProposer`` (prompt-lookup decoding, Saxena 2023; SGLang's and vLLM's NGRAM): find
the most recent earlier occurrence of the request's last ``n`` tokens, for ``n`` from the
max window down to the min, and propose what followed it. The copy may run into the tokens
it is proposing (an LZ77-style self-overlapping copy), so a repeating period shorter than
``k`` still yields ``k`` drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Proposer:
    """The proposer interface: draft tokens per request, from its own tokens."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft ids to follow ``tokens`` (prompt + output); [] for none."""
        raise NotImplementedError

    def propose_batch(self, token_lists: list[Sequence[int]], ks: list[int]) -> list[list[int]]:
        """``propose`` for each request of a step."""
        return [self.propose(t, k) if k > 0 else [] for t, k in zip(token_lists, ks)]

    def propose_reqs(self, reqs: list, ks: list[int]) -> list[list[int]]:
        """Drafts for the running requests of a verify step, up to ``ks[i]`` for request i
        (what the verify step calls; a proposer with a model and per-request state, such
        as its KV, works here on the ``Req`` objects)."""
        return self.propose_batch([r.fill_ids if k > 0 else () for r, k in zip(reqs, ks)], ks)

    def observe(self, batch) -> None:
        """A target forward over ``batch`` (a ``ScheduleBatch``) just ran: an EAGLE head
        takes the hidden states it left (``CausalLM.hidden_out``); others ignore it."""

    def trim(self, req, valid_len: int) -> None:
        """After a verify step, positions ``< valid_len`` of ``req`` hold accepted tokens:
        a proposer with its own KV drops what it drafted past them."""


class NgramProposer(Proposer):
    """Prompt lookup: copy what followed the latest earlier match of the request's suffix.

    Args:
        min_window, max_window: shortest and longest suffix matched (tokens); the longest
            window that has a match wins, and of its matches the most recent one.
    Cost: one vectorised pass over the tokens per step (numpy), O(len(tokens) * max_window)
    at worst, ~10 us for a few thousand tokens.
    """

    def __init__(self, min_window: int = 1, max_window: int = 12):
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, "
                             f"{max_window}")
        self.min_window = min_window
        self.max_window = max_window

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """``(end, n)``: the longest suffix length ``n`` in the window bounds that occurred
        earlier, and the position just past its most recent earlier occurrence (what
        followed it starts there); ``(-1, 0)`` without one."""
        arr = np.asarray(tokens, dtype=np.int64)
        L = arr.shape[0]
        if L < self.min_window + 1:
            return -1, 0
        # candidates: positions j < L - 1 holding the last token (a match's last position)
        cand = np.flatnonzero(arr[:L - 1] == arr[L - 1])
        if cand.size == 0:
            return -1, 0
        # grow the match backwards while the tokens agree with the suffix, up to max_window
        length = np.ones(cand.size, dtype=np.int64)
        alive = np.ones(cand.size, dtype=bool)
        for m in range(1, min(self.max_window, L - 1)):
            pos = cand - m
            ok = alive & (pos >= 0)
            ok[ok] = arr[pos[ok]] == arr[L - 1 - m]
            alive = ok
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_window:
            return -1, 0
        j = int(cand[np.flatnonzero(length == best)[-1]])  # the most recent longest match
        return j + 1, best

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        start, _ = self.match(tokens)
        if start < 0:
            return []
        L = len(tokens)
        out: list[int] = []
        for t in range(k):  # a self-overlapping copy: past the end, copy the copy
            src = start + t
            out.append(int(tokens[src]) if src < L else out[src - L])
        return out
