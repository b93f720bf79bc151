"""``SamplingParams``: the per-request generation settings, sent to the engine as msgpack.

Field meanings follow OpenAI and vLLM. ``verify`` is the one place where the engine-side
bounds live; the HTTP layer's pydantic models hold the same bounds for a 400 with ``param``.
"""

from __future__ import annotations

import msgspec

from engine.sampling.stops import compile_patterns

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_TRIGGER_TOKENS = 64  # token ids of a grammar release trigger (think_end_ids)
MAX_GRAMMAR_CHARS = 1 << 18  # characters of one json_schema / regex / ebnf constraint


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Generation settings of one request.

    temperature 0 means greedy. ``top_k`` of -1 or 0 disables top-k. ``max_tokens`` None
    means "up to the context length". ``seed`` makes a sampled request reproducible whatever
    else is in the batch.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    # SGLang's regular-expression stops (engine/sampling/stops.py): the text ends before the
    # first match, matched_stop names the pattern
    stop_regex: list[str] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None          # top-k logprobs per generated token (0 = chosen only)
    prompt_logprobs: int | None = None   # same, for prompt tokens (echo)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # constrained decoding (SGLang's names; engine/sampling/grammar.py): at most one of a JSON
    # schema (as a JSON string), a regex or an xgrammar EBNF grammar with a ``root`` rule
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # constrain only after the reasoning (SGLang's think_end_id): with a constraint, no mask
    # applies until this token id (the model's end-of-thinking tag) has been generated;
    # None: the constraint applies from the first output token
    think_end_id: int | None = None
    # the same trigger as a token sequence (gpt-oss: the final channel's header): no mask
    # until these ids have been generated in a row (a partial match followed by another
    # token starts over; the prompt's last tokens count toward it); at most one of the two
    think_end_ids: list[int] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        """Check bounds.

        Raises:
            ValueError: ``(message, param)`` in ``args``; ``param`` names the bad field.
        """

        def bad(msg: str, param: str):
            raise ValueError(msg, param)

        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            bad("min_tokens must be >= 0", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens must not exceed max_tokens", "min_tokens")
        if not (0.0 <= self.temperature <= 2.0):
            bad(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1 or (vocab_size is not None and self.top_k > vocab_size):
            bad(f"top_k must be -1, 0 or in [1, vocab_size], got {self.top_k}", "top_k")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty must be in [-2, 2]", "presence_penalty")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty must be in [-2, 2]", "frequency_penalty")
        if not (0.0 < self.repetition_penalty <= 2.0):
            bad("repetition_penalty must be in (0, 2]", "repetition_penalty")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_LEN:
                bad(f"each stop string must have 1..{MAX_STOP_LEN} characters", "stop")
        if len(self.stop_regex) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop_regex patterns", "stop_regex")
        for p in self.stop_regex:
            if not p or len(p) > MAX_STOP_LEN:
                bad(f"each stop_regex pattern must have 1..{MAX_STOP_LEN} characters",
                    "stop_regex")
        if self.stop_regex and self.min_tokens:
            bad("stop_regex cannot be combined with min_tokens", "stop_regex")
        compile_patterns(self.stop_regex)  # ValueError naming stop_regex
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop_token_ids", "stop_token_ids")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad(f"at most {MAX_LOGIT_BIAS} logit_bias entries", "logit_bias")
        for tid, b in self.logit_bias.items():
            if not (-100.0 <= b <= 100.0):
                bad("logit_bias values must be in [-100, 100]", "logit_bias")
            if vocab_size is not None and not (0 <= tid < vocab_size):
                bad(f"logit_bias token id {tid} is outside the vocabulary", "logit_bias")
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                if not (0 <= tid < vocab_size):
                    bad(f"stop token id {tid} is outside the vocabulary", "stop_token_ids")
        if self.think_end_id is not None and vocab_size is not None \
                and not (0 <= self.think_end_id < vocab_size):
            bad("think_end_id is outside the vocabulary", "think_end_id")
        if self.think_end_ids is not None:
            if self.think_end_id is not None or not self.think_end_ids \
                    or len(self.think_end_ids) > MAX_TRIGGER_TOKENS:
                bad(f"think_end_ids must have 1..{MAX_TRIGGER_TOKENS} ids and think_end_id "
                    "must not be set with it", "think_end_ids")
            if vocab_size is not None and not all(0 <= t < vocab_size
                                                  for t in self.think_end_ids):
                bad("think_end_ids has an id outside the vocabulary", "think_end_ids")
        given = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            bad(f"set at most one constraint, got {' and '.join(given)}", given[1])
        for name in given:
            if len(getattr(self, name)) > MAX_GRAMMAR_CHARS:
                bad(f"{name} must have at most {MAX_GRAMMAR_CHARS} characters", name)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (0 <= v <= MAX_LOGPROBS):
                bad(f"{name} must be in [0, {MAX_LOGPROBS}]", name)
