"""The generation endpoints (``/v1/completions``, ``/v1/chat/completions``); the tokenizer
endpoints are in ``server/openai/tokens.py``.

A chat request runs the chat pipeline (``server/pipeline/``): ``prepare`` checks, renders and
tokenizes it into a ``ChatJob``, ``answer`` runs the job and drives ``ChunkWriter``: one JSON
body, or an SSE stream of OpenAI chunks ending in ``data: [DONE]`` (the shapes live in
``server/openai/formats.py``). A completions request builds its job from its prompts with the
same checks and answers the same way.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engine.sampling.params import SamplingParams
from server.http.body import read_json
from server.http.errors import APIError, bad_request
from server.http.request_id import request_id_of
from server.http.sse import DONE, sse
from server.openai.extensions import adopt_body_id
from server.openai.formats import BaseFormat, CompletionFormat, LogprobOptions
from server.openai.logprobs import TokenStrings
from server.openai.lora_choice import adapter_of_model, adapters_of_request, fields_of, shown_model
from server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from server.openai.tool_format import chat_format
from server.pipeline import answer as pipeline
from server.pipeline.job import (
    ChatJob,
    check_fan_out,
    check_prompt_logprobs,
    fan_out,
    prepare,
    sampling_params,
    truncate_prompt,
)
from server.tokenizer_manager import ReqOutput, TokenizerManager
from server.tools import structured


class ChunkWriter(pipeline.Writer):
    """OpenAI's answer of a chat or completions request: ``fmt.full`` of the collected
    outputs, or ``data:`` chunks (the usage chunk last with ``include_usage``), an error's
    ``data: {"error": ...}`` event, then ``data: [DONE]``."""

    def __init__(self, fmt: BaseFormat, choices: int):
        super().__init__(fmt)
        self.outs: list[list[ReqOutput]] = [[] for _ in range(choices)]
        # a body of up to MAX_PROMPT_LOGPROBS entries is built off the event loop's thread
        self.heavy = fmt.lp.prompt_k is not None

    def collect(self, out: ReqOutput) -> None:
        self.outs[out.index].append(out)

    def body(self) -> dict:
        return self.fmt.full(self.outs)

    def start(self):
        return [sse(c) for c in self.fmt.start()]

    def events(self, out: ReqOutput):
        return [sse(c) for c in self.fmt.chunks(out)]

    def end(self):
        return [sse(self.fmt.usage_chunk())] if self.fmt.include_usage else []

    def error(self, err: APIError):
        return [err.sse()]

    def close(self):
        return [DONE]


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
        if self._strings is None or self._strings.tokenizer is not self.tm.chat.tokenizer:
            self._strings = TokenStrings(self.tm.chat.tokenizer)
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

    async def parse(self, model, request: Request):
        """The validated body of ``request`` (``parse_request`` with this server's --max-n).

        Raises: APIError 400/408/413/415 (``read_json``, ``parse_request``)."""
        body = await read_json(request, self.args.max_request_bytes,
                               self.args.body_read_timeout)
        return parse_request(model, body, max_n=self.args.max_n)

    def _params(self, req, max_tokens: int | None) -> SamplingParams:
        return sampling_params(req, max_tokens, self.tm.vocab_size)

    def _log_request(self, fmt: BaseFormat, prompt: Any, sp: SamplingParams) -> None:
        pipeline.log_request(self.args.log_requests, fmt, prompt, sp)

    # ---- endpoints ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        t0 = time.monotonic()
        base = request_id_of(request, "cmpl")  # X-Request-Id, else a new id
        req: CompletionRequest = await self.parse(CompletionRequest, request)
        base = adopt_body_id(request, req.model_extra, base)  # SGLang's rid, vLLM's request_id
        prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        loras = self.request_loras(req, len(prompts))  # one adapter (or None) per prompt
        sp = await structured.constrain(req, sp=self._params(req, req.max_tokens))
        check_fan_out(self.tm, len(prompts), req.n)
        ids_list, texts = await self._completion_prompts(req, prompts, sp)
        asked = [(f, k + 1) for f, k in (("prompt_logprobs", req.prompt_logprobs),
                                         ("logprobs", req.logprobs if req.echo else None))
                 if k is not None]
        check_prompt_logprobs([len(i) for i in ids_list], req.n,
                              sum(c for _, c in asked), [f for f, _ in asked])
        job = ChatJob(base, ids_list, sp, req.n, fan_out(base, ids_list, req.n, sp),
                      lora=[lora for lora in loras for _ in range(req.n)],
                      lora_fields=fields_of(req, len(prompts), req.n), arrival=t0)
        lp = LogprobOptions(k=req.logprobs, as_ids=req.return_tokens_as_token_ids,
                            echo=req.echo,
                            prompt_texts=[t for t in texts for _ in range(req.n)],
                            prompt_ids=[ids for ids in ids_list for _ in range(req.n)],
                            skip_special_tokens=req.skip_special_tokens,
                            spaces_between_special_tokens=req.spaces_between_special_tokens,
                            prompt_k=req.prompt_logprobs, token_ids=req.return_token_ids)
        fmt = CompletionFormat(base, shown_model(loras, self.model_name), len(job.subs),
                               job.prompt_tokens, req.include_usage, req.continuous_usage,
                               self.strings, lp, n=req.n)
        self._log_request(fmt, req.prompt, sp)
        return await pipeline.answer(request, self.tm, job, ChunkWriter(fmt, len(job.subs)),
                                     req.stream, log=self.args.log_requests)

    async def _completion_prompts(self, req: CompletionRequest, prompts: list,
                                  sp: SamplingParams) -> tuple[list[list[int]], list[str]]:
        """The token ids of each prompt (checked against the context) and, with ``echo``,
        its text. Raises: APIError 400 naming ``prompt`` or ``max_tokens``."""
        # completions' default max_tokens (16) is not the client's; then the prompt is at fault
        mt_param = "max_tokens" if "max_tokens" in req.model_fields_set else None
        ids_list, texts = [], []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise bad_request("the prompt is empty", "prompt")
                ids = await self.tm.chat.tokenize(p, add_special_tokens=req.add_special_tokens
                                                  is not False)
            else:
                ids = list(p)
            whole = len(ids)
            ids = truncate_prompt(ids, req, self.tm.max_context_len)  # vLLM's, if asked
            self.tm.check_prompt(ids, sp.max_tokens, "prompt", max_tokens_param=mt_param,
                                 min_tokens=sp.min_tokens)
            ids_list.append(ids)
            if req.echo:  # the prompt verbatim: as sent, token ids decoded with their
                # special tokens (skip_special_tokens applies to the output only)
                texts.append(p if isinstance(p, str) and len(ids) == whole else
                             await self.tm.chat.decode(ids, skip_special_tokens=False))
        return ids_list, texts

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        t0 = time.monotonic()
        base = request_id_of(request, "chatcmpl")  # X-Request-Id, else a new id
        req: ChatCompletionRequest = await self.parse(ChatCompletionRequest, request)
        base = adopt_body_id(request, req.model_extra, base)  # SGLang's rid, vLLM's request_id
        lora = self.request_loras(req)[0]
        mt_param = ("max_completion_tokens" if req.max_completion_tokens is not None
                    else "max_tokens" if req.max_tokens is not None else None)
        job = await prepare(self.tm, req, base=base, max_tokens=req.requested_max_tokens,
                            prompt_param="messages", max_tokens_param=mt_param, lora=lora,
                            lora_fields=fields_of(req, 1, req.n), arrival=t0)
        ids = job.prompts[0]
        lp = LogprobOptions(k=req.logprobs_k, as_ids=req.return_tokens_as_token_ids,
                            prompt_k=req.prompt_logprobs, prompt_ids=[ids] * req.n,
                            token_ids=req.return_token_ids,
                            # the engine's: a parser that reads special tokens keeps them
                            skip_special_tokens=job.params.skip_special_tokens,
                            spaces_between_special_tokens=req.spaces_between_special_tokens)
        fmt = chat_format(job.tools, base, lora or self.model_name, len(job.subs), len(ids),
                          req.include_usage, req.continuous_usage, self.strings, lp, n=req.n,
                          **job.format_options)
        self._log_request(fmt, [m.model_dump(exclude_none=True) for m in req.messages],
                          job.params)
        return await pipeline.answer(request, self.tm, job, ChunkWriter(fmt, len(job.subs)),
                                     req.stream, log=self.args.log_requests)
