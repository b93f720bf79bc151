"""What a request asks of the output beyond text: tool calling and structured output.

``plan`` (``tools``/``tool_choice``/``parallel_tool_calls`` -> ``ToolPlan`` and the output
constraint), ``parsers`` (the ``--tool-call-parser`` families' old names; the families live in
``server/parsers/``), ``messages`` (assistant ``tool_calls`` and ``tool`` messages for the chat template),
``structured`` (``response_format``, ``guided_*`` & co. -> one xgrammar constraint).
Below the endpoint folders: nothing here imports openai/ or responses/.
"""
