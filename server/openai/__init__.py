"""``/v1/chat/completions`` and ``/v1/completions`` (plus tokenize/detokenize), as in SGLang's
``entrypoints/openai/``.

``protocol`` and ``protocol_base`` (the pydantic request models), ``chat_messages`` (the
messages handed to the chat template), ``serving`` (``OpenAIServing``: the handlers),
``formats`` (the JSON bodies and SSE chunks), ``tool_format`` (their ``tool_calls``),
``logprobs`` (the ``logprobs`` of a choice).
"""
