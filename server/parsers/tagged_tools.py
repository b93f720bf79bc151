"""The tool-call families whose calls sit between special tokens or tags, streamed as they
come (a call once its name is complete, its arguments as they grow):

- ``deepseekv3`` (DeepSeek V3/R1; vLLM's ``deepseek_v3``): ``<｜tool▁calls▁begin｜>``, then
  per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``.
- ``deepseekv31`` (DeepSeek V3.1/V3.2-Exp; vLLM's ``deepseek_v31``): the same section, per
  call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.
- ``kimi_k2``: ``<|tool_calls_section_begin|>``, per call ``<|tool_call_begin|>functions.NAME:
  IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``, ``<|tool_calls_section_end|>``.
- ``qwen3_coder`` (Qwen3-Coder, Qwen3-Next; vLLM's ``qwen3_xml`` too): ``<tool_call>
  <function=NAME><parameter=P>value</parameter>...</function></tool_call>`` (a value's one
  leading and trailing newline are the template's, not the value's).
- ``glm45`` (GLM-4.5/4.6; SGLang's ``glm``): ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n
  <arg_value>v</arg_value>...</tool_call>``.
- ``gpt-oss`` (vLLM's ``openai``): harmony messages (``server/parsers/harmony.py``) to
  ``functions.NAME``; beside calls, the ``final`` and preamble bodies are the content and
  ``analysis`` is dropped (the reasoning parser's; content when no reasoning parser split
  it off, ``separate_reasoning: false``: ``reasoning_inline``). An output without calls is all content
  as written, as with every family: run the ``gpt-oss`` reasoning parser first, whose
  content is the final text with the tool-call messages left as written.

Arguments are the model's JSON as written (``deepseek*``, ``kimi_k2``, ``gpt-oss``), not
checked, or a JSON object built from the XML parameters, values typed by the tool's schema
(``server/parsers/schema_values.py``). A call cut by the end of the output is a call with
its arguments as far as they got (one cut before its name is complete is left out); a
``<tool_call>`` block without a name is content.
"""

from __future__ import annotations

from server.parsers import harmony
from server.parsers.base import (
    ParsedCall,
    ScanToolParser,
    first_of,
    tail_hold,
)
from server.parsers.schema_values import json_item, param_schema, typed_value


class SectionParser(ScanToolParser):
    """Calls ``call_begin HEADER header_end ARGS args_end`` inside ``section_begin ...
    section_end`` (the section may also be left out, a lone ``call_begin`` opening it)."""

    section_begin = section_end = call_begin = header_end = args_end = ""

    @property
    def markers(self):
        return (self.section_begin, self.call_begin)

    def call_name(self, header: str) -> str:
        return header.strip()

    def scan(self, text, final, tools):
        segments, calls = [], []
        cur, pos = "", 0
        while True:
            i, m = first_of(text, self.markers, pos)
            if i < 0:
                end = len(text) if final else tail_hold(text, pos, self.markers)
                segments.append(cur + text[pos:end])
                return segments, calls
            segments.append(cur + text[pos:i])
            cur, pos = "", i + (len(m) if m == self.section_begin else 0)
            pos, done = self._section(text, pos, final, calls)
            if done:
                return segments, calls

    def _section(self, text: str, pos: int, final: bool, calls: list[ParsedCall]
                 ) -> tuple[int, bool]:
        """Read the calls of a section from ``pos``: ``(where the text after it begins,
        whether the output ends inside it)``."""
        while True:
            c, m = first_of(text, (self.call_begin, self.section_end), pos)
            if c < 0:
                return len(text), True
            if m == self.section_end:
                return c + len(m), False
            h = text.find(self.header_end, c + len(m))
            if h < 0:  # the name is not complete
                return len(text), True
            name = self.call_name(text[c + len(m):h])
            a = h + len(self.header_end)
            e = text.find(self.args_end, a)
            stop = e if e >= 0 else len(text) if final else tail_hold(text, a, (self.args_end,))
            if name:
                calls.append(ParsedCall(name, text[a:stop].strip()))
            if e < 0:
                return len(text), True
            pos = e + len(self.args_end)


class DeepSeekV3Parser(SectionParser):
    name = "deepseekv3"
    needs_special_tokens = True
    section_begin, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, header_end = "<｜tool▁call▁begin｜>", "```json"
    args_end = "```<｜tool▁call▁end｜>"

    def call_name(self, header):  # "function<｜tool▁sep｜>NAME\n"
        return header.rpartition("<｜tool▁sep｜>")[2].strip()


class DeepSeekV31Parser(SectionParser):
    name = "deepseekv31"
    needs_special_tokens = True
    section_begin, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, header_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
    args_end = "<｜tool▁call▁end｜>"


class KimiK2Parser(SectionParser):
    name = "kimi_k2"
    needs_special_tokens = True
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin, header_end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
    args_end = "<|tool_call_end|>"

    def call_name(self, header):  # "functions.NAME:IDX"
        h = header.strip()
        head, _, idx = h.rpartition(":")
        if head and idx.isdigit():
            h = head
        return h.removeprefix("functions.")


class XmlCallParser(ScanToolParser):
    """Calls in ``<tool_call>...</tool_call>`` blocks whose parameters are XML-ish pairs;
    ``read_call`` reads a block's body."""

    call_begin, call_end = "<tool_call>", "</tool_call>"

    @property
    def markers(self):
        return (self.call_begin,)

    def read_call(self, body: str, whole: bool, tools) -> tuple[str | None, list[tuple]]:
        """``(name or None if not yet/never complete, [(key, raw value), ...] complete)``;
        ``whole``: the body will not grow."""
        raise NotImplementedError

    def scan(self, text, final, tools):
        segments, calls = [], []
        cur, pos = "", 0
        while True:
            i = text.find(self.call_begin, pos)
            if i < 0:
                end = len(text) if final else tail_hold(text, pos, self.markers)
                segments.append(cur + text[pos:end])
                return segments, calls
            j = text.find(self.call_end, i)
            start = i + len(self.call_begin)
            body = text[start:j] if j >= 0 else text[start:]
            name, pairs = self.read_call(body, j >= 0 or final, tools)
            if name is None and (j >= 0 or final):  # no name: the block is content
                cur += text[pos:j + len(self.call_end) if j >= 0 else len(text)]
                if j < 0:
                    segments.append(cur)
                    return segments, calls
                pos = j + len(self.call_end)
                continue
            segments.append(cur + text[pos:i])
            cur = ""
            if name is None:  # still coming
                return segments, calls
            items = [json_item(k, typed_value(v, param_schema(tools, name, k)))
                     for k, v in pairs]
            closing = "}" if j >= 0 or final else ""
            calls.append(ParsedCall(name, "{" + ", ".join(items) + closing))
            if j < 0:
                return segments, calls
            pos = j + len(self.call_end)


def _pairs(body: str, pos: int, key_open: str, key_close: str, val_open: str,
           val_close: str) -> list[tuple[str, str]]:
    """The complete ``key_open K key_close ... val_open V val_close`` pairs from ``pos``."""
    out = []
    while True:
        k = body.find(key_open, pos)
        if k < 0:
            return out
        kc = body.find(key_close, k + len(key_open))
        v = body.find(val_open, kc + len(key_close)) if kc >= 0 else -1
        vc = body.find(val_close, v + len(val_open)) if v >= 0 else -1
        if vc < 0:
            return out
        out.append((body[k + len(key_open):kc].strip(), body[v + len(val_open):vc]))
        pos = vc + len(val_close)


class Qwen3CoderParser(XmlCallParser):
    name = "qwen3_coder"

    def read_call(self, body, whole, tools):
        f = body.find("<function=")
        g = body.find(">", f) if f >= 0 else -1
        if g < 0 or not body[f + 10:g].strip():
            return None, []
        pairs = []
        for key, value in _pairs(body, g + 1, "<parameter=", ">", "", "</parameter>"):
            value = value.removeprefix("\n").removesuffix("\n")
            pairs.append((key, value))
        return body[f + 10:g].strip(), pairs


class Glm45Parser(XmlCallParser):
    name = "glm45"

    def read_call(self, body, whole, tools):
        ends = [e for e in (body.find("\n"), body.find("<arg_key>")) if e >= 0]
        end = min(ends) if ends else (len(body) if whole else -1)
        if end < 0 or not body[:end].strip():
            return None, []
        pairs = _pairs(body, end, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
        return body[:end].strip(), pairs


class GptOssParser(ScanToolParser):
    """Harmony's calls (see the module docstring).

    Args:
        keep_analysis: the ``analysis`` bodies are content too (no reasoning parser split
            them off: ``reasoning_inline``); False: dropped, as the reasoning parser's.
    """

    name = "gpt-oss"
    needs_special_tokens = True
    markers = harmony.OPENERS

    def __init__(self, keep_analysis: bool = False):
        self.keep_analysis = keep_analysis

    def reasoning_inline(self):
        return self if self.keep_analysis else _GPT_OSS_INLINE

    def _content(self, piece: harmony.Piece) -> bool:
        return piece.channel != "analysis" or self.keep_analysis

    def scan(self, text, final, tools):
        segments, calls, cur = [], [], ""
        for piece in harmony.split(text, final):
            if piece.channel is None or (self._content(piece) and not piece.recipient):
                cur += piece.raw if piece.channel is None else piece.body
            elif piece.recipient:
                segments.append(cur)
                cur = ""
                calls.append(ParsedCall(piece.recipient.removeprefix("functions."),
                                        piece.body.strip()))
        segments.append(cur)
        return segments, calls

    def as_content(self, text):
        """The bodies of the messages (calls' too) and the text outside them, no markup;
        ``analysis`` left out (the reasoning parser's) unless ``keep_analysis``."""
        return "".join(p.raw if p.channel is None else p.body
                       for p in harmony.split(text, True) if self._content(p))


_GPT_OSS_INLINE = GptOssParser(keep_analysis=True)

