"""The ``tool_calls`` of a chat answer: ``ToolChatFormat`` and ``chat_format``.

``ToolChatFormat`` writes ``message.tool_calls`` (``finish_reason: "tool_calls"``) and, in a
stream, OpenAI's tool-call deltas: per call first ``{index, id, type, function: {name,
arguments: ""}}``, then argument fragments with the same ``index``. What the request asked
of tools (``ToolPlan``) comes from ``server/tools/plan.py``.

Stream and non-stream give the same calls, content and finish reason:

- a forced call (``required``, a named function) cut by ``max_tokens`` is still a call, with
  its arguments as far as they got and ``finish_reason: "length"`` (OpenAI's shape); a
  ``required`` call counts once its name is complete; a forced output with no call in it
  (cut before a name or any argument) is no call and empty content, never the constrained
  JSON itself (``[{"name": "``), so Responses and Messages answer no item or block for it;
- a forced call in gpt-oss's harmony format (``server/tools/harmony_calls.py``) is read by
  the ``gpt-oss`` parser (``ToolPlan.parser``), as with ``auto``;
- with ``auto``, a call to a function that is not in ``tools`` is no call: the output is
  content (as an output whose calls do not parse), and so is an output that a stop string
  cut inside a call (arguments that are not whole JSON): ``finish_reason: "stop"``;
- the content beside calls is the parser's (``call_content`` in ``server/tools/parsers.py``),
  which a stream sends as it comes;
- ``matched_stop`` is only on the chunk with the ``finish_reason``.
"""

from __future__ import annotations

import json
import re
import uuid

from server.http import json_text
from server.openai.formats import ChatFormat
from server.tools.parsers import START_MARKERS, ParsedCall, get_tool_parser
from server.tools.plan import ToolPlan

#: the start of one item of ``tool_choice: "required"``'s array (``calls_schema``), as far as
#: its name and, once begun, the ``parameters`` key
_REQUIRED_ITEM = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")'
                            r'(\s*,\s*"parameters"\s*:\s*)?')


def partial_required_calls(text: str) -> list[ParsedCall]:
    """The calls of a ``required`` output cut short (``[{"name": ..., "parameters": {...}},
    ...`` without its end): the whole items, then the cut one if its name is complete, with
    its arguments as far as they got."""
    i, calls = text.find("[") + 1, []
    if i == 0:
        return calls
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= len(text) or text[i] == "]":
            return calls
        try:
            val, i = json_text.raw_decode(text, i)
        except json_text.JSONTextError:
            m = _REQUIRED_ITEM.match(text, i)
            if m is not None:
                name = json_text.loads(m.group(1))
                calls.append(ParsedCall(name, text[m.end():] if m.group(2) else ""))
            return calls
        if not isinstance(val, dict) or not isinstance(val.get("name"), str):
            return calls
        calls.append(ParsedCall(val["name"], json.dumps(val.get("parameters", {}),
                                                        ensure_ascii=False)))


def chat_format(plan: ToolPlan, *args, **kwargs) -> ChatFormat:
    """The chat response writer of ``plan``: ``ChatFormat`` unless calls can come back."""
    if plan.choice in ("required", "named") or (plan.choice == "auto" and plan.parser):
        return ToolChatFormat(plan, *args, **kwargs)
    return ChatFormat(*args, **kwargs)


def _whole_json(call: ParsedCall) -> bool:
    """Whether ``call``'s arguments are a whole JSON value (not cut short)."""
    try:
        json_text.loads(call.arguments)
    except json_text.JSONTextError:
        return False
    return True


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolChatFormat(ChatFormat):
    """``ChatFormat`` that turns the output into ``tool_calls`` (see the module docstring).

    Args: a ``ToolPlan``, then ``ChatFormat``'s arguments.
    """

    def __init__(self, plan: ToolPlan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan
        self.sent = [0] * self.count          # content characters streamed, per choice
        self.named_id: list[str | None] = [None] * self.count
        self._calls_found = False
        #: the output is the named function's arguments (its JSON), streamed as they come
        self._named_json = plan.forced_json and plan.choice == "named"

    def calls(self, text: str, matched: str | int | None = None
              ) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` of a finished output; ``(text, [])`` if it holds none, and
        ``("", [])`` for a forced output without a call (see the module docstring for cut
        and unknown calls). ``matched``: the stop string or token id that ended it."""
        plan = self.plan
        if plan.parser is not None:  # auto, or a forced call in harmony
            parser = get_tool_parser(plan.parser)
            if self.reasoning is None:  # no split: the reasoning is content (gpt-oss)
                parser = parser.reasoning_inline()
            content, calls = parser.parse(text)
            names = {t["function"]["name"] for t in plan.tools}
            if any(c.name not in names for c in calls) or (
                    isinstance(matched, str) and not all(map(_whole_json, calls))):
                return parser.as_content(text), []
            return content, calls
        # forced: the output is the constrained JSON; without a call in it, no content either
        if plan.choice == "named":  # the output is the arguments, whole or cut
            return (None, [ParsedCall(plan.name, text)]) if text else ("", [])
        try:
            val = json_text.loads(text)
        except json_text.JSONTextError:
            calls = partial_required_calls(text)
            return (None, calls) if calls else ("", [])
        if not isinstance(val, list) or not all(
                isinstance(v, dict) and isinstance(v.get("name"), str) for v in val):
            return "", []
        return None, [ParsedCall(v["name"], json.dumps(v.get("parameters", {}),
                                                        ensure_ascii=False)) for v in val]

    @staticmethod
    def _tool_calls(calls: list[ParsedCall]) -> list[dict]:
        return [{"id": _call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]

    def _choice(self, index, ch, finish_reason):
        body = super()._choice(index, ch, finish_reason)
        content, calls = self.calls(ch.answer, ch.matched)  # the reasoning holds no calls
        if calls:
            body["message"]["content"] = None if content is None else self.clean(content)
            body["message"]["tool_calls"] = self._tool_calls(calls)
            if finish_reason == "stop":
                body["finish_reason"] = "tool_calls"
        elif self.plan.forced_json:  # no call: not the raw constrained JSON
            body["message"]["content"] = content
        elif content != ch.answer:  # calls not taken, shown as content (gpt-oss: no markup)
            body["message"]["content"] = self.clean(content or "")
        return body

    def _held_from(self, text: str) -> int:
        """Characters of ``text`` that may be streamed as content now (auto): up to the
        first call marker, or to a tail that could begin one, less the whitespace before
        it (which ``call_content`` drops when a call follows)."""
        if self.plan.parser is None:
            return 0
        markers = START_MARKERS[self.plan.parser]
        if self.plan.parser == "llama3":
            if not text.strip() or text.lstrip().startswith("{"):
                return 0
            markers = markers[:1]
        cut = min((i for m in markers if (i := text.find(m)) >= 0), default=len(text))
        for m in markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return len(text[:cut].rstrip())

    @staticmethod
    def _like(chunk: dict, delta: dict, finish_reason: str | None = None) -> dict:
        """A copy of the one-choice ``chunk`` with ``delta``, no logprobs and no
        ``matched_stop`` (which only the finishing chunk carries) nor ``token_ids`` (which
        the chunk itself carries)."""
        c = dict(chunk)
        choice = {k: v for k, v in chunk["choices"][0].items()
                  if k not in ("matched_stop", "token_ids")}
        c["choices"] = [dict(choice, delta=delta, logprobs=None, finish_reason=finish_reason)]
        return c

    def chunks(self, out):
        """``ChatFormat``'s chunks (logprobs kept), their content turned into tool calls."""
        i = out.index
        res = []
        for c in super().chunks(out):
            choice = c["choices"][0]
            delta, fin = choice["delta"], choice["finish_reason"]
            reasoning = delta.pop("reasoning_content", None)
            if "content" in delta or reasoning:
                if self._named_json and "content" in delta:  # the arguments
                    if self.named_id[i] is None:
                        self.named_id[i] = _call_id()
                        res.append(self._like(c, {"tool_calls": [{
                            "index": 0, "id": self.named_id[i], "type": "function",
                            "function": {"name": self.plan.name, "arguments": ""}}]}))
                    choice["delta"] = {"tool_calls": [{
                        "index": 0, "function": {"arguments": delta["content"]}}]}
                elif "content" in delta:  # content that cannot belong to a call; the rest
                    text = self.choices[i].answer  # waits for the end
                    safe = max(self._held_from(text), self.sent[i])
                    piece = self.clean(text[self.sent[i]:safe])
                    choice["delta"] = {"content": piece} if piece else {}
                    self.sent[i] = safe
                if reasoning:  # the reasoning goes out as it came, before the content
                    choice["delta"] = {"reasoning_content": reasoning, **choice["delta"]}
                if choice["delta"] or choice.get("logprobs") or choice.get("token_ids"):
                    res.append(c)
            if fin is not None:
                res.extend(self._final(c, i))
                if fin == "stop" and (self._named_json or self._calls_found):
                    choice["finish_reason"] = "tool_calls"
                res.append(c)
        return res

    def _final(self, chunk: dict, i: int) -> list[dict]:
        """The held-back content and the tool calls of choice ``i``, at its end."""
        self._calls_found = False
        if self._named_json:
            self._calls_found = True
            return []
        text = self.choices[i].answer
        content, calls = self.calls(text, self.choices[i].matched)
        res = []
        # what was streamed is a prefix of the content (``_held_from``): send the rest
        rest = self.clean((content or "")[self.sent[i]:])
        if rest:
            res.append(self._like(chunk, {"content": rest}))
        self.sent[i] = len(text)
        for k, (c, tc) in enumerate(zip(calls, self._tool_calls(calls))):
            res.append(self._like(chunk, {"tool_calls": [dict(tc, index=k, function={
                "name": c.name, "arguments": ""})]}))
            res.append(self._like(chunk, {"tool_calls": [{
                "index": k, "function": {"arguments": c.arguments}}]}))
        self._calls_found = bool(calls)
        return res
