"""Tool-call parsers for ``tool_choice: "auto"``: model output text -> (content, calls).

The families live in ``server/parsers/`` (registry: ``server/parsers/tool_registry.py``,
streaming: ``server/parsers/base.py``); this module keeps the names the chat and Responses
code import: ``parse_tool_calls``, ``detect_parser``, ``START_MARKERS``, ``ParsedCall``,
``call_content`` and the first three families' functions.
"""

from __future__ import annotations

from server.parsers.base import ParsedCall, call_content
from server.parsers.tool_registry import detect_tool_parser, get_tool_parser, tool_parser_names

__all__ = ["ParsedCall", "call_content", "parse_tool_calls", "detect_parser", "PARSERS",
           "START_MARKERS", "TOOL_CALL_PARSERS", "parse_hermes", "parse_llama3",
           "parse_mistral"]

#: every ``--tool-call-parser`` name but ``auto``: the families', then their aliases
TOOL_CALL_PARSERS = tool_parser_names()


def parse_tool_calls(parser: str, text: str, tools: list[dict] | None = None
                     ) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a finished output; ``(text, [])`` when it holds no valid call.

    Raises:
        KeyError: an unknown parser name.
    """
    return get_tool_parser(parser).parse(text, tools)


def _parse_with(name: str):
    def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
        return get_tool_parser(name).parse(text)

    parse.__name__ = f"parse_{name}"
    return parse


parse_hermes, parse_llama3, parse_mistral = (_parse_with(n)
                                             for n in ("hermes", "llama3", "mistral"))
PARSERS = {n: _parse_with(n) for n in TOOL_CALL_PARSERS}
#: the text that opens a call, per parser name (a stream holds content back from it on);
#: llama3's output may also open with a bare ``{``, pythonic's with its ``[``
START_MARKERS = {n: get_tool_parser(n).markers for n in TOOL_CALL_PARSERS}
for _n in TOOL_CALL_PARSERS:
    _extra = {"llama3": ("{",), "pythonic": ("[",)}.get(get_tool_parser(_n).name, ())
    START_MARKERS[_n] = START_MARKERS[_n] + _extra
detect_parser = detect_tool_parser
