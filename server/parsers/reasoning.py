"""The ``--reasoning-parser`` families: model output -> ``(reasoning, content)``, as SGLang's
parsers of the same names (vLLM's names as aliases), registry keyed by name.

- ``deepseek-r1`` (DeepSeek-R1 and its distills; vLLM's ``deepseek_r1``): the template opens
  ``<think>``, so the output starts in the reasoning, up to ``</think>`` (an echoed
  ``<think>`` at the start is dropped).
- ``deepseek-v3`` (DeepSeek V3.1/V3.2; ``deepseek_v3``): as ``deepseek-r1`` when the request's
  ``chat_template_kwargs.thinking`` is true, else (the default) the output is all content.
- ``qwen3``: ``<think>...</think>`` at the start of the output is reasoning (on by default;
  ``chat_template_kwargs.enable_thinking: false`` makes the output all content);
  ``qwen3-thinking`` (Qwen3 Thinking-2507, whose template opens ``<think>``): as
  ``deepseek-r1``.
- ``glm45`` (GLM-4.5/4.6): as ``qwen3``.
- ``kimi`` (Kimi-VL thinking): ``◁think▷...◁/think▷``; ``kimi_k2`` (Kimi K2 thinking):
  ``<think>...</think>``, as ``qwen3`` without the switch.
- ``gpt-oss`` (``openai_gptoss``): harmony's ``analysis`` channel is reasoning, the ``final``
  channel and preambles are content, and tool-call messages (``to=functions.X``) stay in
  the content as written, for the ``gpt-oss`` tool parser; with no tool parser reading
  them (``keep_calls`` off: no tools, ``tool_choice: "none"``), a call message's body is
  content as any other message's (vLLM's harmony does the same): no harmony markup ever
  reaches the content.

``get_reasoning_parser(name, chat_template_kwargs, prompt)`` gives a ``ReasoningParser``:
``parse(text) -> (reasoning | None, content | None)`` and ``stream()`` -> a
``ReasoningStream`` (``feed(delta) -> (reasoning_delta, content_delta)``, ``finish()``,
``reasoning_tokens``). Given the rendered ``prompt``, a prompt that ends with the start tag
opens the reasoning and one that ends with the end tag (thinking switched off by the
template) turns the parser off, whatever the kwargs say. The reasoning is stripped of the
whitespace around it, the content after the end tag of the whitespace before it; a
reasoning block cut by ``max_tokens`` (no end tag) is all reasoning. A stream holds back
any text that could be part of a tag, so no tag fragment reaches either side, and it sums
to ``parse``'s result however the text is split.
"""

from __future__ import annotations

import re

from server.parsers import harmony
from server.parsers.base import tail_hold

UNDECIDED, REASONING, CONTENT = "undecided", "reasoning", "content"


class ReasoningParser:
    """One family's reasoning format (see the module docstring); stateless.

    ``needs_special_tokens``: its tags are special tokens, so the engine must keep special
    tokens in the output text (``skip_special_tokens`` off for the request)."""

    name = ""
    needs_special_tokens = False

    def scan(self, text: str, final: bool) -> tuple[str, str, str]:
        """``(reasoning, content, phase)`` of ``text``: unless ``final``, prefixes of what any
        continuation gives; ``phase``: where the text's end is (``"reasoning"``,
        ``"content"`` or ``"undecided"``)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a finished output, each None when empty."""
        reasoning, content, _ = self.scan(text, True)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        """A ``ReasoningStream`` of this parser for one output."""
        return ReasoningStream(self)


class ThinkParser(ReasoningParser):
    """Reasoning between ``start`` and ``end`` tags at the start of the output.

    Args:
        name: the registry name.
        start, end: the tags.
        opened: the prompt opened the block: the output starts in the reasoning.
        enabled: False: the output is all content.
    """

    def __init__(self, name: str, start: str, end: str, opened: bool = False,
                 enabled: bool = True):
        self.name, self.start, self.end = name, start, end
        self.opened, self.enabled = opened, enabled

    def scan(self, text, final):
        if not self.enabled:
            return "", text, CONTENT
        s = text.lstrip()
        if s.startswith(self.start):
            body = len(text) - len(s) + len(self.start)
        elif not final and self.start.startswith(s):  # nothing yet, or part of the tag
            return "", "", REASONING if self.opened else UNDECIDED
        elif self.opened:
            body = 0
        else:
            return "", text, CONTENT
        e = text.find(self.end, body)
        if e < 0:
            stop = len(text) if final else tail_hold(text, body, (self.end,))
            return text[body:stop].strip(), "", REASONING
        return text[body:e].strip(), text[e + len(self.end):].lstrip(), CONTENT


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss: harmony's channels (``server/parsers/harmony.py``).

    Args:
        keep_calls: tool-call messages stay in the content as written (markup and all), for
            the ``gpt-oss`` tool parser; False: only their bodies, as other messages.
    """

    name = "gpt-oss"
    needs_special_tokens = True

    def __init__(self, keep_calls: bool = True):
        self.keep_calls = keep_calls

    def scan(self, text, final):
        reasoning, content, phase = [], [], UNDECIDED
        for piece in harmony.split(text, final):
            if piece.channel == "analysis":
                reasoning.append(piece.body)
                phase = UNDECIDED if piece.closed else REASONING
                continue
            if piece.channel is None or (piece.recipient and self.keep_calls):
                content.append(piece.raw)   # outside text, or a tool call as written
            else:
                content.append(piece.body)  # final channel, preambles
            phase = CONTENT
        return "".join(reasoning), "".join(content), phase


class ReasoningStream:
    """One output's reasoning and content as they stream.

    ``feed(delta)`` returns ``(reasoning_delta, content_delta)`` (either may be ""),
    ``finish()`` the rest at the end; together they equal ``parser.parse`` of the whole
    text. ``reasoning_tokens`` counts the tokens fed (``feed``'s ``tokens``, one per call
    by default) that were reasoning: fed while the output was inside the reasoning (its
    tags included), or that brought reasoning text.
    """

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.reasoning = self.content = ""   # sent so far
        self.phase = UNDECIDED
        self.reasoning_tokens = 0

    def feed(self, delta: str, tokens: int = 1) -> tuple[str, str]:
        """The reasoning and content that ``delta`` (the next output text, ``tokens``
        tokens of it) makes certain."""
        before = self.phase
        self.text += delta
        reasoning, content, self.phase = self.parser.scan(self.text, False)
        out = self._diff(reasoning, content)
        if REASONING in (before, self.phase) or out[0]:
            self.reasoning_tokens += tokens
        return out

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output (a cut block: reasoning)."""
        reasoning, content, self.phase = self.parser.scan(self.text, True)
        return self._diff(reasoning, content)

    def result(self) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` as sent so far, each None when empty."""
        return self.reasoning or None, self.content or None

    def _diff(self, reasoning: str, content: str) -> tuple[str, str]:
        r = reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else ""
        c = content[len(self.content):] if content.startswith(self.content) else ""
        self.reasoning += r
        self.content += c
        return r, c


#: name -> (start tag, end tag, opened by the template, the kwarg that switches it, its
#: default); None: gpt-oss's harmony
_THINK = ("<think>", "</think>")
_FAMILIES: dict[str, tuple | None] = {
    "deepseek-r1": (*_THINK, True, None, True),
    "deepseek-v3": (*_THINK, True, "thinking", False),
    "qwen3": (*_THINK, False, "enable_thinking", True),
    "qwen3-thinking": (*_THINK, True, None, True),
    "glm45": (*_THINK, False, "enable_thinking", True),
    "kimi": ("◁think▷", "◁/think▷", False, None, True),
    "kimi_k2": (*_THINK, False, None, True),
    "gpt-oss": None,
}
REASONING_PARSER_ALIASES = {"deepseek_r1": "deepseek-r1", "deepseek_v3": "deepseek-v3",
                            "openai_gptoss": "gpt-oss"}


def register_reasoning_family(name: str, start: str, end: str, opened: bool = False,
                              switch: str | None = None, default: bool = True) -> None:
    """Add a think-tag family: ``switch`` names the ``chat_template_kwargs`` key that
    turns its thinking on or off (``default`` when absent)."""
    _FAMILIES[name] = (start, end, opened, switch, default)


def reasoning_parser_names() -> tuple[str, ...]:
    """Every name ``get_reasoning_parser`` takes: the families', then the aliases."""
    return tuple(_FAMILIES) + tuple(REASONING_PARSER_ALIASES)


def get_reasoning_parser(name: str, chat_template_kwargs: dict | None = None,
                         prompt: str | None = None) -> ReasoningParser:
    """The parser of family ``name`` (or an alias) for one request.

    Args:
        name: a name of ``reasoning_parser_names()`` (not ``auto``: see
            ``detect_reasoning_parser``).
        chat_template_kwargs: the request's (``thinking``, ``enable_thinking``).
        prompt: the rendered prompt text, if known (see the module docstring).

    Raises:
        KeyError: an unknown name.
    """
    name = REASONING_PARSER_ALIASES.get(name, name)
    family = _FAMILIES[name]
    if family is None:
        return HarmonyReasoningParser()
    start, end, opened, switch, default = family
    kwargs = chat_template_kwargs or {}
    enabled = bool(kwargs.get(switch, default)) if switch else True
    tail = (prompt or "").rstrip()
    if tail.endswith(end):
        enabled = False
    elif tail.endswith(start):
        opened = enabled = True
    return ThinkParser(name, start, end, opened=opened, enabled=enabled)


def resolve_reasoning_parser(arg: str | None, chat_template: str | None) -> str | None:
    """The family ``--reasoning-parser arg`` means for a model: None (off) stays None,
    ``auto`` is ``detect_reasoning_parser``'s pick (None: off), an alias its family.

    Raises:
        KeyError: an unknown name.
    """
    if arg is None:
        return None
    if arg == "auto":
        return detect_reasoning_parser(chat_template)
    name = REASONING_PARSER_ALIASES.get(arg, arg)
    if name not in _FAMILIES:
        raise KeyError(arg)
    return name


def count_reasoning_tokens(parser: ReasoningParser, token_texts: list[str]) -> int:
    """How many of an output's tokens (their texts, in order) were reasoning, as
    ``ReasoningStream.reasoning_tokens`` counts them."""
    stream = parser.stream()
    for t in token_texts:
        stream.feed(t)
    return stream.reasoning_tokens


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The family a chat template's reasoning format calls for (``--reasoning-parser
    auto``), or None when it shows none or could be several."""
    t = chat_template or ""
    if "◁think▷" in t:
        return "kimi"
    if "<|channel|>" in t and "analysis" in t:
        return "gpt-oss"
    if "<think>" not in t:
        return None
    if "<｜Assistant｜>" in t:
        return "deepseek-v3" if re.search(r"(?<!\w)thinking\b", t) else "deepseek-r1"
    if "[gMASK]" in t or "<|assistant|>" in t:
        return "glm45"
    if "<|im_assistant|>" in t:
        return "kimi_k2"
    if "<|im_start|>" in t:
        return "qwen3"
    return None
