"""The tokenizer endpoints (``/v1/tokenize``, ``/v1/detokenize``, also at vLLM's
``/tokenize`` and ``/detokenize``).

``/v1/tokenize`` with ``messages`` renders them with ``chat_prompt``
(``server/pipeline/prompt.py``), the function chat completions and ``/v1/responses`` run,
so it counts exactly the tokens the chat request would run (its ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs`` and ``tools``).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.errors import bad_request
from server.openai.protocol import DetokenizeRequest, TokenizeRequest
from server.pipeline.prompt import chat_prompt
from server.tokenizer_manager import TokenizerManager
from server.tools.plan import plan_tools


async def tokenize(serving, request: Request) -> Response:
    """``POST /v1/tokenize``: ``{"tokens", "count", "max_model_len"}`` (+ ``token_strs``).

    Args:
        serving: the ``OpenAIServing`` (its body parsing, model check and engine client).
    Raises:
        APIError: 400 for a bad body (an unknown field included) or a chat template that
            rejects the messages; 404 naming ``model`` or ``lora_path`` for an adapter that
            is not loaded (``lora_choice.adapters_of_request``: one name, or a list of one).
    """
    tm: TokenizerManager = serving.tm
    req: TokenizeRequest = await serving.parse(TokenizeRequest, request)
    # the adapter (``model`` or SGLang's ``lora_path``) is checked as the generation routes
    # check it; a LoRA adapter has no tokenizer of its own, so the tokens are the base's
    serving.request_loras(req)
    if req.messages is not None:
        tools = plan_tools(req, getattr(tm.chat.tokenizer, "chat_template", None))
        ids = await chat_prompt(tm, req, tools)
    else:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await tm.chat.tokenize(req.prompt, add_special_tokens=add) if req.prompt else []
    body = {"tokens": ids, "count": len(ids), "max_model_len": tm.max_context_len}
    if req.return_token_strs:
        tok = tm.chat.need_tokenizer("return_token_strs")
        body["token_strs"] = tok.convert_ids_to_tokens(ids)
    return JSONResponse(body)


async def detokenize(serving, request: Request) -> Response:
    """``POST /v1/detokenize``: ``{"prompt": text}`` (special tokens kept, as vLLM).

    Raises:
        APIError: 400 for a bad body (an unknown field included) or a token id outside the
            vocabulary (``tokens``).
    """
    tm: TokenizerManager = serving.tm
    req: DetokenizeRequest = await serving.parse(DetokenizeRequest, request)
    serving.check_model(req.model)
    tm.chat.need_tokenizer("tokens")
    vocab = tm.vocab_size
    for i, t in enumerate(req.tokens):
        if t < 0 or (vocab and t >= vocab):
            raise bad_request(f"tokens[{i}]: token id {t} is outside the vocabulary "
                              f"[0, {vocab})", "tokens")
    return JSONResponse({"prompt": await tm.chat.decode(req.tokens)})
