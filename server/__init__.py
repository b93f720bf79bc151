"""ferry's HTTP server process, one folder per endpoint family (as SGLang's entrypoints/).

- ``__main__``, ``cli``, ``launch``: ``ferry serve`` / ``python -m server``, the start and stop
  of the engine and detokenizer processes, uvicorn.
- ``app``: the Starlette app, its route table and middleware, wiring the families below.
- ``openapi/``: ``/openapi.json`` and ``/docs``.
- ``anthropic/``: Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``: its request
  model and content blocks, their conversion to a chat request, its ``message`` object and
  events, its error shape.
- ``responses/``: ``/v1/responses``: its request model, its conversion to a chat request,
  its ``response`` object and events, the stored responses.
- ``pooling/``: ``/v1/embeddings``, ``/v1/rerank`` (``/rerank``) and ``/v1/score`` of a
  pooling model (embedder, cross-encoder, yes/no reranker).
- ``openai/``: ``/v1/chat/completions``, ``/v1/completions``, tokenize/detokenize.
- ``pipeline/``: the one chat pipeline of every family, ``prepare -> ChatJob -> answer``
  (each family brings its request model, renderer and writer).
- ``tools/``: tool calling and structured output (the request side, the parsers).
- ``parsers/``: the parsers of model output (reasoning, tool calls), registries by name.
- ``tokenizer_manager``, ``chat_template``, ``metrics``: the engine client (chat template,
  tokenize, ZMQ), the tools fallback for templates that ignore tools, and its Prometheus
  metrics.
- ``http/``: errors, request ids, CORS, uvicorn's limits, the JSON body, SSE and disconnects.

Imports only go down that list (``.importlinter``'s ``server-layers`` contract checks it).
"""
