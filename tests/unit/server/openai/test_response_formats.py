"""Logprobs shapes and response/chunk building, without a server.

References: GPT-2's byte-to-unicode table (hand-known entries), Python's UTF-8 encoder (token
bytes), the HF tokenizer (token strings), hand-written logprob entries (legacy and chat
shapes), and the non-stream body (stream chunks must concatenate to it, even when the
engine's logprobs arrive in a different message than their tokens).
"""

from __future__ import annotations

import pytest

from server.openai.formats import ChatFormat, CompletionFormat, LogprobOptions
from server.openai.logprobs import (
    TokenStrings,
    byte_level_decoder,
    chat_logprobs,
    clamp,
    completion_logprobs,
)
from server.tokenizer_manager import ReqOutput

TEXTS = ["Hello 😀 世界 emoji 🇫🇷", "naïve café – “quotes” ½ x² → ∞", "tabs\tand\n\nnewlines"]
LENGTH = {"type": "length", "matched": None, "message": None}


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


@pytest.fixture(scope="module")
def strings(tok):
    return TokenStrings(tok)


def test_byte_level_table():
    t = byte_level_decoder()
    assert len(t) == 256 and sorted(t.values()) == list(range(256))
    # GPT-2: printable bytes stand for themselves; space is U+0120 "Ġ", newline U+010A "Ċ"
    assert t["A"] == 65 and t["~"] == 126 and t["Ġ"] == 32 and t["Ċ"] == 10
    assert t["Ā"] == 0 and t["ÿ"] == 255


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_utf8(tok, strings, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(strings.bytes(i) for i in ids) == text.encode("utf-8")
    assert [strings.text(i) for i in ids] == [tok.decode([i]) for i in ids]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert strings.text(end) == "<|im_end|>" and strings.bytes(end) == b"<|im_end|>"
    assert strings.text(ids[0], as_id=True) == f"token_id:{ids[0]}"


def test_no_tokenizer_strings():
    s = TokenStrings(None)
    assert s.text(7) == "token_id:7" and s.bytes(7) == b"token_id:7"


def test_clamp():
    assert clamp(float("-inf")) == -9999.0 and clamp(float("nan")) == -9999.0
    assert clamp(-1.5) == -1.5


def test_completion_logprobs_by_hand(tok, strings):
    a, b, c = (tok.encode(w, add_special_tokens=False)[0] for w in ("Hello", " world", "!"))
    entries = [None, (-0.5, [[b, -0.5], [c, -1.25]]), (float("-inf"), [[a, -0.1], [b, -0.2]])]
    obj, end = completion_logprobs(strings, [a, b, c], entries, 2, offset=10)
    assert obj == {
        "tokens": ["Hello", " world", "!"],
        "token_logprobs": [None, -0.5, -9999.0],
        "top_logprobs": [None, {" world": -0.5, "!": -1.25},
                         {"Hello": -0.1, " world": -0.2, "!": -9999.0}],  # + the chosen one
        "text_offset": [10, 15, 21],
    }
    assert end == 22
    obj, _ = completion_logprobs(strings, [b], [(-0.5, [[b, -0.5], [c, -1.25]])], 0, 0)
    assert obj["top_logprobs"] == [{" world": -0.5}]  # logprobs=0: the chosen token only


def test_chat_logprobs_by_hand(tok, strings):
    a, b = (tok.encode(w, add_special_tokens=False)[0] for w in ("Hi", " there"))
    got = chat_logprobs(strings, [a, b], [(-0.25, [[a, -0.25]]), (-2.0, [[a, -1.0]])], 1)
    assert got == [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105],
         "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]}]},
        {"token": " there", "logprob": -2.0, "bytes": list(b" there"),
         "top_logprobs": [{"token": "Hi", "logprob": -1.0, "bytes": [72, 105]}]},
    ]
    assert chat_logprobs(strings, [a], [(-0.25, [[a, -0.25]])], 0)[0]["top_logprobs"] == []


def _outputs(tok, index: int = 0, prompt_len: int = 3) -> list[ReqOutput]:
    """A choice whose logprobs lag one message behind its tokens (as a drained step may
    send them), with text held back in the middle (as the detokenizer may)."""
    ids = tok.encode(" one two three", add_special_tokens=False)
    e = [(-0.1 * (i + 1), [[ids[i], -0.1 * (i + 1)], [ids[0], -3.0]]) for i in range(len(ids))]
    plp = [None] + [(-1.0, [[ids[0], -0.5]])] * (prompt_len - 1)
    return [
        ReqOutput(index, "", ids[:1], None, prompt_len, 1, [], plp),
        ReqOutput(index, " one two", ids[1:2], None, prompt_len, 2, e[:2]),
        ReqOutput(index, " three", ids[2:], LENGTH, prompt_len, len(ids), e[2:]),
    ]


def test_completion_stream_concatenates_to_full(tok, strings):
    pids = tok.encode("a b c", add_special_tokens=False)
    lp = LogprobOptions(k=1, echo=True, prompt_texts=["a b c"] * 2, prompt_ids=[pids] * 2)

    def fmt():
        return CompletionFormat("cmpl-x", "m", 2, len(pids), True, False, strings, lp)

    outs = [_outputs(tok, i, len(pids)) for i in range(2)]
    body = fmt().full(outs)
    f = fmt()
    text = ["", ""]
    got = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
           for _ in range(2)]
    finishes = [0, 0]
    for o in [x for pair in zip(*outs, strict=True) for x in pair]:  # interleaved choices
        for chunk in f.chunks(o):
            assert chunk["usage"] is None  # include_usage: null until the usage chunk
            (c,) = chunk["choices"]
            text[c["index"]] += c["text"]
            finishes[c["index"]] += c["finish_reason"] is not None
            for k, v in c["logprobs"].items():
                got[c["index"]][k] += v
    assert finishes == [1, 1]
    for i, ch in enumerate(body["choices"]):
        assert ch["text"] == text[i] == "a b c one two three"
        assert ch["logprobs"] == got[i]
        assert ch["logprobs"]["token_logprobs"][:2] == [None, -1.0]
        assert len(ch["logprobs"]["tokens"]) == len(pids) + 3
    assert body["usage"] == f.usage_chunk()["usage"] == {
        "prompt_tokens": len(pids), "completion_tokens": 6, "total_tokens": len(pids) + 6,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_concatenates_to_full(tok, strings):
    lp = LogprobOptions(k=1)
    body = ChatFormat("c", "m", 1, 3, False, False, strings, lp).full([_outputs(tok)])
    f = ChatFormat("c", "m", 1, 3, True, True, strings, lp)
    (start,) = f.start()
    assert start["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text, content, finishes = "", [], 0
    for o in _outputs(tok):
        for chunk in f.chunks(o):
            assert chunk["usage"]["prompt_tokens"] == 3  # continuous_usage_stats
            (c,) = chunk["choices"]
            text += c["delta"].get("content", "")
            content += (c["logprobs"] or {}).get("content", [])
            finishes += c["finish_reason"] is not None
    msg = body["choices"][0]
    assert finishes == 1 and text == msg["message"]["content"] == " one two three"
    assert content == msg["logprobs"]["content"] and len(content) == 3
    assert ChatFormat("c", "m", 1, 3, False).full([_outputs(tok)])["choices"][0][
        "logprobs"] is None


def _detok_outputs(tok, text: str, stop: str, per: int) -> list[ReqOutput]:
    """``text``'s tokens through the detokenizer, ``per`` tokens a message, ended where the
    engine would end on ``stop`` (or by length)."""
    from engine.io_struct import BatchTokenIdOut
    from engine.tokenizer.detokenizer import DetokenizerManager

    ids = tok.encode(text, add_special_tokens=False)
    n = next((i + 1 for i in range(len(ids)) if stop in tok.decode(ids[:i + 1])), len(ids))
    fin = {"type": "stop", "matched": stop, "message": None} if n < len(ids) or \
        stop in text else LENGTH
    det, outs = DetokenizerManager(tok), []
    for i in range(0, n, per):
        chunk = ids[i:i + per]
        f = fin if i + per >= n else None
        b = BatchTokenIdOut(rids=["s"], new_token_ids=[chunk], finished_reasons=[f],
                            prompt_tokens=[1], completion_tokens=[i + len(chunk)],
                            stop_strs=[[stop]], skip_special_tokens=[True],
                            spaces_between_special_tokens=[True], min_tokens=[0])
        outs.append(ReqOutput(0, det.process(b).texts[0], chunk, f, 1, i + len(chunk),
                              [(-0.1, [[c, -0.1]]) for c in chunk]))
    return outs


def test_fuzz_stream_logprobs_near_stop_strings_equal_non_stream(tok, strings):
    """Issue 34 kind 4: a token holding the first bytes of a character a stop string then
    cut (" 😆" with stop "😆") gave those bytes in a stream chunk but not in the non-stream
    body. Random texts of multi-byte characters and stop strings: the streamed chat bytes and
    completion tokens concatenate to the non-stream ones."""
    import random

    rng = random.Random(34)
    words = ["Hi", " 😆", " there", " 世界", " é", "🇫🇷", " ½", "!", " a"]
    for _ in range(120):
        text = "".join(rng.choice(words) for _ in range(rng.randint(2, 7)))
        a = rng.randrange(len(text))
        stop = text[a:a + rng.randint(1, 3)]
        per = rng.choice([1, 2, 3])
        for cls in (ChatFormat, CompletionFormat):
            lp = LogprobOptions(k=0)
            outs = _detok_outputs(tok, text, stop, per)
            body = cls("c", "m", 1, 3, False, False, strings, lp).full([outs])
            f = cls("c", "m", 1, 3, False, False, strings, lp)
            got = []
            for o in _detok_outputs(tok, text, stop, per):
                for chunk in f.chunks(o):
                    lps = chunk["choices"][0]["logprobs"]
                    if lps:
                        got += [d["bytes"] for d in lps["content"]] if cls is ChatFormat \
                            else lps["tokens"]
            want = body["choices"][0]["logprobs"]
            want = [d["bytes"] for d in want["content"]] if cls is ChatFormat \
                else want["tokens"]
            assert got == want, (cls.__name__, text, stop, per)
