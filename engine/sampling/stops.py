r"""Regular-expression stop conditions (SGLang's ``stop_regex``).

A request may stop where one of its patterns first matches the generated text: the text
ends right before the match (like a stop string) and ``matched_stop`` names the pattern.
Patterns are compiled by the ``regex`` package (the ``re`` syntax), whose partial matching
says whether the text's tail could still grow into a match: the detokenizer holds such a
tail back while streaming, so no streamed text is ever cut afterwards. A search that runs
past ``SEARCH_TIMEOUT_S`` (catastrophic backtracking) counts as no match, and the pattern is
not searched again for that request; once a request's timed-out searches have used up
``REQUEST_TIMEOUT_BUDGET_S``, each of its later searches gets ``SPENT_TIMEOUT_S`` (a pattern
that times out costs the request that much, not a whole ``SEARCH_TIMEOUT_S``; a search that
does not backtrack takes microseconds).

Anchors and other end-of-text assertions: the text is searched while the output still
grows, so a match counts only once it is settled, i.e. it would match whatever text came
next: once it still matches with a letter, a space and a newline after the text so far
(``_settled``; this only matters to a match that looks at the end of the text: ``$``,
``\Z``, ``\b``, a lookahead looking past it). An unsettled match is held back (not
streamed) meanwhile. So ``$`` and ``\Z`` never stop an output (the end of the text so far is not the
end of the output: there is always a next token until the output ends for another reason,
and then the held tail is released); ``(?m)$`` stops at a line's end once the newline is
generated, and ``\b`` at the next non-word character. The result no longer depends on
where the tokens happen to split the text.

The engine (``engine/scheduler/output.py``) and the detokenizer run the same incremental
state (``engine.tokenizer.detokenizer.IncrementalDetokenizer``), so the engine stops on the
very token whose text completes the match, and the usage counts the tokens behind the text.
"""

from __future__ import annotations

import logging
import time

import regex

logger = logging.getLogger("ferry.sampling")

#: seconds one search may take (a pattern with catastrophic backtracking on a long tail)
SEARCH_TIMEOUT_S = 0.05
#: seconds a request's timed-out searches may take in all (per process) before its searches
#: get ``SPENT_TIMEOUT_S``: 16 catastrophic patterns cost a request 16 x 0.05 s in the
#: engine and again in the detokenizer (about 3 s on a busy CPU) before their first timeouts
REQUEST_TIMEOUT_BUDGET_S = 0.02
SPENT_TIMEOUT_S = 0.002
#: the next characters a match reaching the end of the text must survive (``_settled``)
_PROBES = ("a", " ", "\n")
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


class Patterns(list):
    """A request's ``[(pattern, compiled)]`` and what is left of its timeout budget."""

    budget_s: float = REQUEST_TIMEOUT_BUDGET_S


def compile_patterns(patterns: list[str]) -> Patterns:
    """``[(pattern, compiled)]`` (a ``Patterns`` list, holding the request's timeout budget).

    Raises:
        ValueError: ``(message, "stop_regex")`` for a pattern that does not compile, that
            matches the empty string (it would stop every request before its first token)
            or that repeats too much (``expansion_bound`` > ``MAX_EXPANSION``).
    """
    out = Patterns()
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


def _settled(c: regex.Pattern, text: str, start: int, timeout: float) -> bool:
    """Whether the match of ``c`` at ``start`` still matches with each of ``_PROBES`` after
    ``text`` (see the module docstring): a match that looked at the end of the text (``$``
    also matches before a final newline) may not, one that did not always does."""
    return all(c.match(text + probe, start, timeout=timeout) is not None for probe in _PROBES)


def _search(c: regex.Pattern, text: str, pos: int, timeout: float) -> tuple[int | None, int]:
    """``(start of the earliest settled match or None, where to hold the text from)``;
    unsettled matches (near the end of the text) only move the hold. Raises TimeoutError."""
    hold = len(text)
    for _ in range(8):  # each unsettled match starts after the one before
        m = c.search(text, pos, timeout=timeout)
        if m is None:
            return None, hold
        if _settled(c, text, m.start(), timeout):
            return m.start(), hold
        hold = min(hold, m.start())
        pos = m.start() + 1
        if pos > len(text):
            break
    return None, hold


def first_match(compiled: list[tuple[str, regex.Pattern]], text: str, pos: int,
                partial: bool) -> tuple[int, str | None]:
    """Where the text must end, searching ``text[pos:]``: ``(start of the earliest settled
    match, its pattern)``; else, with ``partial``, ``(start of the earliest tail that could
    still grow into a match or settle into one, None)``; else ``(len(text), None)``. A
    timed-out search counts as no match, and its pattern is removed from ``compiled`` (the
    request's own list), so a pattern costs the engine's step at most one timeout, not one
    per token; the timeouts come out of the request's budget (``Patterns.budget_s``)."""
    full, which, hold = len(text), None, len(text)
    for p, c in list(compiled):
        budget = getattr(compiled, "budget_s", SEARCH_TIMEOUT_S)
        timeout = min(SEARCH_TIMEOUT_S, budget) if budget > SPENT_TIMEOUT_S else SPENT_TIMEOUT_S
        t0 = time.perf_counter()
        try:
            start, tail = _search(c, text, pos, timeout)
            if start is not None and start < full:
                full, which = start, p
            if partial:
                hold = min(hold, tail)
                m = c.search(text, pos, partial=True, timeout=timeout)
                if m is not None and m.partial:
                    hold = min(hold, m.start())
        except TimeoutError:
            compiled.remove((p, c))
            if isinstance(compiled, Patterns):
                compiled.budget_s = max(0.0, budget - (time.perf_counter() - t0))
            logger.warning("stop_regex %r: search timed out; taken as no match, and no "
                           "longer searched for this request", p)
    if which is not None:
        return full, which
    return hold, None
