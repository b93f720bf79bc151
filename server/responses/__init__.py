"""OpenAI's Responses API, ``POST /v1/responses``, on top of the chat machinery of openai/.

``serving`` (``ResponsesServing``: the request model, its validation and the handler),
``input`` (``input``/``instructions``/``tools``/``text`` -> the chat request's fields),
``events`` (the ``response`` object and the typed SSE events, from the chat format's chunks).
"""
