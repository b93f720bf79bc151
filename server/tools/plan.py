"""OpenAI tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``,
``parallel_tool_calls``, and the ``tool_calls`` of the answer.

- ``tool_choice: "required"`` constrains the output with a JSON schema built from the tools:
  an array (one item when ``parallel_tool_calls`` is false) of
  ``{"name": <a tool's name>, "parameters": <its parameters schema>}``, as vLLM does.
- A named function (``{"type": "function", "function": {"name"}}``) constrains the output to
  that function's ``parameters`` schema: the output is the arguments.
- ``"auto"`` lets the model answer freely; the ``--tool-call-parser`` of its family
  (``server/tools/parsers.py``; ``auto`` reads the chat template) finds the calls.
- ``"none"``: no calls; the tools are still shown to the template (as vLLM does).
- With gpt-oss's harmony (the ``gpt-oss`` reasoning parser) a forced call is a grammar of the
  whole output instead, read by the ``gpt-oss`` parser (``server/tools/harmony_calls.py``,
  set up in ``server/pipeline/job.py``).

``ToolChatFormat`` (``server/openai/tool_format.py``) writes the ``tool_calls`` of the answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.sampling.params import SamplingParams
from server.http import json_text
from server.http.errors import APIError, bad_request
from server.tools import structured
from server.tools.parsers import detect_parser
from server.tools.schema_check import SchemaShapeError, check_schema_shape

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
#: keys of a tool and of its function (OpenAI's); any other is a 400 naming it
TOOL_KEYS = frozenset({"type", "function"})
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _unknown_key(value: dict, allowed, param: str) -> None:
    for key in value:
        if key not in allowed:
            raise bad_request(f"unrecognized field '{key}' (allowed: "
                              f"{', '.join(sorted(allowed))})", f"{param}.{key}")


@dataclass
class ToolPlan:
    """What a chat request asked of tools. ``choice``: none | auto | required | named."""

    tools: list[dict] = field(default_factory=list)
    choice: str = "none"
    name: str | None = None       # the named function
    parallel: bool = True
    #: the tool parser that reads the calls from the output text: auto's, or ``gpt-oss``
    #: for a forced call in harmony (``server/tools/harmony_calls.py``); None: a forced
    #: call's output is its constrained JSON
    parser: str | None = None

    @property
    def forced_json(self) -> bool:
        """Whether the output is a forced call's JSON (``required``: the calls' array; named:
        the arguments) rather than text the ``parser`` reads."""
        return self.choice in ("required", "named") and self.parser is None

    @property
    def template_kwargs(self) -> dict:
        """``apply_chat_template`` keywords: ``tools`` when the request has tools."""
        return {"tools": self.tools} if self.tools else {}


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
        _unknown_key(t, TOOL_KEYS, p)
        _unknown_key(fn, FUNCTION_KEYS, f"{p}.function")
        if not isinstance(fn.get("strict", False), bool | None):
            # the arguments of a forced call always match the parameters: strict or not
            raise bad_request("function.strict must be a boolean", f"{p}.function.strict")
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
        try:
            json_text.check_depth(params)
        except json_text.JSONTextError as exc:
            raise bad_request(f"function.parameters is {exc}", f"{p}.function.parameters"
                              ) from None
        try:  # before a chat template walks it (its error could only name messages)
            check_schema_shape({} if params is None else params)
        except SchemaShapeError as exc:
            raise bad_request(f"Invalid schema for function {name!r}: {exc}",
                              f"{p}.function.parameters") from None
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request("function.description must be a string",
                              f"{p}.function.description")
        out.append({"type": "function", "function": dict(fn)})
    return out


def params_schema(tool: dict) -> dict:
    """The JSON schema of a (checked) tool's arguments: its ``parameters``, or an empty
    object's."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def calls_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of ``tool_choice: "required"``: a non-empty array of calls."""
    items = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": params_schema(t)},
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
        _unknown_key(choice, TOOL_KEYS, "tool_choice")
        _unknown_key(fn, {"name"}, "tool_choice.function")
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


async def _check_enforced_schemas(plan: ToolPlan) -> None:
    """400 naming ``tools[i].function.parameters`` for a schema xgrammar cannot compile,
    of each tool whose schema constrains the output (``required``: all; a named function:
    its own) or is declared ``strict``; a non-strict tool under ``auto`` or ``none`` is only
    shown to the model."""
    for i, tool in enumerate(plan.tools):
        fn = tool["function"]
        if fn.get("strict") is True or plan.choice == "required" or (
                plan.choice == "named" and fn["name"] == plan.name):
            try:
                await structured.check(f"tools[{i}].function.parameters", "json_schema",
                                       json.dumps(params_schema(tool)))
            except APIError as err:
                raise bad_request(f"Invalid schema for function {fn['name']!r}: "
                                  f"{err.message.split(': ', 1)[-1]}", err.param) from None


async def prepare_chat(req, sp: SamplingParams, chat_template: str | None,
                       parser_arg: str = "auto") -> tuple[ToolPlan, SamplingParams]:
    """The tool plan of a chat request and its ``SamplingParams`` with the output
    constraint set (``response_format`` & co., or the tools' schema) and checked.

    Raises:
        APIError: 400 naming the field (see ``plan_tools`` and ``structured.constrain``);
            a forced tool call together with another output constraint.
    """
    plan = plan_tools(req, chat_template, parser_arg)
    await _check_enforced_schemas(plan)
    found = structured.constraints_of(req)
    if plan.choice in ("required", "named"):
        if found:
            raise bad_request(f"tool_choice {plan.choice!r} cannot be combined with "
                              f"{found[0][0]}", "tool_choice")
        if plan.choice == "named":
            tool = next(t for t in plan.tools if t["function"]["name"] == plan.name)
            schema = params_schema(tool)
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
