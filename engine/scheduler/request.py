"""``Req``, one generation request inside the engine, and ``FinishReason``."""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.sampling.params import SamplingParams


@dataclass
class FinishReason:
    """Why a request ended: ``stop`` (EOS, stop token or stop string), ``length`` or ``abort``.

    ``matched`` is the stop string (str) or token id (int) that ended it, else None.
    """

    type: str
    matched: str | int | None = None
    message: str | None = None

    def to_dict(self) -> dict:
        return {"type": self.type, "matched": self.matched, "message": self.message}


class Req:
    """A request's host-side state.

    KV bookkeeping: ``req_pool_idx`` is its row in ``req_to_token``; ``pages`` are the KV pages
    it holds, in position order; ``kv_len`` is how many of ``fill_ids`` already have K/V in the
    pool. A preempted request gives its KV to the prefix cache (``kv_len = 0``) and on
    readmission recomputes what the cache no longer holds.
    """

    __slots__ = ("rid", "origin_input_ids", "sampling_params", "stream", "output_ids",
                 "req_pool_idx", "pages", "kv_len", "finished_reason", "sent_len",
                 "arrival_time", "recv_time", "scheduled_time", "first_token_time",
                 "max_new_tokens",
                 "stop_window", "cached_pages", "last_node", "cached_tokens", "prompt_counted",
                 "logprobs", "sent_logprobs", "prompt_logprobs", "prompt_logprobs_sent",
                 "grammar", "lora_id", "stop_regex_state", "pooling", "pool_state",
                 "swa_pages", "swa_lo", "state_slot", "mm", "key_prompt", "state_snaps",
                 "snap_branch")

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams,
                 stream: bool = False, max_new_tokens: int | None = None,
                 arrival_time: float | None = None, lora_id: int | None = None):
        self.rid = rid
        # the LoRA adapter (engine.lora.manager.LoRAManager id; None: the base model)
        self.lora_id = lora_id
        # a pooling request (embedding, score): prefill only, answered with ``pool_state``
        # folded by the pooler (engine/layers/pooler.py), never sampled
        self.pooling = False
        self.pool_state = None
        self.origin_input_ids = input_ids
        self.sampling_params = sampling_params
        self.stream = stream
        self.output_ids: list[int] = []
        self.req_pool_idx: int | None = None
        # the slot of its linear-attention layers' states (engine/kv/state_pool.py), or None
        self.state_slot: int | None = None
        # its snapshots of those states not yet in the radix tree, ``(boundary, snapshot)``
        # (engine/kv/state_snapshots.py), and the branching point of its last match, where
        # its prefill stops to leave one (0: none)
        self.state_snaps: list[tuple[int, int]] = []
        self.snap_branch = 0
        self.pages: list[int] = []
        self.kv_len = 0
        # prefix cache: the first ``cached_pages`` of ``pages`` belong to the radix tree,
        # locked through ``last_node``; ``cached_tokens`` is the prompt prefix found cached at
        # its first admission (reported in usage), None before it
        self.cached_pages = 0
        self.last_node = None
        # windowed layers (engine/kv/windowed.py): the windowed pages parallel to ``pages``
        # (0: freed behind the window), and the first of its own not yet freed
        self.swa_pages: list[int] = []
        self.swa_lo = 0
        self.cached_tokens: int | None = None
        # prompt positions already counted in the prompt_tokens stat (a preempted request
        # recomputes its prompt without counting it again)
        self.prompt_counted = 0
        self.finished_reason: FinishReason | None = None
        self.sent_len = 0
        # wall-clock seconds (time.time(), comparable across the server and engine
        # processes): arrival at the server, receipt by the scheduler, first admission into
        # a batch (None while waiting), first token read back
        self.recv_time = time.time()
        self.arrival_time = arrival_time or self.recv_time
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.max_new_tokens = max_new_tokens if max_new_tokens is not None else (
            sampling_params.max_tokens or 1 << 30)
        # how many trailing output tokens to decode when looking for stop strings: a stop string
        # of L characters spans at most 4L byte-level tokens (plus one for a merge at its edge)
        longest = max((len(s) for s in sampling_params.stop), default=0)
        self.stop_window = 4 * longest + 2 if longest else 0
        self.logprobs: list = []
        self.sent_logprobs = 0
        # echo: one entry per prompt token (None for the first), filled during prefill
        self.prompt_logprobs: list | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        # the constraint's matcher (engine/sampling/grammar.py), set once it is compiled
        self.grammar = None
        # stop_regex: the output's incremental text and pattern matching, the detokenizer's
        # own (engine/sampling/stops.py); made at the first generated token
        self.stop_regex_state = None
        # images (engine/mm_inputs.py MMInputs) and the prompt as the prefix cache keys it
        # (image tokens replaced by their image's hash value); None: a text-only request
        self.mm = None
        self.key_prompt: list[int] | None = None

    def set_images(self, mm) -> None:
        """Attach the request's images (an ``engine.mm_inputs.MMInputs``): its prefix-cache
        key then names each image by its content (``engine.mm_inputs.key_ids``)."""
        from engine.mm_inputs import key_ids

        self.mm = mm
        self.key_prompt = key_ids(self.origin_input_ids, mm.items)

    @property
    def fill_ids(self) -> list[int]:
        """Prompt plus generated tokens: what the KV cache must hold."""
        return self.origin_input_ids + self.output_ids

    def token_at(self, pos: int) -> int:
        """``fill_ids[pos]`` without building the concatenated list."""
        n = len(self.origin_input_ids)
        return self.origin_input_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, start: int, count: int) -> list[int]:
        """``fill_ids[start:start + count]`` without building the concatenated list."""
        n = len(self.origin_input_ids)
        end = start + count
        if end <= n:
            return self.origin_input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n: end - n]
        return self.origin_input_ids[start:] + self.output_ids[: end - n]

    def key_tokens(self, start: int, count: int) -> list[int]:
        """``tokens(start, count)`` as the prefix cache keys them: an image's tokens are its
        content-hash value (``engine.mm_inputs.pad_value``), the rest their ids."""
        if self.key_prompt is None:
            return self.tokens(start, count)
        n = len(self.key_prompt)
        end = start + count
        if end <= n:
            return self.key_prompt[start:end]
        if start >= n:
            return self.output_ids[start - n: end - n]
        return self.key_prompt[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def queue_time(self) -> float | None:
        """Seconds from the scheduler's receipt to the first admission into a batch (its
        grammar's compilation and the waiting queue), None while it waits."""
        if self.scheduled_time is None:
            return None
        return max(0.0, self.scheduled_time - self.recv_time)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.origin_input_ids))

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, "
                f"out={len(self.output_ids)}, kv={self.kv_len})")
