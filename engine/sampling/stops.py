"""Regular-expression stop conditions (SGLang's ``stop_regex``).

A request may stop where one of its patterns first matches the generated text: the text
ends right before the match (like a stop string) and ``matched_stop`` names the pattern.
Patterns are compiled by the ``regex`` package (the ``re`` syntax), whose partial matching
says whether the text's tail could still grow into a match: the detokenizer holds such a
tail back while streaming, so no streamed text is ever cut afterwards. A search that runs
past ``SEARCH_TIMEOUT_S`` (catastrophic backtracking) counts as no match, and the pattern is
not searched again for that request.

The engine (``engine/scheduler/output.py``) and the detokenizer run the same incremental
state (``engine.tokenizer.detokenizer.IncrementalDetokenizer``), so the engine stops on the
very token whose text completes the match, and the usage counts the tokens behind the text.
"""

from __future__ import annotations

import logging

import regex

logger = logging.getLogger("ferry.sampling")

#: seconds one search may take (a pattern with catastrophic backtracking on a long tail)
SEARCH_TIMEOUT_S = 0.05
#: most characters a pattern may expand to when compiled (``expansion_bound``): ~25 ms of
#: compiling; the regex package writes out each counted repeat's mandatory copies, so
#: ``(?:(?:(?:(?:a{100}){100}){100}){100})`` alone would take tens of GB
MAX_EXPANSION = 20_000
#: a counted repeat ``{m}``, ``{m,}``, ``{m,n}`` or ``{,n}`` (the regex package's forms)
_COUNTED = regex.compile(r"\{(\d*)(?:,\d*)?\}")


def expansion_bound(pattern: str) -> int:
    """An upper bound of the characters ``pattern`` expands to when the regex package
    compiles it: its length times the product of every counted repeat's minimum (at least
    1), nested or not (so no parsing is needed; a brace that is not a repeat only makes the
    bound larger)."""
    bound = len(pattern)
    for m in _COUNTED.finditer(pattern):
        bound *= max(1, int(m.group(1) or 0))
        if bound > MAX_EXPANSION:
            break
    return bound


def compile_patterns(patterns: list[str]) -> list[tuple[str, regex.Pattern]]:
    """``[(pattern, compiled)]``.

    Raises:
        ValueError: ``(message, "stop_regex")`` for a pattern that does not compile, that
            matches the empty string (it would stop every request before its first token)
            or that repeats too much (``expansion_bound`` > ``MAX_EXPANSION``).
    """
    out = []
    for p in patterns:
        if expansion_bound(p) > MAX_EXPANSION:
            raise ValueError(f"stop_regex {p!r} repeats too much: its length times its counted "
                             f"repeats' minimums ({{m}}, {{m,n}}) must stay within "
                             f"{MAX_EXPANSION}", "stop_regex")
        try:
            c = regex.compile(p)
        except (regex.error, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"stop_regex {p!r} is not a valid regular expression: {exc}",
                             "stop_regex") from None
        if c.fullmatch("") is not None:
            raise ValueError(f"stop_regex {p!r} matches the empty string", "stop_regex")
        out.append((p, c))
    return out


def first_match(compiled: list[tuple[str, regex.Pattern]], text: str, pos: int,
                partial: bool) -> tuple[int, str | None]:
    """Where the text must end, searching ``text[pos:]``: ``(start of the earliest complete
    match, its pattern)``; else, with ``partial``, ``(start of the earliest tail that could
    still grow into a match, None)``; else ``(len(text), None)``. A timed-out search counts
    as no match, and its pattern is removed from ``compiled`` (the request's own list), so
    a pattern costs the engine's step at most one ``SEARCH_TIMEOUT_S``, not one per token."""
    full, which, hold = len(text), None, len(text)
    for p, c in list(compiled):
        try:
            m = c.search(text, pos, timeout=SEARCH_TIMEOUT_S)
            if m is not None and m.start() < full:
                full, which = m.start(), p
            if partial:
                m = c.search(text, pos, partial=True, timeout=SEARCH_TIMEOUT_S)
                if m is not None and m.partial:
                    hold = min(hold, m.start())
        except TimeoutError:
            compiled.remove((p, c))
            logger.warning("stop_regex %r: search timed out; taken as no match, and no "
                           "longer searched for this request", p)
    if which is not None:
        return full, which
    return hold, None
