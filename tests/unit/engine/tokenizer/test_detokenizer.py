"""Incremental detokenization on the real SmolLM2 tokenizer.

The reference is always ``tokenizer.decode(all_ids)`` (HF transformers), cut before the
first stop string: the concatenated deltas must equal it, no delta may carry a U+FFFD the
reference does not have, and no released prefix may contain (the start of) a stop string.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from engine import io_struct as io
from engine.tokenizer.detokenizer import DetokenizerManager, IncrementalDetokenizer

TEXTS = [
    "Hello 😀 世界 emoji 🇫🇷 test",
    "日本語のテキストです。中文也可以吗？한국어 텍스트",
    "naïve café – “quotes” … ½ ∑ x² → ∞",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 🤖🦀🐍 animals",
    "def f(x):\n    return x ** 2  # tabs\tand\n\nnewlines",
]


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


def ref_decode(tok, ids, skip=True):
    """HF decode of the whole output; a character cut at the end is dropped (not U+FFFD)."""
    return tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")


def feed(tok, ids, chunks, stop=(), finished=None, skip=True):
    """Feed ``ids`` in chunks of the given sizes; return the list of deltas."""
    d = IncrementalDetokenizer(tok, list(stop), skip_special_tokens=skip)
    deltas, pos = [], 0
    sizes = list(chunks)
    while pos < len(ids):
        n = sizes.pop(0) if sizes else 1
        part = ids[pos:pos + n]
        pos += n
        deltas.append(d.step(part, finished if pos >= len(ids) else None))
    if finished is None or not ids:
        deltas.append(d.step([], finished or {"type": "length", "matched": None}))
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    ref = ref_decode(tok, ids)
    assert "\ufffd" not in ref
    deltas = feed(tok, ids, [])
    assert "".join(deltas) == ref
    assert all("\ufffd" not in d for d in deltas)
    # the multi-byte characters really are split across tokens (the case under test)
    if any(ord(c) > 0x7F for c in text):
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_random_chunk_sizes(tok):
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(5):
            chunks = [rng.randint(1, 4) for _ in range(len(ids))]
            deltas = feed(tok, ids, chunks)
            assert "".join(deltas) == ref_decode(tok, ids)
            assert all("\ufffd" not in d for d in deltas)


def test_character_cut_by_the_end_is_dropped(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never comes (max_tokens)
    assert tok.decode(cut).endswith("\ufffd")
    deltas = feed(tok, cut, [])
    assert "".join(deltas) == tok.decode(cut).rstrip("\ufffd") == "ok "
    assert all("\ufffd" not in d for d in deltas)


def test_random_token_ids_fuzz(tok):
    """Arbitrary byte-level tokens (invalid UTF-8 included): the stream still equals decode."""
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        chunks = [rng.randint(1, 3) for _ in range(len(ids))]
        assert "".join(feed(tok, ids, chunks)) == ref_decode(tok, ids)


def run_like_engine(tok, ids, stop):
    """Feed one token per step and finish in the step where a stop string completes,
    as the engine does; returns (deltas, reference text cut before the stop)."""
    d = IncrementalDetokenizer(tok, [stop])
    deltas = []
    for k in range(1, len(ids) + 1):
        so_far = ref_decode(tok, ids[:k])
        fin = {"type": "stop", "matched": stop} if stop in so_far else None
        if k == len(ids) and fin is None:
            fin = {"type": "length", "matched": None}
        deltas.append(d.step([ids[k - 1]], fin))
        released = "".join(deltas)
        assert stop not in released
        if fin is not None:
            full = ref_decode(tok, ids[:k])
            return deltas, full[:full.find(stop)] if stop in full else full
    raise AssertionError("unreachable")


@pytest.mark.parametrize("text,stop", [
    ("Hello world, this is a test of stops.", "lo wor"),
    ("Hello world, this is a test of stops.", "is a t"),
    ("Say 😀 stop here please", "😀 st"),
    ("Say 😀 stop here please", "\U0001f600"),
    ("中文也可以吗？한국어", "以吗？한"),
    ("aaaa aab aaab", "aab"),
])
def test_stop_string_spanning_tokens(tok, text, stop):
    ids = tok.encode(text, add_special_tokens=False)
    full = ref_decode(tok, ids)
    assert stop in full
    # the stop string spans several tokens (the hard case): no single token holds it
    assert not any(stop in tok.decode([i]) for i in ids)
    start = full.find(stop)
    deltas, expected = run_like_engine(tok, ids, stop)
    assert "".join(deltas) == expected == full[:start]
    assert all("\ufffd" not in x for x in deltas)


def test_stop_prefix_is_held_back(tok):
    ids = tok.encode("hello world war", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [" world peace"])
    n_hello = len(tok.encode("hello", add_special_tokens=False))
    n_world = len(tok.encode("hello world", add_special_tokens=False))
    out = d.step(ids[:n_hello])
    assert out == "hello"
    out += d.step(ids[n_hello:n_world])
    assert out == "hello"  # " world" could begin " world peace"
    out += d.step(ids[n_world:], {"type": "length", "matched": None})
    assert out == ref_decode(tok, ids)


def test_stop_found_before_engine_finishes_is_cut(tok):
    text = "one two three four five"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = feed(tok, ids, [], stop=["three"])
    assert "".join(deltas) == "one two "


def test_matched_token_id_is_not_in_text(tok):
    ids = tok.encode("The answer is 42.", add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for skip in (True, False):
        deltas = feed(tok, ids + [eos], [], finished={"type": "stop", "matched": eos},
                      skip=skip)
        assert "".join(deltas) == ref_decode(tok, ids, skip)
    # a normal token as stop_token_ids: counted but not shown
    deltas = feed(tok, ids, [], finished={"type": "stop", "matched": ids[-1]})
    assert "".join(deltas) == ref_decode(tok, ids[:-1])


def test_special_tokens_kept_when_asked(tok):
    text = "<|im_start|>user\nhi 😀<|im_end|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        deltas = feed(tok, ids, [], skip=skip)
        assert "".join(deltas) == ref_decode(tok, ids, skip)
    assert "<|im_start|>" in ref_decode(tok, ids, False)


def test_manager_interleaves_and_frees(tok):
    mgr = DetokenizerManager(tok)
    a = tok.encode("Bonjour 😀 le monde", add_special_tokens=False)
    b = tok.encode("世界你好, world", add_special_tokens=False)
    texts = {"a": "", "b": ""}
    steps = max(len(a), len(b))
    for k in range(steps):
        rids, new, fins = [], [], []
        for rid, ids in (("a", a), ("b", b)):
            if k < len(ids):
                rids.append(rid)
                new.append([ids[k]])
                fins.append({"type": "length", "matched": None} if k == len(ids) - 1
                            else None)
        msg = io.BatchTokenIdOut(rids=rids, new_token_ids=new, finished_reasons=fins,
                                 prompt_tokens=[3] * len(rids),
                                 completion_tokens=[k + 1] * len(rids),
                                 stop_strs=[[] for _ in rids],
                                 skip_special_tokens=[True] * len(rids),
                                 spaces_between_special_tokens=[True] * len(rids))
        out = mgr.process(msg)
        assert out.rids == rids and out.new_token_ids == new and out.finished_reasons == fins
        assert out.completion_tokens == [k + 1] * len(rids)
        for rid, t in zip(out.rids, out.texts, strict=True):
            texts[rid] += t
    assert texts == {"a": ref_decode(tok, a), "b": ref_decode(tok, b)}
    assert mgr.states == {}
    # an abort of a rid never seen (aborted while waiting): empty text, nothing kept
    out = mgr.process(io.BatchTokenIdOut(
        rids=["c"], new_token_ids=[[]], finished_reasons=[{"type": "abort", "matched": None}],
        prompt_tokens=[5], completion_tokens=[0], stop_strs=[[]], skip_special_tokens=[True],
        spaces_between_special_tokens=[True]))
    assert out.texts == [""] and mgr.states == {}


def test_no_tokenizer_gives_empty_text():
    d = IncrementalDetokenizer(None)
    assert d.step([1, 2, 3]) == ""
    assert d.step([4], {"type": "length", "matched": None}) == ""


def test_logprobs_forwarded_unchanged(tok):
    """The engine's logprobs ride through the detokenizer, aligned with their rids."""
    mgr = DetokenizerManager(tok)
    lps = [[(-0.5, [[11, -0.5]])], None]
    plps = [[None, (-1.0, [[3, -0.2]])], None]
    out = mgr.process(io.BatchTokenIdOut(
        rids=["a", "b"], new_token_ids=[[11], [12]], finished_reasons=[None, None],
        prompt_tokens=[2, 2], completion_tokens=[1, 1], stop_strs=[[], []],
        skip_special_tokens=[True, True], spaces_between_special_tokens=[True, True],
        logprobs=lps, prompt_logprobs=plps, cached_tokens=[0, -1], queue_time_s=[0.5, -1.0]))
    assert out.logprobs == lps and out.prompt_logprobs == plps
    assert out.cached_tokens == [0, -1] and out.queue_time_s == [0.5, -1.0]
    # and through msgpack, as between the processes (tuples become lists)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=io.BatchStrOut)
    assert back.logprobs == [[[-0.5, [[11, -0.5]]]], None]
    assert back.prompt_logprobs == [[None, [-1.0, [[3, -0.2]]]], None]
