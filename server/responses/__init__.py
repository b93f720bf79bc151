"""OpenAI's Responses API, ``POST /v1/responses``, on top of the chat machinery of openai/.

``serving`` (``ResponsesServing``: the handler and the stored-response routes),
``request`` (``ResponsesRequest``: the request model, its validation, ``to_chat``),
``input`` (``input``/``instructions``/``tools``/``text`` -> the chat request's fields),
``events`` (the ``response`` object and the typed SSE events, from the chat format's chunks),
``store`` (the bounded in-memory store of ``store: true`` and ``previous_response_id``).
"""
