"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

- ``errors``: Anthropic's error body and status codes, the ``anthropic-version`` header and
  the wrapper of these routes' handlers.
- ``blocks``: ``system``, ``messages`` (content blocks), ``tools`` and ``tool_choice`` as
  their ``/v1/chat/completions`` equivalents.
- ``request``: ``MessagesRequest`` (validation: every field implemented, a documented
  no-op or a 400 naming it) and ``to_chat``, its chat body.
- ``events``: ``MessageBuilder`` (the ``message`` object and the stream's events from the
  chat format's chunks) and ``MessagesWriter``, the chat pipeline's writer.
- ``serving``: the handlers.

Like ``/v1/responses``, the family only converts: the request runs the one chat pipeline
(``server/pipeline/``), so its template, sampling, tools and structured output are chat's.
"""
