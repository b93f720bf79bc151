"""A chat request's reasoning plan: how its output splits into reasoning and content
(``--reasoning-parser``, ``server/parsers/reasoning.py``), and what that asks of the engine.

``plan_reasoning`` reads the request's fields:

- SGLang's ``separate_reasoning`` (default true): false leaves the output whole in the
  content, as without a parser (the constraint still waits for the reasoning's end);
- SGLang's ``stream_reasoning`` (default true): false holds the streamed reasoning back and
  sends it in one piece once the reasoning ends (at the end tag, or at the finish);
- vLLM's ``include_reasoning`` (default true): false drops the reasoning from the answer
  (its tokens still count in ``reasoning_tokens``);
- ``chat_template_kwargs`` (``enable_thinking``, ``thinking``) and the rendered prompt's end
  (a prompt that closed the thinking: no reasoning in the output).

With a parser on, a constraint (``response_format``, SGLang's and vLLM's constraint fields,
a forced tool call) applies from the end of the reasoning: ``SamplingParams.think_end_id`` is
the end tag's token id (when it is one token) unless the output has no reasoning, and the
engine's matcher waits for it (``engine/sampling/grammar.py``). gpt-oss's harmony answer
follows a header of several tokens (``HARMONY_FINAL_HEADER``): ``think_end_ids`` holds its
ids and the matcher waits for them in a row (the reasoning, and any commentary, run free).
A forced tool call with gpt-oss is the exception: its grammar covers the whole output, the
reasoning included (``server/tools/harmony_calls.py``), and waits for nothing.

A parser that reads special tokens (``needs_special_tokens``: gpt-oss's harmony, some tool
formats) turns the request's ``skip_special_tokens`` off for the engine; ``strip_specials``
names the special tokens the writer then takes out of the content and reasoning it sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.parsers.reasoning import (
    REASONING,
    HarmonyReasoningParser,
    ReasoningParser,
    ReasoningStream,
    ThinkParser,
    get_reasoning_parser,
    resolve_reasoning_parser,
)

#: prompt tokens decoded to see whether the prompt opens or closes the thinking
PROMPT_TAIL_TOKENS = 16
#: what gpt-oss writes before its answer (harmony's final channel header): a constraint waits
#: for these tokens in a row (the prompt's ``<|start|>assistant`` counting toward them)
HARMONY_FINAL_HEADER = "<|start|>assistant<|channel|>final<|message|>"


@dataclass
class ReasoningPlan:
    """One request's reasoning split (see the module docstring).

    Attributes:
        parser: the family's parser of this request (switch and prompt applied).
        stream_reasoning: stream the reasoning as it comes (False: in one piece at its end).
        include: send the reasoning (vLLM's ``include_reasoning``).
        end_id: the end tag's token id when it is one token (counts ``reasoning_tokens``
            exactly), else None (counted per output).
    """

    parser: ReasoningParser
    stream_reasoning: bool = True
    include: bool = True
    end_id: int | None = None

    def stream(self) -> ReasoningStream:
        """A fresh ``ReasoningStream`` for one choice."""
        return self.parser.stream()

    def reasoning_tokens(self, ids: list[int], stream: ReasoningStream) -> int:
        """Tokens of an output (its token ids ``ids``, fed to ``stream``) that went to the
        reasoning: up to and including the end tag's token, all of them for a block cut
        short, 0 for an output without reasoning."""
        parser = self.parser
        if isinstance(parser, ThinkParser) and self.end_id is not None:
            if not parser.enabled:
                return 0
            if self.end_id in ids:
                return ids.index(self.end_id) + 1
            return len(ids) if stream.reasoning or stream.phase == REASONING else 0
        return stream.reasoning_tokens


_RESOLVED: dict[tuple, str | None] = {}


def reasoning_family(chat: Any) -> str | None:
    """The family ``--reasoning-parser`` means for the served model (``auto``: read from
    its chat template), None when off; ``chat`` is the ``TokenizerManager``'s ``chat``."""
    arg = chat.reasoning_parser
    if arg is None:
        return None
    template = getattr(chat.tokenizer, "chat_template", None)
    key = (arg, template if isinstance(template, str) else None)
    if key not in _RESOLVED:
        _RESOLVED[key] = resolve_reasoning_parser(*key)
    return _RESOLVED[key]


def _flag(extra: dict, name: str) -> bool:
    value = extra.get(name)
    return True if value is None else bool(value)


def token_ids(tokenizer: Any, text: str) -> list[int] | None:
    """``text``'s token ids (no BOS), None when the tokenizer cannot say."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a tokenizer without encode: not known
        return None
    return list(ids) or None


def token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when it is one token of ``tokenizer``'s vocabulary, else None."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a tokenizer without encode: not known
        return None
    return ids[0] if len(ids) == 1 else None


async def plan_reasoning(tm: Any, req: Any, prompt_ids: list[int]
                         ) -> tuple[ReasoningPlan | None, int | list[int] | None, bool]:
    """The reasoning plan of a chat request (None: its output is not split), what its
    constraint waits for (None: nothing; an int: ``think_end_id``, the end tag's one token;
    a list: ``think_end_ids``, gpt-oss's final channel header as token ids) and whether the
    parser reads special tokens.

    Args:
        tm: the ``TokenizerManager`` (``tm.chat``: the tokenizer and the server args).
        req: the chat request (``ChatCompletionRequest``; SGLang's and vLLM's fields in
            ``model_extra``).
        prompt_ids: the rendered prompt's token ids.
    """
    name = reasoning_family(tm.chat)
    if name is None:
        return None, None, False
    tail = await tm.chat.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    parser = get_reasoning_parser(name, req.chat_template_kwargs, prompt=tail)
    end_id = None
    if isinstance(parser, ThinkParser) and tm.chat.tokenizer is not None:
        end_id = token_id(tm.chat.tokenizer, parser.end)
    think_end: int | list[int] | None = \
        end_id if isinstance(parser, ThinkParser) and parser.enabled else None
    if isinstance(parser, HarmonyReasoningParser) and tm.chat.tokenizer is not None:
        think_end = token_ids(tm.chat.tokenizer, HARMONY_FINAL_HEADER)
    special = bool(getattr(parser, "needs_special_tokens", False))
    extra = req.model_extra or {}
    if not _flag(extra, "separate_reasoning"):
        return None, think_end, special
    plan = ReasoningPlan(parser, stream_reasoning=_flag(extra, "stream_reasoning"),
                         include=_flag(extra, "include_reasoning"), end_id=end_id)
    return plan, think_end, special


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens' texts (what the writer strips), longest first."""
    texts = getattr(tokenizer, "all_special_tokens", None) or []
    return tuple(sorted({t for t in texts if t}, key=len, reverse=True))


def strip_specials(text: str, specials: tuple[str, ...]) -> str:
    """``text`` without any of ``specials``."""
    for s in specials:
        if s in text:
            text = text.replace(s, "")
    return text
