"""The prompt of a chat request: its messages as the model's chat template wants them
(``messages_for_template``), rendered and tokenized (``chat_prompt``).

``chat_prompt`` is the one function that turns a chat request into prompt token ids: chat
completions, ``/v1/responses`` (through ``server/pipeline/job.py``'s ``prepare``) and
``/v1/tokenize`` with ``messages`` all call it, so ``/v1/tokenize`` counts exactly the tokens
the chat request would run (its ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs`` and ``tools``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from server.http.errors import bad_request, not_supported
from server.media.fetch import load_image
from server.media.process import ImageError
from server.tokenizer_manager import TokenizerManager
from server.tools.messages import (
    assistant_function_call,
    assistant_tool_calls,
    check_tool_replies,
)
from server.tools.plan import ToolPlan

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}
#: message fields passed to the chat template as they are (besides role and content)
TEMPLATE_FIELDS = ("name", "reasoning_content", "tool_call_id")
#: message fields accepted and ignored: OpenAI's record of an assistant turn
MESSAGE_NOOPS = frozenset({"refusal", "annotations"})
#: message fields of tool calling (server/tools/messages.py converts tool_calls), and the
#: roles that may carry each (elsewhere a 400: they would be dropped)
TOOL_FIELDS = {"tool_calls": "assistant", "function_call": "assistant", "tool_call_id": "tool"}
#: keys of a content part
PART_KEYS = frozenset({"type", "text"})
#: keys of an image part, and of its ``image_url`` object (``detail`` is accepted and
#: ignored: the model's image processor sizes every image within its pixel bounds)
IMAGE_PART_KEYS = frozenset({"type", "image_url"})
IMAGE_URL_KEYS = frozenset({"url", "detail"})
IMAGE_DETAILS = (None, "auto", "low", "high")


def _image_part(part: dict, where: str) -> str:
    """The URL of an ``image_url`` part (``{"url", "detail"}`` object or a bare URL string).

    Raises: APIError 400 naming the field of a malformed part."""
    for key in part:
        if key not in IMAGE_PART_KEYS:
            raise bad_request(f"unrecognized content part field '{key}'", f"{where}.{key}")
    spec = part.get("image_url")
    if isinstance(spec, str):
        return spec
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise bad_request("an image_url part needs image_url.url, a string",
                          f"{where}.image_url")
    for key in spec:
        if key not in IMAGE_URL_KEYS:
            raise bad_request(f"unrecognized image_url field '{key}'",
                              f"{where}.image_url.{key}")
    if spec.get("detail") not in IMAGE_DETAILS:
        raise bad_request("image_url.detail must be 'auto', 'low' or 'high'",
                          f"{where}.image_url.detail")
    return spec["url"]


def _content_parts(content: list, role: str, where: str, images: list | None
                   ) -> str | list[dict]:
    """A message's list of content parts as template content: the texts joined with
    newlines, or (with an image) the ``text``/``image`` parts; images noted in ``images``
    (see :func:`messages_for_template`). Raises: APIError 400 naming the part."""
    texts = []
    parts: list[dict] = []
    for j, part in enumerate(content):
        ptype = part.get("type")
        if ptype == "image_url" and role == "user":
            url = _image_part(part, f"{where}.content[{j}]")
            if images is not None:
                images.append((f"{where}.content[{j}].image_url", url))
            parts.append({"type": "image"})
            continue
        if ptype != "text":
            raise bad_request(f"content part type {ptype!r} is not supported (only "
                              "'text', and 'image_url' in user messages)",
                              f"{where}.content[{j}].type")
        for key in part:
            if key not in PART_KEYS:
                raise bad_request(f"unrecognized content part field '{key}'",
                                  f"{where}.content[{j}].{key}")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request("a text part needs a string 'text'",
                              f"{where}.content[{j}].text")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def messages_for_template(messages: list[Any], images: list | None = None) -> list[dict]:
    """Plain ``{"role", "content"}`` dicts for ``apply_chat_template``.

    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined
    with newlines) and ``{"type": "image_url", "image_url": {"url", "detail"}}`` parts: a
    message with images keeps its parts as a list, ``{"type": "text", "text"}`` and
    ``{"type": "image"}`` (what multimodal chat templates render), and each image's
    ``(part name, url)`` is appended to ``images`` (e.g. ``("messages[1].content[0]
    .image_url", "data:image/png;base64,...")``). ``developer`` maps to ``system``. ``name`` and ``reasoning_content`` go
    to the template; ``refusal`` and ``annotations`` are accepted no-ops. An assistant's
    ``tool_calls`` (or its deprecated ``function_call``: one call) and a tool message's
    ``tool_call_id`` go to the template too.

    Raises:
        APIError: 400 for an unknown role, a non-text part, a tool-calling field on a role
            that cannot carry it (``tool_calls`` on a user message...), both ``tool_calls``
            and ``function_call``, or any other field, of the message or of a part (named,
            e.g. ``messages[1].audio``, ``messages[0].content[2].cache_control``); a tool
            message with no assistant ``tool_calls`` before it, or whose ``tool_call_id``
            is not a string or names none of their ids
            (``server/tools/messages.py``'s ``check_tool_replies``).
    """
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = CHAT_ROLES.get(m.role) or ("tool" if m.role == "tool" else None)
        if role is None:
            if m.role == "function":
                raise not_supported(f"{where}.role", f"role '{m.role}'")
            raise bad_request(f"unknown role '{m.role}' (expected one of "
                              f"{sorted([*CHAT_ROLES, 'tool'])})", f"{where}.role")
        extra = m.model_extra or {}
        for key in extra:
            if key not in MESSAGE_NOOPS and key not in TOOL_FIELDS and key != "reasoning_content":
                raise bad_request(f"unrecognized message field '{key}'", f"{where}.{key}")
            if key in TOOL_FIELDS and extra[key] not in (None, []) and role != TOOL_FIELDS[key]:
                raise bad_request(f"'{key}' is only allowed on {TOOL_FIELDS[key]} messages "
                                  f"(this one is a '{m.role}' message)", f"{where}.{key}")
        tool_calls = assistant_tool_calls(extra["tool_calls"], where) \
            if extra.get("tool_calls") else None
        if extra.get("function_call") is not None:
            if tool_calls:
                raise bad_request("send either tool_calls or the deprecated function_call, "
                                  "not both", f"{where}.function_call")
            tool_calls = assistant_function_call(extra["function_call"], where)
        if not isinstance(extra.get("tool_call_id", ""), str):
            raise bad_request("tool_call_id must be a string (the id of the tool call this "
                              "message answers)", f"{where}.tool_call_id")
        content = m.content
        if content is None:
            if role != "assistant":
                raise bad_request("content is required", f"{where}.content")
            content = ""
        elif isinstance(content, list):
            content = _content_parts(content, role, where, images)
        msg = {"role": role, "content": content}
        for key in TEMPLATE_FIELDS:
            value = m.name if key == "name" else extra.get(key)
            if isinstance(value, str):
                msg[key] = value
        if tool_calls:
            msg["tool_calls"] = tool_calls
        out.append(msg)
    check_tool_replies(out)
    return out


async def chat_prompt(tm: TokenizerManager, req: Any, tools: ToolPlan) -> list[int]:
    """The prompt token ids of a chat request (:func:`chat_prompt_images`' ids: an
    image counts as its tokens)."""
    return (await chat_prompt_images(tm, req, tools))[0]


async def chat_prompt_images(tm: TokenizerManager, req: Any, tools: ToolPlan
                             ) -> tuple[list[int], list]:
    """The prompt token ids of a chat request (a ``ChatCompletionRequest`` or a
    ``TokenizeRequest`` with ``messages``): its messages through the model's chat template
    with its ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``,
    ``chat_template_kwargs``, the tools of ``tools`` and OpenAI's ``reasoning_effort``
    (the template variable of that name, for the templates that read it: gpt-oss's;
    ``chat_template_kwargs.reasoning_effort`` wins).

    Images (``image_url`` parts): read and checked (``server/media/fetch.py``), processed
    by the model's image processor and their tokens expanded (``server/media/process.py``).

    Returns:
        ``(prompt ids, images)``: the images as ``engine.io_struct.ImageData``, [] for none.
    Raises:
        APIError: 400 naming the message or field the template rejects, a
            ``reasoning_effort`` that is not a string, or the image part at fault
            (``messages[1].content[0].image_url``): more images than
            ``--limit-mm-per-prompt``, a model without image input, an image that cannot be
            read, decoded or processed; the text that holds an image-pad token typed
            (``messages[0].content``: only image parts place it).
    """
    kwargs = dict(req.chat_template_kwargs or {}, **tools.template_kwargs)
    effort = (getattr(req, "model_extra", None) or {}).get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise bad_request("reasoning_effort must be a string (e.g. 'low', 'medium', "
                              "'high')", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
    refs: list = []
    messages = messages_for_template(req.messages, refs)
    _check_typed_markers(tm, req.messages)
    if refs:
        await _check_images(tm, refs)
    ids = await tm.chat.apply_chat_template(
        messages, req.add_generation_prompt,
        bool(req.add_special_tokens), continue_final_message=req.continue_final_message,
        template_kwargs=kwargs, expand_text=tm.images.expand_text if refs else None)
    if not refs or tm.images.expand_text is None:  # an expanded text's runs: process checks
        _check_typed_pads(tm, req.messages, ids, len(refs))
    if not refs:
        return ids, []
    pics = [await load_image(url, where, tm.media_limits, tm.images.max_pixels)
            for where, url in refs]
    try:
        return await asyncio.to_thread(tm.images.process, ids, pics)
    except ImageError as exc:
        where = refs[exc.index][0] if 0 <= exc.index < len(refs) else "messages"
        raise bad_request(exc.message, where) from None


async def _check_images(tm: TokenizerManager, refs: list) -> None:
    """400 naming the part: images to a model without image input, or more than the
    per-prompt limit."""
    if tm.images is None:
        raise bad_request("this model does not accept images (it is a text-only model); "
                          "send text parts only", refs[0][0])
    limit = tm.media_limits.max_images
    if len(refs) > limit:
        raise bad_request(f"this request has {len(refs)} images; at most {limit} per prompt "
                          "are allowed (--limit-mm-per-prompt)", refs[limit][0])


def _typed_in(messages: list[Any], text: str) -> str | None:
    """The first message text (``messages[i].content`` or ``messages[i].content[j].text``)
    that holds ``text``, or None."""
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, str) and text in content:
            return f"messages[{i}].content"
        if isinstance(content, list):
            for j, p in enumerate(content):
                if isinstance(p.get("text"), str) and text in p["text"]:
                    return f"messages[{i}].content[{j}].text"
    return None


def _check_typed_markers(tm: TokenizerManager, messages: list[Any]) -> None:
    """400 naming the message text that holds the image marker a text-expanding processor
    replaces (Gemma 3's ``<start_of_image>``): typed, it would become an image's tokens
    (with images: more runs than images; without: the raw marker token)."""
    images = tm.images   # None: a text-only model
    boi = images.boi if images is not None and images.expand_text is not None else None
    if boi is None:
        return
    where = _typed_in(messages, boi)
    if where is not None:
        raise bad_request(f"{boi!r} is this model's image marker: only an image part may put "
                          "it in a prompt; remove it from the text", where)


def _check_typed_pads(tm: TokenizerManager, messages: list[Any], ids: list[int],
                      images: int) -> None:
    """400 naming the message text that holds an image model's image-pad token (typed, not
    placed by an image part: the template's ``ids`` hold more of them than ``images``)."""
    pad = tm.image_pad()
    if pad is None or ids.count(pad[0]) == images:
        return
    where = "messages"
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, str) and pad[1] in content:
            where = f"messages[{i}].content"
        elif isinstance(content, list):
            hits = [j for j, p in enumerate(content)
                    if isinstance(p.get("text"), str) and pad[1] in p["text"]]
            where = f"messages[{i}].content[{hits[0]}].text" if hits else where
        if where != "messages":
            break
    tm.check_image_tokens(ids, images, where)
