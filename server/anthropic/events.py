"""The ``message`` object and the stream events of ``POST /v1/messages``.

``MessageBuilder`` reads the chat format's chunks (``ChatFormat`` / ``ToolChatFormat`` of
``server/openai/formats.py`` and ``server/openai/tool_format.py``: text, tool calls and their
parsing are the chat endpoint's) and turns them into Anthropic content blocks: ``text``,
``tool_use`` (one per call; ``input`` the parsed arguments, ``{}`` when they do not parse,
e.g. cut by ``max_tokens``) and ``thinking`` (from a chat delta's ``reasoning_content``:
what ``--reasoning-parser`` produces; without one the output is text). A stream emits, in order:

``message_start`` (the message with empty ``content`` and the usage so far), ``ping``; per
block ``content_block_start``, ``content_block_delta``... (``text_delta``,
``input_json_delta`` with ``partial_json``, ``thinking_delta``), ``content_block_stop``; then
``message_delta`` (``stop_reason``, ``stop_sequence``, the final usage) and
``message_stop``. An error after the first event is an ``error`` event that ends the stream.
A non-stream request builds the same blocks from the same chunks, so a stream accumulated
(the ``anthropic`` SDK's ``get_final_message()``) equals the non-stream body.

``stop_reason``: ``end_turn`` (EOS or a stop token), ``stop_sequence`` (one of
``stop_sequences``, then named in ``stop_sequence``), ``max_tokens`` (``max_tokens`` or the
context), ``tool_use`` (the answer holds calls). Usage: ``input_tokens`` counts the prompt
tokens the prefix cache did not hold, ``cache_read_input_tokens`` those it did (Anthropic's
split: their sum is the prompt), ``cache_creation_input_tokens`` is 0 (the radix cache keeps
prompts as it computes them, with nothing written separately).
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from server.anthropic.errors import error_event
from server.http.errors import APIError
from server.openai.formats import ChatFormat
from server.pipeline.answer import Writer
from server.tokenizer_manager import ReqOutput

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def sse_event(event: dict) -> str:
    """One server-sent event: ``event: <type>`` and its JSON ``data``."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


def messages_usage(chat_usage: dict) -> dict:
    """Anthropic's ``usage`` of a chat ``usage`` object (see the module docstring)."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat_usage["prompt_tokens"] - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": chat_usage["completion_tokens"]}


def _input_of(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """Builds one message from its engine outputs.

    Args:
        mid: the message id (``msg_...``). model: the model name the body shows.
        fmt: the chat format of the request (one choice).
        stop_sequences: the request's, to tell ``stop_sequence`` from ``end_turn``.
    """

    def __init__(self, mid: str, model: str, fmt: ChatFormat, stop_sequences: list[str]):
        self.id = mid
        self.model = model
        self.fmt = fmt
        self.stops = set(stop_sequences)
        self.blocks: list[dict] = []
        self.open: int | None = None        # index of the open block
        self.args: dict[int, str] = {}      # tool_use block index -> its arguments so far
        self.calls: dict[int, int] = {}     # chat tool-call index -> block index
        self.started = False
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict = {"input_tokens": fmt.prompt_tokens, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 0, "output_tokens": 0}

    def message(self) -> dict:
        """The ``message`` object as it stands (the whole body once finished)."""
        return {"id": self.id, "type": "message", "role": "assistant",
                "content": copy.deepcopy(self.blocks), "model": self.model,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": dict(self.usage)}

    def feed(self, out: ReqOutput) -> list[dict]:
        """The events of one engine output (``message_start`` first, the last ones with
        the last output).

        Raises: APIError 500 when the engine aborted the request."""
        events: list[dict] = []
        for chunk in self.fmt.chunks(out):
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._delta("thinking", "thinking_delta", "thinking",
                                      delta["reasoning_content"])
            if delta.get("content"):
                events += self._delta("text", "text_delta", "text", delta["content"])
            for tc in delta.get("tool_calls") or []:
                events += self._tool_call(tc)
            if choice.get("finish_reason") is not None:
                events += self._finish(choice["finish_reason"], choice.get("matched_stop"),
                                       out)
        self.usage = messages_usage(self.fmt.usage())
        if not self.started:
            self.started = True
            start = dict(self.message(), content=[], stop_reason=None, stop_sequence=None)
            events[:0] = [{"type": "message_start", "message": start}, {"type": "ping"}]
        return events

    # ---- blocks -------------------------------------------------------------------------
    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return events + [{"type": "content_block_start", "index": self.open,
                          "content_block": copy.deepcopy(block)}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        if index in self.args:
            self.blocks[index]["input"] = _input_of(self.args[index])
        return [{"type": "content_block_stop", "index": index}]

    def _delta(self, kind: str, delta_type: str, key: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self.open is None or self.blocks[self.open]["type"] != kind:
            block = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            events += self._open(block)
        self.blocks[self.open][key] += text
        return events + [{"type": "content_block_delta", "index": self.open,
                          "delta": {"type": delta_type, key: text}}]

    def _tool_call(self, tc: dict) -> list[dict]:
        k = tc.get("index", 0)
        fn = tc.get("function") or {}
        events: list[dict] = []
        if "id" in tc:  # a new call: its header (id, name), then argument fragments
            call_id = "toolu_" + str(tc["id"]).removeprefix("call_")
            events += self._open({"type": "tool_use", "id": call_id,
                                  "name": fn.get("name", ""), "input": {}})
            self.calls[k] = self.open
            self.args[self.open] = ""
        args = fn.get("arguments") or ""
        index = self.calls.get(k)
        if args and index is not None:
            self.args[index] += args
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": args}})
        return events

    def _finish(self, reason: str, matched: Any, out: ReqOutput) -> list[dict]:
        if reason == "abort":
            why = (out.finish_reason or {}).get("message") or "aborted"
            raise APIError(f"the request was aborted: {why}", 500)
        if reason == "stop" and isinstance(matched, str) and matched in self.stops:
            self.stop_reason, self.stop_sequence = "stop_sequence", matched
        else:
            self.stop_reason = STOP_REASONS.get(reason, "end_turn")
        events = self._close()
        usage = messages_usage(self.fmt.usage())
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": self.stop_reason,
                                    "stop_sequence": self.stop_sequence},
                          "usage": usage},
                         {"type": "message_stop"}]


def new_message_id() -> str:
    """A fresh message id (``msg_`` and 24 hex digits)."""
    return f"msg_{uuid.uuid4().hex[:24]}"


class MessagesWriter(Writer):
    """The answer of a ``/v1/messages`` request (the chat pipeline's writer): the
    ``message`` object, or Anthropic's events (an error after the first event: an
    ``error`` event)."""

    failure_log = "messages stream failed"

    def __init__(self, build: MessageBuilder):
        super().__init__(build.fmt)
        self.build = build

    def collect(self, out: ReqOutput) -> None:
        self.build.feed(out)

    def body(self) -> dict:
        return self.build.message()

    def events(self, out: ReqOutput) -> list[str]:
        return [sse_event(e) for e in self.build.feed(out)]

    def error(self, err: APIError) -> list[str]:
        return [error_event(err)]
