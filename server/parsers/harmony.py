"""gpt-oss's harmony format, split into messages (for the ``gpt-oss`` reasoning and tool
parsers).

The prompt ends with ``<|start|>assistant``, so an output reads like::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

or ends with ``<|start|>assistant<|channel|>final<|message|>the answer<|return|>``. A
message's header (``<|start|>`` or ``<|channel|>`` up to ``<|message|>``) names its channel
(``analysis``: reasoning; ``final``: the answer; ``commentary``: tool calls, or preambles
when there is no recipient) and may name a recipient (``to=functions.NAME``, before or after
the channel); its body ends at ``<|end|>``, ``<|call|>`` or ``<|return|>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from server.parsers.base import first_of, tail_hold

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
OPENERS = (START, CHANNEL)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Piece:
    """A stretch of output: a message (``channel`` set, ``raw`` from its header to its end
    marker) or text outside messages (``channel`` None, ``raw`` the text)."""

    raw: str
    channel: str | None = None
    recipient: str = ""
    body: str = ""
    closed: bool = True


def split(text: str, final: bool) -> list[Piece]:
    """``text``'s pieces, in order. Unless ``final``, what could still change is left
    out: a header without its ``<|message|>``, and a tail that could begin a marker (the
    last message's body then stops short of it, ``closed`` False). ``final``: a cut header
    is dropped, a cut body kept."""
    out: list[Piece] = []
    pos = 0
    while pos < len(text):
        i, _ = first_of(text, OPENERS, pos)
        if i < 0:
            end = len(text) if final else tail_hold(text, pos, OPENERS)
            if end > pos:
                out.append(Piece(text[pos:end]))
            break
        if i > pos:
            out.append(Piece(text[pos:i]))
        h = text.find(MESSAGE, i)
        if h < 0:
            break
        header = text[i:h]
        ch = _CHANNEL.search(header)
        rc = _RECIPIENT.search(header)
        piece = Piece("", ch.group(1) if ch else "", rc.group(1) if rc else "")
        b = h + len(MESSAGE)
        e, marker = first_of(text, ENDS, b)
        if e < 0:
            stop = len(text) if final else tail_hold(text, b, ENDS)
            piece.raw, piece.body, piece.closed = text[i:stop], text[b:stop], False
            out.append(piece)
            break
        piece.raw, piece.body = text[i:e + len(marker)], text[b:e]
        out.append(piece)
        pos = e + len(marker)
    return out
