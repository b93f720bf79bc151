"""The ``response`` object and the typed SSE events of ``POST /v1/responses``.

``ResponseBuilder`` reads the chat format's chunks (``ChatFormat`` / ``ToolChatFormat`` of
``server/openai/formats.py`` and ``server/openai/tool_format.py``, so text, tool calls and
their parsing are the chat endpoint's) and turns them into Responses output items: with
``--reasoning-parser``, a ``reasoning`` item (``summary: []``, one ``reasoning_text`` content
part) for the chat delta's ``reasoning_content``; a ``message`` with one ``output_text`` part
for the text, a ``function_call`` item per tool call. A stream emits, in order, with a
``sequence_number`` from 0:

``response.created``, ``response.in_progress``; per reasoning item
``response.output_item.added``, ``response.content_part.added``,
``response.reasoning_text.delta``..., ``response.reasoning_text.done``,
``response.content_part.done``, ``response.output_item.done``; per message ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per call
``response.output_item.added``, ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``, ``response.output_item.done``. Items never
interleave: each one's events end (``output_item.done``) before the next item's
``output_item.added``, ``output_index`` increasing; then one terminal
event: ``response.completed`` (status ``completed``), ``response.incomplete`` (status
``incomplete``, ``incomplete_details.reason: "max_output_tokens"``: cut by
``max_output_tokens`` or the context) or ``response.failed`` (status ``failed``: the server
aborted the request, or an error after the first event, which an ``error`` event precedes),
as OpenAI does. A non-stream request builds the same object from the same chunks, so the
stream's final ``response`` equals the non-stream body (ids and timestamps aside).
``ResponseWriter`` is the chat pipeline's writer of both (``server/pipeline/answer.py``).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from server.http.errors import APIError
from server.openai.formats import ChatFormat
from server.pipeline.answer import Writer
from server.tokenizer_manager import ReqOutput

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
            "failed": "response.failed"}


def sse_event(event: dict) -> str:
    """One server-sent event: ``event: <type>`` and its JSON ``data``."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


def responses_usage(chat_usage: dict) -> dict:
    """OpenAI's Responses ``usage`` from a chat ``usage`` object. ``cache_write_tokens``
    (required by the ``openai`` SDK's types) is 0: ferry's prefix cache keeps prompts as it
    computes them, with no separately billed cache writes to report."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": chat_usage.get(
                "completion_tokens_details", {}).get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseBuilder:
    """Builds one response from its engine outputs.

    Args:
        rid: the response id (``resp_...``). model: the served model name.
        fmt: the chat format of the request (one choice).
        echo: request settings the ``response`` object repeats (``instructions``,
            ``temperature``, ``tools``, ``store``, ``previous_response_id``, ``background``...).
    """

    def __init__(self, rid: str, model: str, fmt: ChatFormat, echo: dict):
        self.id = rid
        self.model = model
        self.fmt = fmt
        self.echo = echo
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.seq = 0
        self.items: list[dict] = []
        self.msg: int | None = None           # output index of the open message
        self.rs: int | None = None            # output index of the open reasoning item
        self.calls: dict[int, int] = {}       # open calls: chat tool-call index -> output index
        self.status = "in_progress"
        self.incomplete: dict | None = None
        self.error: dict | None = None
        self.usage: dict | None = None

    # ---- the response object ------------------------------------------------------------
    def response(self) -> dict:
        """The ``response`` object as it stands (the whole body once finished)."""
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "background": False, "error": self.error,
                "incomplete_details": self.incomplete, "previous_response_id": None,
                "store": False, "reasoning": {"effort": None, "summary": None}, **self.echo,
                "max_tool_calls": None, "model": self.model,
                "output": copy.deepcopy(self.items), "truncation": "disabled", "usage": self.usage,
                "completed_at": self.completed_at}

    def _event(self, kind: str, **fields: Any) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def _item_event(self, kind: str, index: int) -> dict:
        return self._event(kind, output_index=index, item=copy.deepcopy(self.items[index]))

    # ---- stream events ------------------------------------------------------------------
    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, out: ReqOutput) -> list[dict]:
        """The events of one engine output (the terminal one with the last output)."""
        events: list[dict] = []
        for chunk in self.fmt.chunks(out):
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for tc in delta.get("tool_calls") or []:
                events += self._tool_call(tc)
            if choice.get("finish_reason") is not None:
                events += self._finish(choice["finish_reason"], out)
        return events

    def fail(self, err: APIError) -> list[dict]:
        """An ``error`` event and ``response.failed`` (an error after the first event)."""
        events = [self._event("error", code=err.code or err.type, message=err.message,
                              param=err.param)]
        self.status = "failed"
        self.error = {"code": "server_error", "message": err.message}
        events += self._close_all("incomplete")
        events.append(self._event(TERMINAL["failed"], response=self.response()))
        return events

    def cancel(self) -> None:
        """Status ``cancelled`` (``POST /v1/responses/{id}/cancel`` of a background
        response): open items close as ``incomplete``; usage counts what was generated."""
        self.status = "cancelled"
        self._close_all("incomplete")
        self.usage = responses_usage(self.fmt.usage())

    # ---- items --------------------------------------------------------------------------
    def _open_message(self) -> list[dict]:
        index = len(self.items)
        self.items.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                           "status": "in_progress", "role": "assistant", "content": []})
        self.msg = index
        item_id = self.items[index]["id"]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [self._item_event("response.output_item.added", index)]
        self.items[index]["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item_id,
                                  output_index=index, content_index=0,
                                  part=copy.deepcopy(part)))
        return events

    def _reasoning(self, text: str) -> list[dict]:
        """A reasoning delta: ``response.reasoning_text.delta`` of the open reasoning item
        (opened with its ``reasoning_text`` part first)."""
        events = self._close_message("completed") if self.msg is not None else []
        events += self._close_calls("completed") if self.calls else []
        if self.rs is None:
            index = self.rs = len(self.items)
            self.items.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning",
                               "summary": [], "content": [], "status": "in_progress"})
            events.append(self._item_event("response.output_item.added", index))
            part = {"type": "reasoning_text", "text": ""}
            self.items[index]["content"].append(part)
            events.append(self._event("response.content_part.added",
                                      item_id=self.items[index]["id"], output_index=index,
                                      content_index=0, part=copy.deepcopy(part)))
        item = self.items[self.rs]
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=self.rs, content_index=0, delta=text))
        return events

    def _close_reasoning(self, status: str) -> list[dict]:
        if self.rs is None:
            return []
        index, self.rs = self.rs, None
        item = self.items[index]
        part = item["content"][0]
        item["status"] = status
        return [self._event("response.reasoning_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=part["text"]),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=copy.deepcopy(part)),
                self._item_event("response.output_item.done", index)]

    def _text(self, text: str) -> list[dict]:
        events = self._close_reasoning("completed")
        events += self._close_calls("completed") if self.calls else []
        if self.msg is None:
            events += self._open_message()
        item = self.items[self.msg]
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=self.msg, content_index=0, delta=text,
                                  logprobs=[]))
        return events

    def _close_message(self, status: str) -> list[dict]:
        index, self.msg = self.msg, None
        item = self.items[index]
        part = item["content"][0]
        item["status"] = status
        return [self._event("response.output_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=part["text"],
                            logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=copy.deepcopy(part)),
                self._item_event("response.output_item.done", index)]

    def _tool_call(self, tc: dict) -> list[dict]:
        k = tc.get("index", 0)
        fn = tc.get("function") or {}
        events: list[dict] = []
        if "id" in tc:  # a new call: its header (id, name), then argument fragments
            # the chat format sends each call whole before the next one's header: the item
            # before it is finished, as OpenAI's stream ends one item before the next starts
            events += self._close_reasoning("completed")
            if self.msg is not None:
                events += self._close_message("completed")
            events += self._close_calls("completed")
            index = len(self.items)
            self.items.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                               "status": "in_progress", "call_id": tc["id"],
                               "name": fn.get("name", ""), "arguments": ""})
            self.calls[k] = index
            events.append(self._item_event("response.output_item.added", index))
        args = fn.get("arguments") or ""
        if args and k in self.calls:
            item = self.items[self.calls[k]]
            item["arguments"] += args
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self.calls[k],
                                      delta=args))
        return events

    def _close_calls(self, status: str) -> list[dict]:
        events = []
        for index in sorted(self.calls.values()):
            item = self.items[index]
            item["status"] = status
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
            events.append(self._item_event("response.output_item.done", index))
        self.calls.clear()
        return events

    def _close_all(self, status: str) -> list[dict]:
        events = self._close_reasoning(status)
        events += self._close_message(status) if self.msg is not None else []
        return events + self._close_calls(status)

    def _finish(self, reason: str, out: ReqOutput) -> list[dict]:
        if reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif reason == "abort":
            why = (out.finish_reason or {}).get("message") or "aborted"
            self.status = "failed"
            self.error = {"code": "server_error", "message": f"the request was aborted: {why}"}
        else:
            self.status = "completed"
        item_status = "completed" if self.status == "completed" else "incomplete"
        # an empty answer (or reasoning alone, finished): an empty text
        events = [] if any(i["type"] != "reasoning" for i in self.items) \
            or (self.items and self.status != "completed") else self._open_message()
        events += self._close_all(item_status)
        self.usage = responses_usage(self.fmt.usage())
        self.completed_at = int(time.time()) if self.status == "completed" else None
        events.append(self._event(TERMINAL[self.status], response=self.response()))
        return events


class ResponseWriter(Writer):
    """The answer of a ``/v1/responses`` request (the pipeline's writer): the ``response``
    object, or its typed events (an error after the first event ends it ``failed``).

    Args:
        build: the request's ``ResponseBuilder``.
        on_done: called once the response has finished (to store it), if given; not for a
            stream the client left early.
    """

    failure_log = "responses stream failed"

    def __init__(self, build: ResponseBuilder, on_done: Callable[[], None] | None = None):
        super().__init__(build.fmt)
        self.build = build
        self.on_done = on_done

    def _done(self) -> None:
        if self.on_done is not None:
            self.on_done()

    def collect(self, out: ReqOutput) -> None:
        self.build.feed(out)

    def body(self) -> dict:
        self._done()
        return self.build.response()

    def start(self) -> list[str]:
        return [sse_event(e) for e in self.build.start()]

    def events(self, out: ReqOutput) -> list[str]:
        return [sse_event(e) for e in self.build.feed(out)]

    def error(self, err: APIError) -> list[str]:
        return [sse_event(e) for e in self.build.fail(err)]

    def close(self) -> list[str]:
        self._done()
        return []
