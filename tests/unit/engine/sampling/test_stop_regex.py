"""Issue 28 item 4: SGLang's ``stop_regex``. The engine's stop check and the detokenizer (fed
the same tokens, streamed one at a time) against Python's ``re`` on the whole generated
text: the engine stops on the token whose text completes the first match, the text ends
right before it, ``matched_stop`` names the pattern, and no streamed delta is ever cut
afterwards (a tail that could still match is held back). Plus the request's bounds (400s
naming ``stop_regex``) and the offline ``LLM``'s text.
"""

from __future__ import annotations

import random
import re

import pytest
import regex
from test_api_conformance import stream_stops

from engine.llm import final_text
from engine.sampling.params import SamplingParams
from engine.sampling.stops import SEARCH_TIMEOUT_S, compile_patterns
from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest, parse_request


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


def _run(tok, text: str, patterns: list[str]):
    """(the engine's matched stop or None, the streamed deltas, the generated text up to the
    engine's stop, the same without the last token)."""
    matched, deltas, ids = stream_stops(tok, text, [], patterns)
    return matched, deltas, tok.decode(ids), tok.decode(ids[:-1])


def _settled_matches(p: str, text: str):
    """Python ``re``'s matches of ``p`` in ``text`` that are settled (docs/usage.md): ending
    inside the text, or still matching at their start with a letter, a space or a newline
    after the text."""
    for m in re.finditer(p, text):
        if m.end() < len(text) or all(re.compile(p).match(text + c, m.start())
                                      for c in ("a", " ", "\n")):
            yield m


def _reference(text: str, patterns: list[str]):
    """The earliest settled match over the patterns in ``text`` by Python's ``re``:
    (start, pattern) or None."""
    hits = [(m.start(), p) for p in patterns for m in list(_settled_matches(p, text))[:1]]
    return min(hits, key=lambda h: h[0]) if hits else None


def test_a_number_pattern_cuts_before_the_number(tok):
    text = "The answer is 42 apples and 7 pears."
    matched, deltas, _, _ = _run(tok, text, [r"\d+"])
    assert matched == r"\d+"
    assert "".join(deltas) == "The answer is "


def test_a_tail_that_could_still_match_is_held_back(tok):
    # "END" + digits: " EN" and " END" could still grow into a match; never streamed
    text = "alpha beta END gamma ENDING END7 rest"
    matched, deltas, _, _ = _run(tok, text, [r"END\d"])
    assert matched == r"END\d"
    # released text is never taken back: without the hold-back " END" went out before "7"
    assert "".join(deltas) == "alpha beta END gamma ENDING "
    assert "" in deltas[-4:]  # the tail " END" waited


def test_fuzz_against_python_re(tok):
    rng = random.Random(28)
    words = ["alpha", " beta", " 12", " gamma", ", delta", " 7.5", "\n", " zeta", " x9y"]
    pats = [r"\d+\.\d", r"ga[m]+a", r"\n", r"[xy]\d", r"delta|zeta", r"\bbeta\b"]
    for _ in range(120):
        text = "".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
        patterns = rng.sample(pats, rng.randint(1, 3))
        matched, deltas, gen, before = _run(tok, text, patterns)
        ref = _reference(gen, patterns)
        out = "".join(deltas)
        if matched is None:
            assert ref is None and out == gen, (text, patterns)
            continue
        assert ref is not None and out == gen[:ref[0]], (text, patterns, out)
        assert next(_settled_matches(matched, gen)).start() == ref[0]
        # the engine stopped on the first token whose text completes a match
        assert _reference(before, patterns) is None, (text, patterns)


@pytest.mark.parametrize("value,msg", [
    ("(", "not a valid regular expression"),
    ("a*", "matches the empty string"),
    # the regex package writes out a counted repeat's mandatory copies when it compiles:
    # four nested {100} (10^8 copies) took a server's HTTP process past 20 GB (OOM-killed);
    # these milder ones (10^6 copies, about 1 s each) stand for them
    ("(?:a{1000}){1000}", "repeats too much"),
    ("(?:(?:x{100,}){100}){100,200}", "repeats too much"),
    ("(?:ba{0}){1000000}", "repeats too much"),
    (["x"] * 17, "at most 16"),
    ("x" * 257, "256 characters"),
    (5, "regular expression"),
])
def test_bad_patterns_are_400s_naming_the_field(value, msg):
    from server.openai.serving import OpenAIServing

    req = None
    try:
        req = parse_request(ChatCompletionRequest, {
            "messages": [{"role": "user", "content": "hi"}], "stop_regex": value})
        serving = OpenAIServing.__new__(OpenAIServing)
        serving.tm = type("TM", (), {"vocab_size": 100})()
        serving._params(req, 4)
    except APIError as err:
        assert err.status == 400 and err.param == "stop_regex" and msg in err.message, err
    else:
        pytest.fail(f"{value!r} accepted: {req}")


@pytest.mark.parametrize("pattern,text", [
    (r"\d{3}-\d{4}", "call 555-1234 now"), ("(?:ab){1000}", "x" + "ab" * 1000),
    ("a{1,100000}", "baaa"), (r"-{80}\n", "title\n" + "-" * 80 + "\n"),
    (r"\p{Lu}{2}", "ab CD"), ("[{]{2}", "a{{b"), (r"\{1000000\}", "x{1000000}")])
def test_counted_repeats_of_real_patterns_are_accepted(pattern, text):
    (p, c), = compile_patterns([pattern])
    ref = regex.search(pattern, text)  # the regex package itself, no bound in the way
    assert ref is not None and c.search(text).span() == ref.span()


def test_min_tokens_with_stop_regex_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(stop_regex=["x"], min_tokens=2).verify()


def test_offline_text_is_cut_at_the_pattern(tok):
    ids = tok.encode("Total: 15 items", add_special_tokens=False)
    assert final_text(tok, ids, r"\d+", stop_regex=[r"\d+"]) == "Total: "


def test_a_pattern_whose_search_times_out_is_dropped_for_the_request():
    """A search past SEARCH_TIMEOUT_S counts as no match; the pattern is then no longer
    searched for that request. The engine runs these searches in its step for every token
    (and the detokenizer again): 16 catastrophic patterns stalled every other request on
    the server (a 20-token request took 9.5 s instead of 0.1 s)."""
    from engine.sampling.stops import first_match

    compiled = compile_patterns(["(K|K)+Z", "KA"])  # 2^n paths over a run of K (no Z)
    text = "K" * 60
    # "(K|K)+Z" times out; "KA" could still start at the last K: held back from there
    assert first_match(compiled, text, 0, partial=True) == (len(text) - 1, None)
    assert [p for p, _ in compiled] == ["KA"]  # dropped; the other pattern still runs
    assert first_match(compiled, text + "A", 0, partial=False) == (59, "KA")


@pytest.mark.parametrize("pattern", [r"END$", r"END\Z", r"\bEND\b", r"(?m)END$",
                                     r"END(?= )"])
def test_a_match_reaching_the_end_of_the_text_waits_until_it_is_settled(pattern):
    """Issue 41 item 5e: the end of the text generated so far is not the end of the output,
    so ``$``, ``\\Z``, ``\\b`` and lookaheads there do not stop it (they did, so whether
    "END" stopped an output depended on where its tokens split): such a match is held
    back (the stream waits before it), then settles or goes away. ``$`` matches before a
    final newline too, so "END\\n" does not settle ``END$`` either."""
    from engine.sampling.stops import first_match

    text = "say END"
    assert first_match(compile_patterns([pattern]), text, 0, partial=True) == (4, None)
    assert first_match(compile_patterns([pattern]), text, 0, partial=False) == (len(text), None)
    for more, stops in (("\n", pattern in (r"(?m)END$", r"\bEND\b")), ("ING", False),
                        (" now", pattern not in (r"END$", r"END\Z", r"(?m)END$"))):
        got = first_match(compile_patterns([pattern]), text + more, 0, partial=False)
        assert got == ((4, pattern) if stops else (len(text + more), None)), (more, got)


def test_end_anchors_through_the_engine_and_the_detokenizer(tok):
    """``END$`` never stops an output (the text streams whole), ``(?m)END$`` stops at the
    newline after END, ``\\bEND\\b`` only where END is a word: the engine and the
    detokenizer agree."""
    text = "we say END and ENDING then END\nlast"
    matched, deltas, _, _ = _run(tok, text, [r"END$"])
    assert matched is None and "".join(deltas) == text
    matched, deltas, _, _ = _run(tok, text, [r"(?m)END$"])
    assert matched == r"(?m)END$" and "".join(deltas) == "we say END and ENDING then "
    matched, deltas, _, _ = _run(tok, "we say ENDING now", [r"\bEND\b"])
    assert matched is None and "".join(deltas) == "we say ENDING now"


def test_catastrophic_patterns_cost_a_request_little_time():
    """Issue 41 item 5f: 16 catastrophic patterns cost a request one SEARCH_TIMEOUT_S each
    before their first timeouts (0.8 s and more per process; about 3 s on a busy server,
    the engine and the detokenizer both searching); the request's timeout budget bounds
    them together, and its well-behaved pattern still stops it."""
    import time

    from engine.sampling.stops import REQUEST_TIMEOUT_BUDGET_S, SPENT_TIMEOUT_S, first_match

    bad = [f"(K|K)+Z{c}" for c in "ABCDEFGHIJKLMNOP"]  # 2^n paths over a run of K
    compiled = compile_patterns(bad + ["KA"])
    text = "K" * 60 + "A"
    t0 = time.perf_counter()
    assert first_match(compiled, text, 0, partial=True) == (59, "KA")
    spent = time.perf_counter() - t0
    assert [p for p, _ in compiled] == ["KA"]
    bound = REQUEST_TIMEOUT_BUDGET_S + SEARCH_TIMEOUT_S + len(bad) * SPENT_TIMEOUT_S
    assert bound < 0.2 and spent < 0.6, spent  # 16 x SEARCH_TIMEOUT_S = 0.8 s before
