"""ferry's HTTP server process, one folder per endpoint family (as SGLang's entrypoints/).

- ``__main__``, ``cli``, ``launch``: ``ferry serve`` / ``python -m server``, the start and stop
  of the engine and detokenizer processes, uvicorn.
- ``app``: the Starlette app, its route table and middleware, wiring the families below.
- ``openapi/``: ``/openapi.json`` and ``/docs``.
- ``responses/``: ``/v1/responses``, run through the chat machinery of ``openai/``.
- ``openai/``: ``/v1/chat/completions``, ``/v1/completions``, tokenize/detokenize.
- ``tools/``: tool calling and structured output (the request side, the parsers).
- ``parsers/``: the parsers of model output (reasoning, tool calls), registries by name.
- ``tokenizer_manager``, ``chat_template``, ``metrics``: the engine client (chat template,
  tokenize, ZMQ), the tools fallback for templates that ignore tools, and its Prometheus
  metrics.
- ``http/``: errors, request ids, CORS, uvicorn's limits.

Imports only go down that list (``.importlinter``'s ``server-layers`` contract checks it).
"""
