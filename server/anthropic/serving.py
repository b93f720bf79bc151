"""The handlers of Anthropic's Messages API: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

A request is validated (``server/anthropic/request.py``), turned into a chat completions body
(``to_chat``) and runs the one chat pipeline (``server/pipeline/``) exactly as a chat request:
the same template, sampling, structured output and tool calling. The answer is written by
``server/anthropic/events.py``'s ``MessagesWriter``: a ``message`` object, or Anthropic's
SSE events. Errors are Anthropic-shaped (``server/anthropic/errors.py``: the app wraps these
handlers in ``messages_endpoint``).

``count_tokens`` renders the same prompt (template, system, tools) and answers
``{"input_tokens": N}``: the prompt tokens a ``/v1/messages`` request with this body would
run (``usage.input_tokens + usage.cache_read_input_tokens`` of its answer).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.anthropic.blocks import Origins
from server.anthropic.events import MessageBuilder, MessagesWriter, new_message_id
from server.anthropic.request import MessagesRequest, parse_messages_request, to_chat
from server.http.body import read_json
from server.http.errors import APIError
from server.http.request_id import request_id_of
from server.openai.formats import LogprobOptions
from server.openai.protocol import ChatCompletionRequest, parse_request
from server.openai.serving import OpenAIServing
from server.openai.tool_format import chat_format
from server.pipeline.answer import answer, log_request
from server.pipeline.job import ChatJob, prepare
from server.pipeline.prompt import chat_prompt
from server.tools.plan import plan_tools


class MessagesServing:
    """The ``/v1/messages`` handlers, sharing ``OpenAIServing``'s engine and checks."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def _read(self, request: Request, count_only: bool = False) -> MessagesRequest:
        args = self.serving.args
        return parse_messages_request(await read_json(request, args.max_request_bytes,
                                                      args.body_read_timeout),
                                      count_only=count_only)

    @staticmethod
    def _chat(body: dict, origins: Origins) -> ChatCompletionRequest:
        try:
            return parse_request(ChatCompletionRequest, body, max_n=1)
        except APIError as err:
            raise origins.rename(err) from None

    async def create(self, request: Request) -> Response:
        """``POST /v1/messages``: a ``message`` object, or its SSE events with
        ``stream: true``.

        Raises:
            APIError: 400 naming the field, 404 for an unknown model, 503 when the server
                cannot take it (answered 529), the engine's error for a rejected request.
        """
        s, args = self.serving, self.serving.args
        t0 = time.monotonic()
        mid = new_message_id()
        rid = request_id_of(request, "msg", mid)  # X-Request-Id, else the message's id
        req = await self._read(request)
        lora = s.request_loras(req)[0]  # model: the base model or "base:adapter"
        body, origins = to_chat(req)
        chat = self._chat(body, origins)
        try:
            job: ChatJob = await prepare(s.tm, chat, base=rid, max_tokens=req.max_tokens,
                                         prompt_param="messages",
                                         max_tokens_param="max_completion_tokens",
                                         lora=lora, lora_fields=[None], arrival=t0)
        except APIError as err:
            raise origins.rename(err) from None
        lp = LogprobOptions(skip_special_tokens=job.params.skip_special_tokens,
                            spaces_between_special_tokens=job.params.spaces_between_special_tokens)
        shown = lora or s.model_name  # the adapter, as on /v1/chat/completions
        fmt = chat_format(job.tools, rid, shown, 1, job.prompt_tokens, False, False, s.strings,
                          lp, n=1, **job.format_options)
        build = MessageBuilder(mid, shown, fmt, req.stop_sequences or [])
        log_request(args.log_requests, fmt, body["messages"], job.params)
        return await answer(request, s.tm, job, MessagesWriter(build), req.stream,
                            log=args.log_requests)

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``.

        Raises: APIError 400 naming the field, 404 for an unknown model."""
        s = self.serving
        req = await self._read(request, count_only=True)
        s.request_loras(req)  # an unknown model is a 404, as on /v1/messages
        body, origins = to_chat(req, count_only=True)
        chat = self._chat(body, origins)
        try:
            plan = plan_tools(chat, getattr(s.tm.chat.tokenizer, "chat_template", None),
                              s.tm.chat.tool_call_parser)
            ids = await chat_prompt(s.tm, chat, plan)
        except APIError as err:
            raise origins.rename(err) from None
        return JSONResponse({"input_tokens": len(ids)})
