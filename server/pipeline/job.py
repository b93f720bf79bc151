"""``prepare``: a chat request checked, rendered and tokenized into a ``ChatJob``.

A ``ChatJob`` is everything the engine side of one HTTP request needs: the prompt token
ids, the ``SamplingParams``, the fan-out into engine requests with rids ``{id}-{i}``
(``n`` samples of each prompt; choice ``i = prompt * n + sample``), the LoRA adapters and
the tools/structured-output plan the answer's renderer reads. ``server/pipeline/answer.py``
runs it. Chat completions and ``/v1/responses`` both come through ``prepare``;
``/v1/completions`` builds its job from its own prompts with the same checks
(``sampling_params``, ``check_fan_out``, ``check_prompt_logprobs``, ``fan_out``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.sampling.params import SamplingParams
from engine.validation import RequestError, verify_sampling
from server.http.errors import bad_request
from server.parsers.reasoning import HarmonyReasoningParser
from server.parsers.tool_registry import get_tool_parser
from server.pipeline.prompt import chat_prompt_images
from server.pipeline.reasoning import (
    ReasoningPlan,
    plan_reasoning,
    reasoning_family,
    special_token_texts,
    token_ids,
)
from server.tokenizer_manager import TokenizerManager
from server.tools import harmony_calls, structured
from server.tools.plan import ToolPlan, prepare_chat

#: most prompt-token log-probabilities one response may carry: choices x prompt tokens x
#: (k + 1) of ``prompt_logprobs``, plus the same of completions' ``echo`` with ``logprobs``
#: (about 50 bytes of JSON each: 2**18 is some 13 MB, built on the event loop's thread)
MAX_PROMPT_LOGPROBS = 1 << 18

#: one engine request: ``(rid, prompt token ids, sampling params)``
EngineRequest = tuple[str, list[int], SamplingParams]


@dataclass
class ChatJob:
    """One HTTP request's work for the engine, ready to run (``answer``).

    Attributes:
        id: the response id (``chatcmpl-...``, ``resp_...``); the engine rids derive from it.
        prompts: the prompts' token ids (a chat request has one).
        params: the request's ``SamplingParams`` (sample 0 of each prompt runs with it).
        n: samples per prompt.
        subs: the engine requests, ``len(prompts) * n`` of them (see ``fan_out``).
        tools: the tools/structured-output plan the renderer follows (None: completions).
        lora: the adapter of every engine request (None: the base model), or one per entry
            of ``subs``.
        lora_fields: per entry of ``subs``, the body field that named its adapter.
        arrival: ``time.monotonic()`` when the HTTP request arrived (TTFT, E2E).
        reasoning: how the output splits into reasoning and content (None: it does not;
            ``server/pipeline/reasoning.py``).
        strip: special tokens the writer takes out of the text it sends (the engine keeps
            them for a parser that reads them).
        images: the prompt's images (``engine.io_struct.ImageData``; [] for none), sent
            with each engine request.
    """

    id: str
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    subs: list[EngineRequest]
    tools: ToolPlan | None = None
    lora: str | list[str | None] | None = None
    lora_fields: list[str | None] | None = None
    arrival: float = field(default_factory=time.monotonic)
    reasoning: ReasoningPlan | None = None
    strip: tuple[str, ...] = ()
    images: list = field(default_factory=list)

    @property
    def format_options(self) -> dict:
        """The chat format's keywords of this job (``reasoning``, ``strip``)."""
        return {"reasoning": self.reasoning, "strip": self.strip}

    @property
    def prompt_tokens(self) -> int:
        """Tokens over all prompts (each counted once, whatever ``n``)."""
        return sum(map(len, self.prompts))


def _wrap_int64(x: int) -> int:
    """``x`` wrapped into [-2**63, 2**63) (two's complement)."""
    return (x + 2**63) % 2**64 - 2**63


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice ``j`` (> 0) of a request seeded with ``seed``: the first 8 bytes of
    BLAKE2b over the 16 bytes of (seed mod 2**64, j) as a signed int64. Choice 0 keeps
    ``seed``."""
    if j == 0:
        return seed
    data = (seed % 2**64).to_bytes(8, "little") + j.to_bytes(8, "little")
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"ferry-n").digest(),
                       "little")
    return _wrap_int64(h)


def fan_out(base: str, prompts: list[list[int]], n: int,
            sp: SamplingParams) -> list[EngineRequest]:
    """One engine request per (prompt, sample); choice ``i = prompt * n + j``, rid ``base``
    alone for a single one, else ``{base}-{i}``.

    A seeded request gives sample ``j`` (of every prompt) the seed ``choice_seed(seed,
    j)``: sample 0 keeps the request's seed (an ``n: 1`` request is sample 0), the others
    get a hash of (seed, j), so the n samples differ, stay reproducible, and never equal
    a sample of a neighbouring seed (``seed + j`` made seed 1's sample 1 seed 2's
    sample 0).
    """
    total = len(prompts) * n
    out = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            i = p * n + j
            spj = sp
            if j and sp.seed is not None:
                spj = msgspec.structs.replace(sp, seed=choice_seed(sp.seed, j))
            out.append((base if total == 1 else f"{base}-{i}", ids, spj))
    return out


def sampling_params(req: Any, max_tokens: int | None, vocab_size: int) -> SamplingParams:
    """``req.sampling_params(max_tokens)``, verified against the vocabulary.

    Raises: APIError 400 naming the field of a bad sampling setting."""
    sp = req.sampling_params(max_tokens)
    try:
        verify_sampling(sp, vocab_size)
    except RequestError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from None
    return sp


def check_fan_out(tm: TokenizerManager, n_prompts: int, n: int) -> None:
    """400 when the request alone needs more engine requests than the server admits.

    ``n_prompts * n`` engine requests over ``running + queued`` can never be admitted
    (even an idle server would answer 503 "queue full"), so this is the client's error,
    naming ``n`` (or ``prompt`` when ``n`` is 1).
    """
    total, limit = n_prompts * n, tm.admission_limit()
    if total <= limit:
        return
    what = f"{n_prompts} prompts x n={n}" if n_prompts > 1 else f"n={n}"
    fix = "lower n" + (" or send fewer prompts" if n_prompts > 1 else "") if n > 1 \
        else "send fewer prompts per request"
    raise bad_request(f"this request needs {total} generations ({what}); this server holds "
                      f"at most {limit} at once (running plus queued requests): {fix}",
                      "n" if n > 1 else "prompt")


def check_prompt_logprobs(prompt_lens: list[int], n: int, per_token: int,
                          params: list[str]) -> None:
    """400 naming the field when the answer would carry more than ``MAX_PROMPT_LOGPROBS``
    prompt-token log-probabilities.

    Args:
        prompt_lens: tokens of each prompt. n: choices per prompt (each repeats them).
        per_token: log-probabilities per prompt token over the asked representations
            (``prompt_logprobs + 1``, plus ``logprobs + 1`` with ``echo``).
        params: the fields that asked for them, the first one named by the 400.
    """
    total = n * sum(prompt_lens) * per_token
    if per_token and total > MAX_PROMPT_LOGPROBS:
        raise bad_request(
            f"this request asks for {total} prompt-token log-probabilities (n={n} x "
            f"{sum(prompt_lens)} prompt tokens x {per_token} per token, from "
            f"{' and '.join(params)}); the limit is {MAX_PROMPT_LOGPROBS} per request: "
            "lower n or the number of alternatives, or send a shorter prompt",
            params[0], "too_many_prompt_logprobs")


def truncate_prompt(ids: list[int], req: Any, max_context: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``/``truncation_side`` of ``req`` applied to a prompt's
    token ids: at most ``k`` kept (``-1``: ``max_context``), the last ones (``left``, the
    default) or the first (``right``); ``ids`` as they are without the field.

    Raises: APIError 400 naming ``truncate_prompt_tokens`` for 0 (vLLM: -1 or at least 1)."""
    k = getattr(req, "truncate_prompt_tokens", None)
    if k is None:
        return ids
    if k == 0:
        raise bad_request("truncate_prompt_tokens must be -1 (the context length) or at "
                          "least 1", "truncate_prompt_tokens")
    k = max_context if k == -1 else k
    if len(ids) <= k:
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[len(ids) - k:]


async def prepare(tm: TokenizerManager, req: Any, *, base: str, max_tokens: int | None,
                  prompt_param: str, max_tokens_param: str | None,
                  lora: str | None = None, lora_fields: list[str | None] | None = None,
                  arrival: float | None = None) -> ChatJob:
    """Check a chat request, render and tokenize its prompt, and plan its engine requests.

    In order: the sampling settings, the tools/structured-output plan (which may constrain
    the sampling), the fan-out bound, the chat template, the context, the prompt
    log-probability bound, the reasoning split (``server/pipeline/reasoning.py``: the
    constraint then waits for the reasoning's end; special tokens kept for the parsers that
    read them).

    Args:
        tm: the engine client (its chat tokenizer, limits and admission bound).
        req: the validated chat request (``server/openai/protocol.py``'s
            ``ChatCompletionRequest``; other API families convert theirs into one).
        base: the response id the engine rids derive from.
        max_tokens: the completion's token budget as asked (None: up to the context).
        prompt_param: the field a prompt that does not fit is blamed on (``messages``,
            ``input``).
        max_tokens_param: the field the client set the budget with, None for a default.
        lora, lora_fields: the adapter (None: the base model) and the field that named it.
        arrival: ``time.monotonic()`` of the HTTP request's arrival (default: now).
    Raises:
        APIError: 400 naming the field at fault (``sampling_params``, ``prepare_chat``,
            ``check_fan_out``, ``chat_prompt``, ``TokenizerManager.check_prompt``,
            ``check_prompt_logprobs``).
    """
    sp = sampling_params(req, max_tokens, tm.vocab_size)
    tools, sp = await prepare_chat(req, sp, getattr(tm.chat.tokenizer, "chat_template", None),
                                   tm.chat.tool_call_parser)  # constraint, tools
    check_fan_out(tm, 1, req.n)
    ids, images = await chat_prompt_images(tm, req, tools)
    if images:
        if getattr(req, "truncate_prompt_tokens", None) is not None:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images",
                              "truncate_prompt_tokens")
    else:
        ids = truncate_prompt(ids, req, tm.max_context_len)
    tm.check_prompt(ids, sp.max_tokens, prompt_param, max_tokens_param=max_tokens_param,
                    min_tokens=sp.min_tokens, image_tokens=sum(im.length for im in images))
    if req.prompt_logprobs is not None:
        check_prompt_logprobs([len(ids)], req.n, req.prompt_logprobs + 1, ["prompt_logprobs"])
    reasoning, sp, strip = await _reasoning_settings(tm, req, ids, tools, sp)
    return ChatJob(base, [ids], sp, req.n, fan_out(base, [ids], req.n, sp), tools, lora,
                   lora_fields, time.monotonic() if arrival is None else arrival,
                   reasoning, strip, images)


async def _harmony_forced_call(tm: TokenizerManager, tools: ToolPlan, sp: SamplingParams,
                               ids: list[int]) -> SamplingParams:
    """A forced tool call (``tool_choice`` required or named) with the ``gpt-oss``
    reasoning parser: ``sp`` constrained by the harmony grammar of the whole output
    (``server/tools/harmony_calls.py``: optional reasoning, then the call's header, its
    arguments' JSON and ``<|call|>``) in place of the arguments' JSON, and ``tools.parser``
    set to ``gpt-oss``, which reads the call as with ``auto``.

    Raises: APIError 400 naming ``tool_choice`` when it cannot work: a tokenizer without
        harmony's markers as single tokens, or a prompt that does not end with the
        assistant's header (``<|start|>assistant``: ``add_generation_prompt`` off,
        ``continue_final_message``).
    """
    tok = tm.chat.tokenizer
    markers = harmony_calls.marker_ids(tok) if tok is not None else None
    if markers is None:
        raise bad_request(f"tool_choice {tools.choice!r} with the gpt-oss reasoning parser "
                          "needs harmony's markers as single tokens of the tokenizer",
                          "tool_choice")
    start = token_ids(tok, harmony_calls.ASSISTANT_START) or []
    if not start or ids[-len(start):] != start:
        raise bad_request(f"tool_choice {tools.choice!r} with the gpt-oss reasoning parser "
                          "needs a prompt that ends with the assistant's header "
                          f"({harmony_calls.ASSISTANT_START!r}); use tool_choice \"auto\"",
                          "tool_choice")
    budget = harmony_calls.reasoning_budget(sp.max_tokens)
    ebnf = await asyncio.to_thread(harmony_calls.forced_call_ebnf, tools, markers, budget)
    tools.parser = "gpt-oss"
    return structured.with_constraint(sp, "ebnf", ebnf)


async def _reasoning_settings(tm: TokenizerManager, req: Any, ids: list[int], tools: ToolPlan,
                              sp: SamplingParams
                              ) -> tuple[ReasoningPlan | None, SamplingParams, tuple[str, ...]]:
    """The reasoning plan of a chat request, its ``SamplingParams`` with the constraint set
    to wait for the reasoning's end and special tokens kept for parsers that read them, and
    the special tokens the writer strips (``server/pipeline/reasoning.py``)."""
    reasoning, think_end, special = await plan_reasoning(tm, req, ids)
    if tools.choice in ("required", "named") and reasoning_family(tm.chat) == "gpt-oss":
        sp = await _harmony_forced_call(tm, tools, sp, ids)
        think_end = None  # constrained from the first token
    tool_parser = None
    if tools.parser is not None:
        try:
            tool_parser = get_tool_parser(tools.parser)
        except KeyError:
            pass
        else:
            special = special or tool_parser.needs_special_tokens
    if reasoning is not None and isinstance(reasoning.parser, HarmonyReasoningParser):
        # the call messages stay as written only for the gpt-oss tool parser to read
        reasoning.parser.keep_calls = getattr(tool_parser, "name", None) == "gpt-oss"
    if think_end is not None and (sp.json_schema or sp.regex or sp.ebnf) is not None:
        sp = msgspec.structs.replace(sp, think_end_ids=think_end) if isinstance(think_end, list) \
            else msgspec.structs.replace(sp, think_end_id=think_end)
    strip: tuple[str, ...] = ()
    if special and sp.skip_special_tokens:
        sp = msgspec.structs.replace(sp, skip_special_tokens=False)
        strip = special_token_texts(tm.chat.tokenizer)
    return reasoning, sp, strip
