"""The ``--tool-call-parser`` registry: SGLang's names, vLLM's (and SGLang's other) names as
aliases, and ``auto``'s pick from a chat template.

``get_tool_parser(name)`` gives a family's ``ToolParser`` (``server/parsers/base.py``):
``parse(text, tools) -> (content, calls)`` and ``stream(tools)`` -> ``ToolCallStream``
(``feed(delta)``/``finish()`` -> events). ``register_tool_parser`` adds a family.
"""

from __future__ import annotations

from server.parsers.base import ToolParser
from server.parsers.json_tools import HermesParser, Llama3Parser, MistralParser, PythonicParser
from server.parsers.tagged_tools import (
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    Glm45Parser,
    GptOssParser,
    KimiK2Parser,
    Qwen3CoderParser,
)

TOOL_PARSERS: dict[str, ToolParser] = {}
#: other names of the families: vLLM's, and SGLang's second names
TOOL_PARSER_ALIASES: dict[str, str] = {
    "qwen25": "hermes", "qwen": "hermes", "llama3_json": "llama3",
    "llama4_pythonic": "pythonic", "deepseek_v3": "deepseekv3",
    "deepseek_v31": "deepseekv31", "glm": "glm45", "openai": "gpt-oss",
    "qwen3_xml": "qwen3_coder",
}


def register_tool_parser(parser: ToolParser) -> ToolParser:
    """Add ``parser`` under its ``name`` (replacing one of that name)."""
    TOOL_PARSERS[parser.name] = parser
    return parser


for _cls in (HermesParser, Llama3Parser, MistralParser, PythonicParser, Qwen3CoderParser,
             DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser, Glm45Parser, GptOssParser):
    register_tool_parser(_cls())


def tool_parser_names() -> tuple[str, ...]:
    """Every name ``get_tool_parser`` takes: the families', then the aliases."""
    return tuple(TOOL_PARSERS) + tuple(TOOL_PARSER_ALIASES)


def canonical_tool_parser(name: str) -> str:
    """The family's own name for ``name`` (an alias or the name itself).

    Raises:
        KeyError: an unknown name.
    """
    name = TOOL_PARSER_ALIASES.get(name, name)
    if name not in TOOL_PARSERS:
        raise KeyError(name)
    return name


def get_tool_parser(name: str) -> ToolParser:
    """The parser of ``name`` (a family's name or an alias; not ``auto``: see
    ``detect_tool_parser``).

    Raises:
        KeyError: an unknown name.
    """
    return TOOL_PARSERS[canonical_tool_parser(name)]


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The family a chat template's tool format calls for, or None if it shows none (or
    could be several: the pythonic templates are not told apart from plain Llama ones)."""
    t = chat_template or ""
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2"
    if "<｜tool▁calls▁begin｜>" in t or "<｜tool▁call▁begin｜>" in t:
        return "deepseekv3" if "```json" in t else "deepseekv31"
    if "<|channel|>" in t and ("to=functions" in t or "<|call|>" in t):
        return "gpt-oss"
    if "<arg_key>" in t:
        return "glm45"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return None
