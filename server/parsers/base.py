"""What the tool-call parsers share: ``ParsedCall``, the stream events, ``ToolParser`` and
``ToolCallStream``, and the text helpers (markers held back at the end of a stream).

A parser answers two questions about an output:

- ``parse(text, tools)``: the ``(content, calls)`` of a finished output;
- ``partial(text, tools)``: what of that is already certain while the output is still
  coming: a prefix of the content and the calls so far, each call's arguments a prefix of
  its final arguments (a call appears once its name is complete).

``ToolCallStream`` feeds deltas, asks ``partial`` of the text so far and sends the
difference as events; ``finish()`` sends what ``parse`` adds. So a stream gives exactly the
non-stream result, however the text is split.

The content of an output with calls is the text outside them (``call_content``): the text
before the first call without its trailing whitespace, then each later stretch stripped,
joined by newlines; None when that is empty. An output without calls is all content, as it
is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from server.http import json_text


@dataclass
class ParsedCall:
    """One call: ``name`` and ``arguments`` as a JSON object's text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ContentDelta:
    """Content text, to be appended to the message's content."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call ``index`` (0-based, in output order) begins; its name is complete."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    """A fragment of call ``index``'s arguments text, to be appended."""

    index: int
    text: str


ToolEvent = ContentDelta | CallStart | ArgsDelta


def call_content(segments: list[str]) -> str | None:
    """The content of an output with calls, from the stretches of text outside them (the
    first one: the text before the first call); see the module docstring."""
    parts = [segments[0].rstrip()] + [s.strip() for s in segments[1:]] if segments else []
    return "\n".join(p for p in parts if p) or None


def tail_hold(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Where a tail of ``text[start:]`` begins that could be the start of one of
    ``markers`` (so a stream must hold it back); ``len(text)`` when there is none."""
    longest = max((len(m) for m in markers), default=1) - 1
    for i in range(max(start, len(text) - longest), len(text)):
        tail = text[i:]
        if any(m.startswith(tail) for m in markers):
            return i
    return len(text)


def first_of(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The first of ``markers`` in ``text`` from ``start``: ``(index, marker)``, or
    ``(-1, "")``."""
    best, found = -1, ""
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, m
    return best, found


def args_text(obj) -> str:
    """``obj`` (a decoded arguments value) as a JSON object's text."""
    if isinstance(obj, str):  # some models emit the arguments as a JSON string already
        try:
            json_text.loads(obj)
            return obj
        except json_text.JSONTextError:
            return json.dumps(obj, ensure_ascii=False)
    return json.dumps({} if obj is None else obj, ensure_ascii=False)


def json_call(obj) -> ParsedCall | None:
    """``{"name": ..., "arguments" | "parameters": ...}`` as a call, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return ParsedCall(obj["name"], args_text(args))


def json_values(text: str, sep: str = "") -> list | None:
    """Consecutive JSON values in ``text`` (whitespace and ``sep`` between), or None."""
    i, out = 0, []
    while True:
        while i < len(text) and (text[i].isspace() or (sep and text[i] == sep)):
            i += 1
        if i >= len(text):
            return out
        try:
            val, i = json_text.raw_decode(text, i)
        except json_text.JSONTextError:
            return None
        out.append(val)


class ToolParser:
    """One model family's tool-call format (see the module docstring).

    Subclasses set ``name`` and ``markers`` (the text that opens a call) and define
    ``parse``; ``partial``'s default is the content before the first marker (less a tail
    that could begin one and the whitespace before it) and no calls: calls then come out
    at ``finish()``.
    """

    name = ""
    markers: tuple[str, ...] = ()
    #: its markers are special tokens: the engine must not skip special tokens in the output
    #: (``skip_special_tokens`` off; the writer strips the others from the content)
    needs_special_tokens = False

    def parse(self, text: str, tools: list[dict] | None = None
              ) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` of a finished output; ``(text, [])`` when it holds no call.

        Args:
            text: the whole output.
            tools: the request's tools (OpenAI's ``{"type": "function", "function":
                {...}}`` or bare function objects): some families type argument values by
                their JSON schema.
        """
        raise NotImplementedError

    def partial(self, text: str, tools: list[dict] | None = None
                ) -> tuple[str, list[ParsedCall]]:
        """``(content so far, calls so far)`` of an output still coming: prefixes of what
        ``parse`` will say of any continuation of ``text``."""
        return text[:self.safe_content_end(text)].rstrip(), []

    def as_content(self, text: str) -> str:
        """``text`` (an output whose calls are not taken: unknown functions) as content:
        itself, but for a family whose call markup must not reach the client."""
        return text

    def reasoning_inline(self) -> ToolParser:
        """This family's parser for an output whose reasoning was not split off (no
        reasoning parser, or ``separate_reasoning: false``): itself, but for a family that
        drops the reasoning as the reasoning parser's (gpt-oss keeps it as content)."""
        return self

    def safe_content_end(self, text: str) -> int:
        """How much of ``text`` cannot belong to a call: up to the first marker, or to a
        tail that could begin one."""
        i, _ = first_of(text, self.markers)
        return i if i >= 0 else tail_hold(text, 0, self.markers)

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        """A ``ToolCallStream`` of this parser for one output."""
        return ToolCallStream(self, tools)


class ScanToolParser(ToolParser):
    """A family whose calls stream as they come: ``scan`` reads the text into the stretches
    of content and the calls, holding back (unless ``final``) what is not yet certain. Until
    a call is seen, only the content before the first marker streams (an output that ends
    without calls is all content, markers and all)."""

    def scan(self, text: str, final: bool, tools: list[dict] | None
             ) -> tuple[list[str], list[ParsedCall]]:
        """``(segments, calls)``: the text outside calls (the one before the first call,
        then one after each call) and the calls, cut ones included (``final``: their
        arguments as far as they got)."""
        raise NotImplementedError

    def parse(self, text, tools=None):
        segments, calls = self.scan(text, True, tools)
        return (call_content(segments), calls) if calls else (text, [])

    def partial(self, text, tools=None):
        segments, calls = self.scan(text, False, tools)
        if not calls:  # may stay without calls: then all of it is content, as written
            return super().partial(text, tools)
        return call_content(segments) or "", calls


class ToolCallStream:
    """One output's tool calls as they stream: ``feed(delta)`` and, at the end,
    ``finish()`` return lists of ``ContentDelta``/``CallStart``/``ArgsDelta`` events whose
    sum is ``parser.parse`` of the whole text (content events first in each list).

    Args:
        parser: the family's ``ToolParser``.
        tools: the request's tools (see ``ToolParser.parse``).
    """

    def __init__(self, parser: ToolParser, tools: list[dict] | None = None):
        self.parser, self.tools = parser, tools
        self.text = ""
        self.content = ""                       # content sent so far
        self.calls: list[list[str]] = []        # [name, arguments sent so far] per call

    def feed(self, delta: str) -> list[ToolEvent]:
        """Events for ``delta`` (the next piece of output text)."""
        self.text += delta
        return self._diff(*self.parser.partial(self.text, self.tools))

    def finish(self) -> list[ToolEvent]:
        """Events for the end of the output: held-back content, the rest of the calls."""
        content, calls = self.parser.parse(self.text, self.tools)
        return self._diff(content or "", calls)

    def result(self) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` as sent so far."""
        return self.content or None, [ParsedCall(n, a) for n, a in self.calls]

    def _diff(self, content: str, calls: list[ParsedCall]) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if len(content) > len(self.content) and content.startswith(self.content):
            out.append(ContentDelta(content[len(self.content):]))
            self.content = content
        for i, call in enumerate(calls):
            if i == len(self.calls):
                self.calls.append([call.name, ""])
                out.append(CallStart(i, call.name))
            sent = self.calls[i][1]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append(ArgsDelta(i, call.arguments[len(sent):]))
                self.calls[i][1] = call.arguments
        return out
