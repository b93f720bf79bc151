"""The one chat pipeline every generation endpoint family runs: ``prepare -> ChatJob ->
answer``.

- ``prompt``: a chat request's messages for the chat template, and its prompt token ids
  (``chat_prompt``, also ``/v1/tokenize``'s).
- ``job``: ``prepare`` (sampling settings, tools and structured output, the template, the
  context, the fan-out into engine requests) and the ``ChatJob`` it returns, plus the
  checks ``/v1/completions`` shares.
- ``reasoning``: the ``--reasoning-parser`` split of a request's output (``ReasoningPlan``,
  read by the chat format) and the engine settings it implies (``think_end_id``, or
  ``think_end_ids`` for gpt-oss's final channel header, and ``skip_special_tokens``).
- ``answer``: ``answer`` runs a job on the engine and drives an API family's ``Writer``
  (one JSON body, or SSE events), with the client's disconnect handled.

An API family brings a request model (converted into a chat request), a renderer of the
outputs and a ``Writer``; it never imports another family's private helpers. The pipeline
sits below the families (``.importlinter``'s ``server-layers``): it knows no request model.
"""
