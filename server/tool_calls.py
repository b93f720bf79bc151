"""OpenAI tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``,
``parallel_tool_calls``, and the ``tool_calls`` of the answer.

- ``tool_choice: "required"`` constrains the output with a JSON schema built from the tools:
  an array (one item when ``parallel_tool_calls`` is false) of
  ``{"name": <a tool's name>, "parameters": <its parameters schema>}``, as vLLM does.
- A named function (``{"type": "function", "function": {"name"}}``) constrains the output to
  that function's ``parameters`` schema: the output is the arguments.
- ``"auto"`` lets the model answer freely; the ``--tool-call-parser`` of its family
  (``server/tool_parsers.py``; ``auto`` reads the chat template) finds the calls.
- ``"none"``: no calls; the tools are still shown to the template (as vLLM does).

``ToolChatFormat`` writes ``message.tool_calls`` (``finish_reason: "tool_calls"``) and, in a
stream, OpenAI's tool-call deltas: per call first ``{index, id, type, function: {name,
arguments: ""}}``, then argument fragments with the same ``index``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.sampling.params import SamplingParams
from server import structured
from server.errors import bad_request
from server.formats import ChatFormat
from server.tool_parsers import START_MARKERS, ParsedCall, detect_parser, parse_tool_calls

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass
class ToolPlan:
    """What a chat request asked of tools. ``choice``: none | auto | required | named."""

    tools: list[dict] = field(default_factory=list)
    choice: str = "none"
    name: str | None = None       # the named function
    parallel: bool = True
    parser: str | None = None     # auto only

    @property
    def template_kwargs(self) -> dict:
        """``apply_chat_template`` keywords: ``tools`` when the request has tools."""
        return {"tools": self.tools} if self.tools else {}

    def format(self, *args, **kwargs) -> ChatFormat:
        """The chat response writer: ``ChatFormat`` unless calls can come back."""
        if self.choice in ("required", "named") or (self.choice == "auto" and self.parser):
            return ToolChatFormat(self, *args, **kwargs)
        return ChatFormat(*args, **kwargs)


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out, names = [], set()
    for i, t in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad_request("each tool must be {'type': 'function', 'function': {...}}",
                              f"{p}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request("function must be an object", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request("function.name must be 1-64 letters, digits, '_', '-' or '.'",
                              f"{p}.function.name")
        if name in names:
            raise bad_request(f"duplicate tool name {name!r}", f"{p}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict)
                                   or params.get("type", "object") != "object"):
            raise bad_request("function.parameters must be a JSON schema of an object",
                              f"{p}.function.parameters")
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request("function.description must be a string",
                              f"{p}.function.description")
        out.append({"type": "function", "function": dict(fn)})
    return out


def _params_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def calls_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of ``tool_choice: "required"``: a non-empty array of calls."""
    items = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": _params_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema = {"type": "array", "minItems": 1,
              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(req, chat_template: str | None, parser_arg: str = "auto") -> ToolPlan:
    """Validate ``tools``/``tool_choice``/``parallel_tool_calls`` of a chat request.

    Raises:
        APIError: 400 naming the field (a bad tool, an unknown function in ``tool_choice``,
            ``tool_choice`` other than "none" without tools).
    """
    extra = req.model_extra or {}
    plan = ToolPlan()
    if extra.get("tools") is not None:
        plan.tools = _tools(extra["tools"])
    par = extra.get("parallel_tool_calls", True)
    if not isinstance(par, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    plan.parallel = par
    choice = extra.get("tool_choice")
    if choice is None:
        choice = "auto" if plan.tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in {t["function"]["name"] for t in plan.tools}:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                              "tool_choice")
        plan.choice, plan.name = "named", name
    elif choice in ("none", "auto", "required"):
        plan.choice = choice
    else:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or a function",
                          "tool_choice")
    if plan.choice != "none" and not plan.tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    if plan.choice == "auto":
        plan.parser = detect_parser(chat_template) if parser_arg == "auto" else parser_arg
    return plan


async def prepare_chat(req, sp: SamplingParams, chat_template: str | None,
                       parser_arg: str = "auto") -> tuple[ToolPlan, SamplingParams]:
    """The tool plan of a chat request and its ``SamplingParams`` with the output
    constraint set (``response_format`` & co., or the tools' schema) and checked.

    Raises:
        APIError: 400 naming the field (see ``plan_tools`` and ``structured.constrain``);
            a forced tool call together with another output constraint.
    """
    plan = plan_tools(req, chat_template, parser_arg)
    found = structured.constraints_of(req)
    if plan.choice in ("required", "named"):
        if found:
            raise bad_request(f"tool_choice {plan.choice!r} cannot be combined with "
                              f"{found[0][0]}", "tool_choice")
        if plan.choice == "named":
            tool = next(t for t in plan.tools if t["function"]["name"] == plan.name)
            schema = _params_schema(tool)
        else:
            schema = calls_schema(plan.tools, plan.parallel)
        found = [("tools", "json_schema", json.dumps(schema))]
    c = structured.one_constraint(found)
    if c is not None:
        await structured.check(*c)
        sp = structured.with_constraint(sp, c[1], c[2])
    if plan.parser == "mistral":  # its [TOOL_CALLS] marker is a special token
        sp = msgspec.structs.replace(sp, skip_special_tokens=False)
    return plan, sp


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

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` of a finished output; ``(text, [])`` if it holds none."""
        plan = self.plan
        if plan.choice == "auto":
            return parse_tool_calls(plan.parser, text)
        try:
            val = json.loads(text)
        except ValueError:
            return text, []
        if plan.choice == "named":
            return (None, [ParsedCall(plan.name, text)]) if isinstance(val, dict) else (text, [])
        if not isinstance(val, list) or not all(
                isinstance(v, dict) and isinstance(v.get("name"), str) for v in val):
            return text, []
        return None, [ParsedCall(v["name"], json.dumps(v.get("parameters", {}),
                                                        ensure_ascii=False)) for v in val]

    @staticmethod
    def _tool_calls(calls: list[ParsedCall]) -> list[dict]:
        return [{"id": _call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]

    def _choice(self, index, ch, finish_reason):
        body = super()._choice(index, ch, finish_reason)
        content, calls = self.calls(ch.text)
        if calls:
            body["message"]["content"] = content
            body["message"]["tool_calls"] = self._tool_calls(calls)
            if finish_reason == "stop":
                body["finish_reason"] = "tool_calls"
        return body

    def _held_from(self, text: str) -> int:
        """Characters of ``text`` that may be streamed as content now (auto): up to the
        first call marker, or to a tail that could begin one."""
        if self.plan.choice != "auto":
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
        return cut

    @staticmethod
    def _like(chunk: dict, delta: dict, finish_reason: str | None = None) -> dict:
        """A copy of the one-choice ``chunk`` with ``delta`` and no logprobs."""
        c = dict(chunk)
        c["choices"] = [dict(chunk["choices"][0], delta=delta, logprobs=None,
                             finish_reason=finish_reason)]
        return c

    def chunks(self, out):
        """``ChatFormat``'s chunks (logprobs kept), their content turned into tool calls."""
        i = out.index
        res = []
        for c in super().chunks(out):
            choice = c["choices"][0]
            delta, fin = choice["delta"], choice["finish_reason"]
            if "content" in delta:
                if self.plan.choice == "named":  # the output is the arguments: stream them
                    if self.named_id[i] is None:
                        self.named_id[i] = _call_id()
                        res.append(self._like(c, {"tool_calls": [{
                            "index": 0, "id": self.named_id[i], "type": "function",
                            "function": {"name": self.plan.name, "arguments": ""}}]}))
                    choice["delta"] = {"tool_calls": [{
                        "index": 0, "function": {"arguments": delta["content"]}}]}
                else:  # content that cannot belong to a call; the rest waits for the end
                    text = self.choices[i].text
                    safe = max(self._held_from(text), self.sent[i])
                    choice["delta"] = {"content": text[self.sent[i]:safe]} \
                        if safe > self.sent[i] else {}
                    self.sent[i] = safe
                if choice["delta"] or choice.get("logprobs"):
                    res.append(c)
            if fin is not None:
                res.extend(self._final(c, i))
                if fin == "stop" and (self.plan.choice == "named" or self._calls_found):
                    choice["finish_reason"] = "tool_calls"
                res.append(c)
        return res

    def _final(self, chunk: dict, i: int) -> list[dict]:
        """The held-back content and the tool calls of choice ``i``, at its end."""
        self._calls_found = False
        if self.plan.choice == "named":
            self._calls_found = True
            return []
        text = self.choices[i].text
        content, calls = self.calls(text)
        res = []
        end = self._marker_at(text) if calls else len(text)
        rest = text[self.sent[i]:end]
        if rest and (rest.strip() or not calls):
            res.append(self._like(chunk, {"content": rest}))
        self.sent[i] = len(text)
        for k, (c, tc) in enumerate(zip(calls, self._tool_calls(calls))):
            res.append(self._like(chunk, {"tool_calls": [dict(tc, index=k, function={
                "name": c.name, "arguments": ""})]}))
            res.append(self._like(chunk, {"tool_calls": [{
                "index": k, "function": {"arguments": c.arguments}}]}))
        self._calls_found = bool(calls)
        return res

    def _marker_at(self, text: str) -> int:
        if self.plan.choice != "auto":
            return 0
        found = [i for m in START_MARKERS[self.plan.parser] if (i := text.find(m)) >= 0]
        return min(found, default=0)
