"""``/v1/chat/completions`` and ``/v1/completions`` (plus tokenize/detokenize), as in SGLang's
``entrypoints/openai/``.

``protocol`` and ``protocol_base`` (the pydantic request models), ``serving``
(``OpenAIServing``: the handlers over the chat pipeline of ``server/pipeline/``, and
``ChunkWriter``, their answers),
``formats`` (the JSON bodies and SSE chunks), ``tool_format`` (their ``tool_calls``),
``logprobs`` (the ``logprobs`` of a choice).
"""
