"""The generation endpoints (``/v1/completions``, ``/v1/chat/completions``); the tokenizer
endpoints are in ``server/openai/tokens.py``.

Each generation handler validates the body, tokenizes (chat template for chat), fans ``n``
and several prompts out into engine requests with rids ``{id}-{i}``, and answers either one
JSON body or an SSE stream of OpenAI chunks ending in ``data: [DONE]`` (the shapes live in
``server/openai/formats.py``). A stream's first output is awaited before the response starts, so an
engine rejection is still a plain HTTP error; after that an error becomes a final
``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import suppress
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.sampling.params import SamplingParams
from engine.validation import RequestError, verify_sampling
from server.http.errors import APIError, bad_request, http_error
from server.http.request_id import request_id_of
from server.openai.extensions import adopt_body_id
from server.openai.formats import BaseFormat, CompletionFormat, LogprobOptions
from server.openai.logprobs import TokenStrings
from server.openai.lora_choice import adapter_of_model, adapters_of_request, fields_of, shown_model
from server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from server.openai.tokens import chat_prompt
from server.openai.tool_format import chat_format
from server.tokenizer_manager import ReqOutput, TokenizerManager
from server.tools import structured
from server.tools.plan import prepare_chat

logger = logging.getLogger("ferry.server")

DONE = "data: [DONE]\n\n"

#: most prompt-token log-probabilities one response may carry: choices x prompt tokens x
#: (k + 1) of ``prompt_logprobs``, plus the same of completions' ``echo`` with ``logprobs``
#: (about 50 bytes of JSON each: 2**18 is some 13 MB, built on the event loop's thread)
MAX_PROMPT_LOGPROBS = 1 << 18

#: default seconds a client has to send the whole request body (headers already in); a
#: client that stalls gets a 408 and the connection is closed (``--body-read-timeout``)
BODY_READ_TIMEOUT_S = 30.0


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


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


def sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


async def _read_body(request: Request, max_bytes: int) -> bytearray:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise http_error(413, f"the request body is larger than {max_bytes} bytes")
    return body


def check_json_content_type(value: str | None) -> None:
    """Raises: APIError 415 unless ``value`` (a Content-Type header) is application/json."""
    media = (value or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"'{value}'" if value else "none"
        raise APIError(f"the request body must be JSON sent with 'Content-Type: "
                       f"application/json' (got {got})", 415, None,
                       "unsupported_media_type")


async def read_json(request: Request, max_bytes: int,
                    timeout_s: float | None = None) -> Any:
    """The decoded JSON body.

    Args:
        request: the request (its body not read yet).
        max_bytes: the largest accepted body.
        timeout_s: seconds the whole body may take to arrive (default BODY_READ_TIMEOUT_S).
    Raises:
        APIError: 413 if the body exceeds ``max_bytes`` (by Content-Length or as received);
            415 unless ``Content-Type`` is ``application/json`` (parameters such as
            ``charset=utf-8`` allowed; a missing type is refused too: browsers send
            ``text/plain`` and untyped bodies cross-origin without a CORS preflight);
            408 (``Connection: close``) if it has not all arrived within ``timeout_s``;
            400 if it is empty, not strict JSON (NaN, invalid UTF-8 and lone surrogates are
            refused: the tokenizer cannot take them) or nested deeper than the decoder
            allows (about 1000 levels). Decoding raises nothing else.
    """
    check_json_content_type(request.headers.get("content-type"))
    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.isascii() or not cl.strip().isdigit():
            raise bad_request("invalid Content-Length header")
        if int(cl) > max_bytes:
            raise http_error(413, f"the request body is larger than {max_bytes} bytes")
    timeout_s = BODY_READ_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            body = await _read_body(request, max_bytes)
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout_s:g} s", 408, None,
                       "request_timeout", headers={"Connection": "close"}) from None
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:  # strict JSON: no NaN/Infinity, valid UTF-8, no lone surrogates
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - whatever the decoder raises, the body is bad
        raise bad_request(f"the request body could not be decoded ({type(exc).__name__})"
                          ) from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, coro: Coroutine) -> Any:
    """Run ``coro`` but cancel it if the client disconnects first.

    Raises:
        ClientGone: the client left (``coro`` was cancelled; its ``finally`` blocks ran).
    """
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however the stream ends (disconnect too)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class OpenAIServing:
    """Handlers of the generation endpoints.

    Args:
        tm: the ``TokenizerManager``.
        args: the ``ServerArgs``.
        model_name: the served model name (``/v1/models`` id, ``model`` of responses).
    """

    def __init__(self, tm: TokenizerManager, args, model_name: str):
        self.tm = tm
        self.args = args
        self.model_name = model_name
        self._strings: TokenStrings | None = None

    @property
    def strings(self) -> TokenStrings:
        """Per-token strings for logprobs (built on first use: the tokenizer is set late)."""
        if self._strings is None or self._strings.tokenizer is not self.tm.tokenizer:
            self._strings = TokenStrings(self.tm.tokenizer)
        return self._strings

    # ---- shared checks ------------------------------------------------------------------
    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a body's ``model`` names (vLLM's ``"name"``, SGLang's
        ``"base:name"``), None for the base model. Raises a 404 naming an unknown model."""
        return adapter_of_model(model, (self.model_name, self.args.model_path),
                                self.model_name, self.tm.lora_adapters)

    def request_loras(self, req, prompts: int = 1) -> list[str | None]:
        """The adapter of each prompt of ``req`` from its ``model`` and SGLang's ``lora_path``
        (``server/openai/lora_choice.py``). Raises: APIError 400/404 naming the field."""
        return adapters_of_request(self.check_model(req.model), (req.model_extra or {}).get(
            "lora_path"), self.model_name, self.tm.lora_adapters, prompts)

    async def _parse(self, model, request: Request):
        """The validated body of ``request`` (``parse_request`` with this server's --max-n)."""
        body = await read_json(request, self.args.max_request_bytes,
                               self.args.body_read_timeout)
        return parse_request(model, body, max_n=self.args.max_n)

    def _params(self, req, max_tokens: int | None) -> SamplingParams:
        sp = req.sampling_params(max_tokens)
        try:
            verify_sampling(sp, self.tm.vocab_size)
        except RequestError as exc:
            raise bad_request(exc.message, exc.param, exc.code) from None
        return sp

    def check_fan_out(self, n_prompts: int, n: int) -> None:
        """400 when the request alone needs more engine requests than the server admits.

        ``n_prompts * n`` engine requests over ``running + queued`` can never be admitted
        (even an idle server would answer 503 "queue full"), so this is the client's error,
        naming ``n`` (or ``prompt`` when ``n`` is 1).
        """
        total, limit = n_prompts * n, self.tm.admission_limit()
        if total <= limit:
            return
        what = f"{n_prompts} prompts x n={n}" if n_prompts > 1 else f"n={n}"
        fix = "lower n" + (" or send fewer prompts" if n_prompts > 1 else "") if n > 1 \
            else "send fewer prompts per request"
        raise bad_request(f"this request needs {total} generations ({what}); this server holds "
                          f"at most {limit} at once (running plus queued requests): {fix}",
                          "n" if n > 1 else "prompt")

    @staticmethod
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

    @staticmethod
    def _fan_out(base: str, prompts: list[list[int]], n: int,
                 sp: SamplingParams) -> list[tuple[str, list[int], SamplingParams]]:
        """One engine request per (prompt, sample); choice ``i = prompt * n + j``.

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

    def _log_request(self, fmt: BaseFormat, prompt: Any, sp: SamplingParams) -> None:
        if self.args.log_requests:
            logger.info("request %s prompt=%.2000r params=%s", fmt.id, prompt, sp)

    def _log_output(self, fmt: BaseFormat) -> None:
        if self.args.log_requests:
            logger.info("request %s outputs=%.4000r", fmt.id, fmt.texts)

    async def _answer(self, request: Request, subs, stream: bool, t0: float, fmt,
                      lora: str | list[str | None] | None = None,
                      fields: list[str | None] | None = None) -> Response:
        rids: list[str] = []  # the engine rids generate registers (unique; see request_id)
        gen = self.tm.generate(subs, stream, arrival=t0, registered=rids, lora=lora,
                               lora_param=fields)  # the 404 of an adapter unloaded meanwhile
        if not stream:
            async def collect() -> list[list[ReqOutput]]:
                outs: list[list[ReqOutput]] = [[] for _ in subs]
                async for o in gen:
                    outs[o.index].append(o)
                return outs

            try:
                outs = await run_until_disconnect(request, collect())
            except ClientGone:
                return Response(status_code=499)
            if fmt.lp.prompt_k is not None:  # a body of up to MAX_PROMPT_LOGPROBS entries:
                # built and encoded in a worker thread, so other requests are served meanwhile
                resp = await asyncio.to_thread(lambda: JSONResponse(fmt.full(outs)))
            else:
                resp = JSONResponse(fmt.full(outs))
            self._log_output(fmt)
            return resp

        async def first() -> ReqOutput:
            return await anext(gen)

        try:
            head = await run_until_disconnect(request, first())
        except ClientGone:
            return Response(status_code=499)

        async def events() -> AsyncIterator[str]:
            try:
                for c in fmt.start():
                    yield sse(c)
                item: ReqOutput | None = head
                while item is not None:
                    for c in fmt.chunks(item):
                        yield sse(c)
                    item = await anext(gen, None)
                if fmt.include_usage:
                    yield sse(fmt.usage_chunk())
            except APIError as err:
                yield err.sse()
            except Exception:
                logger.exception("stream failed")
                yield http_error(500, "internal error while streaming").sse()
            self._log_output(fmt)
            yield DONE

        return _SSEResponse(events(), on_close=lambda: self.tm.abort(rids))

    # ---- endpoints ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        t0 = time.monotonic()
        base = request_id_of(request, "cmpl")  # X-Request-Id, else a new id
        req: CompletionRequest = await self._parse(CompletionRequest, request)
        base = adopt_body_id(request, req.model_extra, base)  # SGLang's rid, vLLM's request_id
        prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        loras = self.request_loras(req, len(prompts))  # one adapter (or None) per prompt
        sp = await structured.constrain(req, sp=self._params(req, req.max_tokens))
        self.check_fan_out(len(prompts), req.n)
        # completions' default max_tokens (16) is not the client's; then the prompt is at fault
        mt_param = "max_tokens" if "max_tokens" in req.model_fields_set else None
        ids_list, texts = [], []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise bad_request("the prompt is empty", "prompt")
                ids = await self.tm.tokenize(p, add_special_tokens=req.add_special_tokens
                                             is not False)
            else:
                ids = list(p)
            self.tm.check_prompt(ids, sp.max_tokens, "prompt", max_tokens_param=mt_param,
                                 min_tokens=sp.min_tokens)
            ids_list.append(ids)
            if req.echo:  # the prompt verbatim: as sent, token ids decoded with their
                # special tokens (skip_special_tokens applies to the output only)
                texts.append(p if isinstance(p, str) else await self.tm.decode(
                    ids, skip_special_tokens=False))
        asked = [(f, k + 1) for f, k in (("prompt_logprobs", req.prompt_logprobs),
                                         ("logprobs", req.logprobs if req.echo else None))
                 if k is not None]
        self.check_prompt_logprobs([len(i) for i in ids_list], req.n,
                                   sum(c for _, c in asked), [f for f, _ in asked])
        subs = self._fan_out(base, ids_list, req.n, sp)
        lp = LogprobOptions(k=req.logprobs, as_ids=req.return_tokens_as_token_ids,
                            echo=req.echo,
                            prompt_texts=[t for t in texts for _ in range(req.n)],
                            prompt_ids=[ids for ids in ids_list for _ in range(req.n)],
                            skip_special_tokens=req.skip_special_tokens,
                            spaces_between_special_tokens=req.spaces_between_special_tokens,
                            prompt_k=req.prompt_logprobs, token_ids=req.return_token_ids)
        fmt = CompletionFormat(base, shown_model(loras, self.model_name), len(subs),
                               sum(map(len, ids_list)),
                               req.include_usage, req.continuous_usage, self.strings, lp,
                               n=req.n)
        self._log_request(fmt, req.prompt, sp)
        return await self._answer(request, subs, req.stream, t0, fmt,
                                  [lora for lora in loras for _ in range(req.n)],
                                  fields_of(req, len(prompts), req.n))

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        t0 = time.monotonic()
        base = request_id_of(request, "chatcmpl")  # X-Request-Id, else a new id
        req: ChatCompletionRequest = await self._parse(ChatCompletionRequest, request)
        base = adopt_body_id(request, req.model_extra, base)  # SGLang's rid, vLLM's request_id
        lora = self.request_loras(req)[0]
        sp = self._params(req, req.requested_max_tokens)
        tools, sp = await prepare_chat(req, sp, getattr(self.tm.tokenizer, "chat_template", None),
                                       self.tm.tool_call_parser)  # constraint, tools
        self.check_fan_out(1, req.n)
        ids = await chat_prompt(self.tm, req, tools)
        mt_param = ("max_completion_tokens" if req.max_completion_tokens is not None
                    else "max_tokens" if req.max_tokens is not None else None)
        self.tm.check_prompt(ids, sp.max_tokens, "messages", max_tokens_param=mt_param,
                             min_tokens=sp.min_tokens)
        if req.prompt_logprobs is not None:
            self.check_prompt_logprobs([len(ids)], req.n, req.prompt_logprobs + 1,
                                       ["prompt_logprobs"])
        subs = self._fan_out(base, [ids], req.n, sp)
        lp = LogprobOptions(k=req.logprobs_k, as_ids=req.return_tokens_as_token_ids,
                            prompt_k=req.prompt_logprobs, prompt_ids=[ids] * req.n,
                            token_ids=req.return_token_ids,
                            skip_special_tokens=req.skip_special_tokens,
                            spaces_between_special_tokens=req.spaces_between_special_tokens)
        fmt = chat_format(tools, base, lora or self.model_name, len(subs), len(ids),
                          req.include_usage, req.continuous_usage, self.strings, lp, n=req.n)
        self._log_request(fmt, [m.model_dump(exclude_none=True) for m in req.messages], sp)
        return await self._answer(request, subs, req.stream, t0, fmt, lora,
                                  fields_of(req, 1, req.n))
