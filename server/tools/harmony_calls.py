"""Forced tool calls (``tool_choice: "required"`` or a named function) in gpt-oss's harmony
format: the grammar of the whole output.

The prompt ends with ``<|start|>assistant``; the grammar (xgrammar EBNF) lets the output be::

    [<|channel|>analysis<|message|>REASONING<|end|><|start|>assistant]
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>

- the analysis message is optional (the model may call at once), its text free but for
  ``<|`` (no harmony marker spelled in text, which the parsers would read as one) and, when
  the request has a ``max_tokens``, at most half of it (``reasoning_budget``), so the call
  still fits: past the budget the grammar allows only ``<|end|>``;
- ``NAME`` is the named function, or (``required``) any tool's name; ``ARGUMENTS`` is JSON
  of that tool's ``parameters``, its strings without ``<|`` either (a ``<|end|>`` there
  would end the message for the parser), at most one blank in a row (xgrammar's option for
  this format; ferry's other JSON constraints have no free blanks);
- the markers are their special tokens (``Token(id)``), never spelled as text; ``<|call|>``,
  a turn-end token, ends the output (harmony ends the turn at a call, so ``required`` gives
  exactly one call whatever ``parallel_tool_calls`` says).

The spelling is what gpt-oss writes and ferry's ``gpt-oss`` parsers read
(``server/parsers/harmony.py``): the channel then the recipient, one space before
``<|constrain|>``. The gpt-oss reasoning and tool parsers then read the call as with
``tool_choice: "auto"`` (``ToolPlan.parser``).

Why this and not the other two ways. The engine's release trigger (``think_end_ids``,
waiting for the end of the analysis message) forces nothing when the model never ends its
reasoning or answers in the final channel without one: the header is the model's to write.
xgrammar's structural tags with triggers (its builtin ``harmony`` tag) allow the same, match
the markers as text (a marker may then be spelled from ``<``, ``|`` ... tokens) and bound
neither the reasoning nor its text. So the whole output is constrained from the first
token, the markers by token id. It is built as an xgrammar structural tag (for its pieces:
the budgeted text, ``Token``, JSON with excluded text) and sent to the engine as the EBNF
xgrammar prints of it (``SamplingParams.ebnf``), so the engine's grammar path is unchanged.
"""

from __future__ import annotations

from server.tools.plan import ToolPlan, params_schema

#: harmony's markers the grammar writes, each one special token of the tokenizer
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>")
#: the generation prompt's end: the grammar starts after it
ASSISTANT_START = "<|start|>assistant"
#: text the reasoning and the arguments' strings never hold: it would begin a marker that
#: the parsers, which read the text, take for one
NO_TEXT = "<|"


def marker_ids(tokenizer) -> dict[str, int] | None:
    """Each of ``MARKERS``' token id, None when one is not a single token of ``tokenizer``
    (a transformers tokenizer)."""
    out = {}
    for m in MARKERS:
        try:
            ids = tokenizer.encode(m, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: not harmony's
            return None
        if len(ids) != 1:
            return None
        out[m] = int(ids[0])
    return out


def reasoning_budget(max_tokens: int | None) -> int | None:
    """Tokens the analysis message's text may take: half of ``max_tokens`` (None: no
    bound)."""
    return None if max_tokens is None else max_tokens // 2


def forced_call_ebnf(plan: ToolPlan, ids: dict[str, int], budget: int | None) -> str:
    """The EBNF (xgrammar's) of a forced call's whole output (see the module docstring).

    Args:
        plan: a ``required`` or named ``ToolPlan`` (its tools checked by ``plan_tools``).
        ids: ``marker_ids`` of the tokenizer.
        budget: the analysis text's token bound (None: unbounded).
    Raises:
        ValueError: a schema xgrammar rejects (already checked by ``prepare_chat``).
    """
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    def tok(marker: str):
        return st.TokenFormat(token=ids[marker])

    def text(value: str):
        return st.ConstStringFormat(value=value)

    analysis = st.SequenceFormat(elements=[
        tok("<|channel|>"), text("analysis"), tok("<|message|>"),
        st.AnyTextFormat(excludes=[NO_TEXT], max_tokens=budget), tok("<|end|>"),
        tok("<|start|>"), text("assistant")])
    calls = [st.SequenceFormat(elements=[
        text(f"commentary to=functions.{t['function']['name']} "), tok("<|constrain|>"),
        text("json"), tok("<|message|>"),
        st.JSONSchemaFormat(json_schema=params_schema(t), excludes=[NO_TEXT],
                            max_whitespace_cnt=1)])
        for t in plan.tools if plan.choice != "named" or t["function"]["name"] == plan.name]
    whole = st.SequenceFormat(elements=[
        st.OptionalFormat(content=analysis), tok("<|channel|>"),
        calls[0] if len(calls) == 1 else st.OrFormat(elements=calls), tok("<|call|>")])
    return str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=whole)))
