"""Chat templates: ``ChatTokenizer`` (tokenize, decode, render a conversation; the
``chat`` member of ``TokenizerManager``) and the tools fallback for templates that ignore
``tools``.

transformers passes a request's ``tools`` to the chat template, and the template decides how
the model sees them. Some templates never look at them: the embedded SmolLM2-135M-Instruct's
renders each message's role and content and nothing else, so with it the model never saw the
tools and ``tool_choice: "auto"`` could never call one. ``template_ignores_tools`` finds such a
template once, at start-up, by rendering a conversation with a probe tool; for those,
``TokenizerManager`` renders the tool protocol into the messages themselves, the way Qwen
2.5's template does (the hermes format, which ``--tool-call-parser hermes`` reads):

- the tools block (below) ends the first system message, or is a system message of its own
  put first when the conversation has none (the template's default system prompt, if it
  has one, then gives way, as with any system message);
- an assistant message's ``tool_calls`` become ``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>`` lines after its content;
- ``tool`` messages become one user message of ``<tool_response>\\n...\\n</tool_response>``
  blocks per run of consecutive results.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from engine.args import chat_template_text
from server.http.errors import bad_request

logger = logging.getLogger("ferry.server")

#: the tool the start-up probe renders (its name must appear in a template's output that
#: shows tools)
PROBE_TOOL = {"type": "function", "function": {
    "name": "ferry_probe_tool_3c9e", "description": "Probe whether the template shows tools.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}

#: Qwen 2.5's tools block (its chat template's text), around one JSON line per tool
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user "
                "query.\n\nYou are provided with function signatures within <tools></tools> "
                "XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function "
                "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def template_ignores_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template leaves ``tools`` out of the prompt.

    Renders one user message with and without :data:`PROBE_TOOL`: the template ignores
    tools when the two texts are equal or the probe's name is missing, and also when it
    fails with tools only. Without a tokenizer or a usable template: False (chat requests
    fail on their own there).
    """
    if tokenizer is None:
        return False
    messages = [{"role": "user", "content": "Hi"}]

    def render(**kw) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **kw)

    try:
        plain = render()
    except Exception:  # noqa: BLE001 - no template (or a broken one): nothing to fall back on
        return False
    try:
        shown = render(tools=[PROBE_TOOL])
    except Exception:  # noqa: BLE001 - a template that cannot take tools at all
        return True
    return shown == plain or PROBE_TOOL["function"]["name"] not in shown


def tools_block(tools: list[dict]) -> str:
    """The system-prompt text that shows ``tools`` (OpenAI's ``{"type": "function",
    "function": {...}}`` objects) to the model, in Qwen 2.5's hermes layout."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    body = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})},
                      ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def with_tools_rendered(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` (``apply_chat_template`` dicts) with the tool protocol written into
    their text, for a template that ignores it (see the module docstring).

    Args:
        messages: role/content dicts; assistant ones may hold ``tool_calls`` (arguments
            decoded, as ``server/tools/messages.py`` gives them), tool ones ``tool_call_id``.
        tools: the request's tools, or None/empty (then no tools block).
    Returns:
        new dicts (the input is not changed) with only role and content (plus ``name``,
        ``reasoning_content`` where given).
    """
    out: list[dict] = []
    results: dict | None = None  # the user message collecting a run of tool results
    for m in messages:
        if m.get("role") == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1] is results:
                results["content"] += "\n" + block
            else:
                results = {"role": "user", "content": block}
                out.append(results)
            continue
        new = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = new.get("content") or ""
            new["content"] = f"{content}\n{calls}" if content else calls
        out.append(new)
    if tools:
        block = tools_block(tools)
        if out and out[0].get("role") == "system":
            out[0] = dict(out[0], content=f"{out[0].get('content') or ''}\n\n{block}")
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


#: architecture -> (reasoning parser, tool-call parser) used when the flags leave them to the
#: server (no ``--reasoning-parser``, ``--tool-call-parser auto``): gpt-oss always speaks
#: harmony, whatever its checkpoint's chat template says (vLLM and SGLang do the same)
FAMILY_PARSERS = {"GptOssForCausalLM": ("gpt-oss", "gpt-oss")}


def with_thinking(messages: list[dict]) -> list[dict]:
    """``messages`` with each ``reasoning_content`` also given as ``thinking``, the name
    gpt-oss's template reads (it renders the reasoning that led to a tool call back into
    the analysis channel); a message's own ``thinking`` is kept. New dicts where changed."""
    return [dict(m, thinking=m["reasoning_content"])
            if m.get("reasoning_content") and "thinking" not in m else m for m in messages]


class ChatTokenizer:
    """The tokenizer side of :class:`server.tokenizer_manager.TokenizerManager` (its
    ``chat`` member): tokenize, decode and render chat templates (with the tools fallback).

    Args:
        args: the ``ServerArgs`` (its ``tool_call_parser``).
    """

    def __init__(self, args):
        self.args = args
        self.tokenizer: Any = None  # None until set_tokenizer (token-id prompts only)
        #: the chat template ignores ``tools``: render them into the messages instead
        self.tools_fallback = False
        #: the served model's architecture (``FAMILY_PARSERS``' key); "" when unknown
        self.architecture = ""

    def set_tokenizer(self, tokenizer, architecture: str = "") -> None:
        """Use ``tokenizer`` (None: token-id prompts only) and probe its chat template: one
        that ignores ``tools`` gets the tools fallback (logged once). ``architecture``: the
        served model's, whose family may choose the parsers the flags leave open (logged).
        ``--chat-template`` (a file or inline Jinja) replaces the tokenizer's template first.

        Raises:
            OSError: the ``--chat-template`` file cannot be read.
        """
        given = getattr(self.args, "chat_template", None)
        if tokenizer is not None and given:
            tokenizer.chat_template = chat_template_text(given)
            logger.info("chat template: --chat-template %s", given if os.path.isfile(given)
                        else "(inline)")
        self.tokenizer = tokenizer
        self.architecture = architecture
        self.tools_fallback = template_ignores_tools(tokenizer)
        if self.tools_fallback:
            logger.info("the chat template ignores tools: they are written into the system "
                        "message in the hermes format (<tool_call> JSON), parsed with "
                        "--tool-call-parser %s (docs/usage.md#the-tools-fallback)",
                        self.tool_call_parser)
        family = FAMILY_PARSERS.get(architecture)
        if family is None:
            return
        chosen = []
        if getattr(self.args, "reasoning_parser", None) is None:
            chosen.append(f"--reasoning-parser {family[0]}")
        if self.args.tool_call_parser == "auto" and not self.tools_fallback:
            chosen.append(f"--tool-call-parser {family[1]}")
        if chosen:
            logger.info("%s: defaulting to %s (the family's output format; pass the flag "
                        "to choose another)", architecture, " and ".join(chosen))

    @property
    def tool_call_parser(self) -> str:
        """``--tool-call-parser``, with ``auto`` meaning ``hermes`` under the tools fallback
        (the format it shows the model), else the family's (``FAMILY_PARSERS``), else
        ``auto`` (read from the chat template)."""
        arg = self.args.tool_call_parser
        if arg != "auto":
            return arg
        if self.tools_fallback:
            return "hermes"
        family = FAMILY_PARSERS.get(self.architecture)
        return family[1] if family else arg

    @property
    def reasoning_parser(self) -> str | None:
        """``--reasoning-parser``; when not given, the family's (``FAMILY_PARSERS``), else
        None (the output is not split)."""
        arg = getattr(self.args, "reasoning_parser", None)
        if arg is None and (family := FAMILY_PARSERS.get(self.architecture)):
            return family[0]
        return arg

    def need_tokenizer(self, param: str = "prompt"):
        """The tokenizer. Raises: APIError 400 naming ``param`` when the server has none."""
        if self.tokenizer is None:
            hint = "; send token ids as the prompt" if param == "prompt" else ""
            raise bad_request(f"this server has no tokenizer{hint}", param)
        return self.tokenizer

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (tokenized in a worker thread)."""
        tok = self.need_tokenizer()
        return await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (decoded in a worker thread); "" when there is no tokenizer."""
        if self.tokenizer is None:
            return ""
        return await asyncio.to_thread(self.tokenizer.decode, ids,
                                       skip_special_tokens=skip_special_tokens,
                                       clean_up_tokenization_spaces=False)

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  add_special_tokens: bool = False, *,
                                  continue_final_message: bool = False,
                                  template_kwargs: dict | None = None,
                                  expand_text=None) -> list[int]:
        """Render ``messages`` with the tokenizer's chat template and tokenize.

        Args:
            messages: ``{"role", "content"}`` dicts.
            add_generation_prompt: end with the assistant turn's header.
            add_special_tokens: let the tokenizer add its BOS etc. on top of the template
                (False: the template already writes them).
            continue_final_message: end the prompt inside the last message, without its
                end-of-turn tokens, so the reply continues it (assistant prefill).
            template_kwargs: extra template variables (``chat_template_kwargs``; the
                request model refuses keys of ``apply_chat_template`` itself), and ``tools``
                (rendered into the messages under ``tools_fallback``).
            expand_text: ``expand_text(text) -> text`` applied to the rendered prompt before
                tokenizing (a model's image-token expansion in text, Gemma 3's), or None.
        Raises:
            APIError: 400 if the template rejects the conversation or there is none.
        """
        tok = self.need_tokenizer()
        extra = dict(template_kwargs or {})
        if self.tools_fallback:  # the template would drop them: they go into the messages
            messages = with_tools_rendered(messages, extra.pop("tools", None))
        template = getattr(tok, "chat_template", None)
        if isinstance(template, str) and ".thinking" in template:
            messages = with_thinking(messages)

        def render() -> str:
            return tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           **extra)

        try:
            text = await asyncio.to_thread(render)
        except Exception as exc:  # noqa: BLE001 - jinja's raise_exception, or no template
            raise bad_request(f"the chat template rejected the messages: {exc}",
                              "messages") from None
        if expand_text is not None:
            text = expand_text(text)
        return await self.tokenize(text, add_special_tokens=add_special_tokens)
