"""Parsers of model output, one per model family, as plug-in registries keyed by name.

- ``reasoning``: ``--reasoning-parser`` (SGLang's names, vLLM's as aliases): output text ->
  ``(reasoning, content)``, at once (``parse``) or as it streams (``stream().feed``).
- ``tool_registry``: ``--tool-call-parser``: output text -> ``(content, calls)``, at once or
  streamed as events; the families live in ``json_tools`` (whole JSON / Python calls,
  parsed at the end) and ``tagged_tools`` (tag-delimited calls, streamed as they come),
  their common ground (``ParsedCall``, the events, the stream) in ``base``, the harmony
  message splitter of gpt-oss in ``harmony``, the typing of XML-style values in
  ``schema_values``.

Below ``tools/`` (which re-exports the tool parsers' old names) and above ``http/``.
"""
