"""Logprobs, echo, and /v1/tokenize + /v1/detokenize through the HTTP API (SmolLM2, CPU).

References: probability laws (exp(logprob) <= 1, the chosen token is the top one when
greedy), the HF tokenizer (token strings decoded one at a time, bytes, tokenize/detokenize),
the prompt logprobs of the same tokens fed back as a prompt (prefill path) against the
logprobs the decode path returned, and the non-stream response (stream concatenation).
"""

from __future__ import annotations

import math

import httpx
import pytest
from api_helpers import MODEL, chat, comp, post, stream_chunks

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
YES_NO = [{"role": "user", "content": "Answer yes or no: is the sky blue?"}]
LP_TOL = 2e-3  # prefill vs decode logits on the CPU reference path (float32)


def assert_error(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ---- completions -------------------------------------------------------------------------

def test_completion_logprobs_shape_and_laws(url, ref_tokenizer):
    r = comp(url, PROMPT, max_tokens=8, ignore_eos=True, logprobs=2)
    ch = r["choices"][0]
    lp = ch["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert n == 8 and len(lp["tokens"]) == len(lp["token_logprobs"]) == n
    assert len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == ch["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 2
        assert chosen == max(top.values())  # greedy: the chosen token is the top one
        assert all(v <= 0.0 for v in top.values())
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5
    # token strings are the tokens decoded one at a time
    ids = [int(t.removeprefix("token_id:")) for t in comp(
        url, PROMPT, max_tokens=8, ignore_eos=True, logprobs=0,
        return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["tokens"]]
    assert lp["tokens"] == [ref_tokenizer.decode([i]) for i in ids]


def test_prompt_logprobs_match_the_decode_logprobs(url, ref_tokenizer):
    """Feed prompt + generated ids back with echo: the prefill's logprob of each generated
    token must equal what the decode steps reported (and its top alternatives too)."""
    gen = comp(url, PROMPT, max_tokens=6, ignore_eos=True, logprobs=2,
               return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in gen["tokens"]]
    prompt_ids = ref_tokenizer.encode(PROMPT)
    full = prompt_ids + ids
    echo = comp(url, full, max_tokens=1, echo=True, logprobs=2,
                return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert echo["token_logprobs"][0] is None and echo["top_logprobs"][0] is None
    p = len(prompt_ids)
    assert echo["tokens"][p:p + len(ids)] == gen["tokens"]
    for i in range(len(ids)):
        assert echo["token_logprobs"][p + i] == pytest.approx(gen["token_logprobs"][i],
                                                              abs=LP_TOL)
        got, want = echo["top_logprobs"][p + i], gen["top_logprobs"][i]
        assert set(got) == set(want)
        assert all(got[t] == pytest.approx(want[t], abs=LP_TOL) for t in want)


def test_echo_text_and_prompt_logprobs(url, ref_tokenizer):
    plain = comp(url, PROMPT, max_tokens=4)
    r = comp(url, PROMPT, max_tokens=4, echo=True)
    assert r["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    assert r["choices"][0]["logprobs"] is None
    r = comp(url, PROMPT, max_tokens=4, echo=True, logprobs=1)
    lp = r["choices"][0]["logprobs"]
    pids = ref_tokenizer.encode(PROMPT)
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(pids) + n
    assert lp["tokens"][:len(pids)] == [ref_tokenizer.decode([i]) for i in pids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])  # top 1 + the chosen one
    assert lp["text_offset"][0] == 0
    # token ids as the prompt: the echoed text is their decoding
    r = comp(url, pids, max_tokens=2, echo=True)
    assert r["choices"][0]["text"].startswith(ref_tokenizer.decode(pids))


def test_echo_of_token_ids_is_verbatim(url, ref_tokenizer):
    """Issue 28 item 3: a prompt of special-token ids echoes them (a prompt of
    <|endoftext|> ids echoed as nothing), and the echoed logprobs index that text."""
    eot, im_start = ref_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"])
    pids = [eot, im_start, *ref_tokenizer.encode("user Hi")]
    want = ref_tokenizer.decode(pids, skip_special_tokens=False)
    assert want.startswith("<|endoftext|><|im_start|>")
    for skip in (True, False):  # skip_special_tokens is the output's, not the echo's
        r = comp(url, pids, max_tokens=3, echo=True, logprobs=0, ignore_eos=True,
                 skip_special_tokens=skip)
        ch = r["choices"][0]
        assert ch["text"].startswith(want)
        lp = ch["logprobs"]
        assert lp["tokens"][:len(pids)] == [ref_tokenizer.decode([i]) for i in pids]
        for tok_s, off in zip(lp["tokens"], lp["text_offset"], strict=True):
            assert ch["text"][off:off + len(tok_s)] == tok_s


def test_prompt_logprobs_rank_outside_the_top_k(url, ref_tokenizer):
    """Issue 28 item 2: each prompt token's own rank, also when it is not among the top k
    (it was null), consistent with the alternatives: k of them rank 1..k, the prompt token
    ranks after every alternative more likely than it."""
    text = "Zebras quietly juggle purple marmalade on Tuesdays."
    r = post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 1, "messages": [
                                               {"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    outside = 0
    for e in plp[1:]:
        ranks = {int(t): v["rank"] for t, v in e.items()}
        assert all(isinstance(k, int) and k >= 1 for k in ranks.values())
        if len(e) == 2:  # the top 1 and the prompt token, which is not it
            (top, top_v), (own, own_v) = sorted(e.items(), key=lambda kv: kv[1]["rank"])
            assert top_v["rank"] == 1 and own_v["rank"] >= 2
            assert own_v["logprob"] <= top_v["logprob"]
            outside += 1
    assert outside >= 3


@pytest.mark.parametrize("echo", [False, True])
def test_completion_stream_logprobs_concatenate_to_non_stream(url, echo):
    # emoji are split over byte-level tokens and a stop string holds text back: the stream's
    # logprobs ride with their tokens, its text may come later
    body = {"model": MODEL, "prompt": "Emoji list: 😀 😃 😄 😁", "max_tokens": 12,
            "temperature": 0, "logprobs": 2, "echo": echo, "stop": ["😆 🙂 never"]}
    full = post(url, "/v1/completions", body).json()["choices"][0]
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in stream_chunks(url, "/v1/completions", body):
        for c in chunk["choices"]:
            text += c["text"]
            for k in lp:
                lp[k] += (c["logprobs"] or {}).get(k, [])
    assert text == full["text"]
    # the second request reads its prompt's KV from the prefix cache: the same tokens, the
    # logprobs equal up to float rounding
    want = full["logprobs"]
    assert lp["tokens"] == want["tokens"] and lp["text_offset"] == want["text_offset"]
    assert lp["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    assert [sorted(t) if t else t for t in lp["top_logprobs"]] == \
        [sorted(t) if t else t for t in want["top_logprobs"]]
    for got_top, want_top in zip(lp["top_logprobs"], want["top_logprobs"]):
        if want_top:
            assert list(got_top.values()) == pytest.approx(list(want_top.values()), abs=1e-4)


# ---- chat --------------------------------------------------------------------------------

def test_chat_logprobs_shapes_and_bytes(url):
    r = chat(url, [{"role": "user", "content": "Write one sentence about Paris."}],
             max_tokens=10, logprobs=True, top_logprobs=3)
    ch = r["choices"][0]
    content = ch["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for e in content:
        assert [set(t) for t in e["top_logprobs"]] == [{"token", "logprob", "bytes"}] * 3
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and e["logprob"] == tops[0]  # greedy
        assert e["token"] == e["top_logprobs"][0]["token"]
    shown = content if ch["finish_reason"] == "length" else content[:-1]
    assert bytes(b for e in shown for b in e["bytes"]).decode() == ch["message"]["content"]
    # logprobs without top_logprobs: [] alternatives; EOS is a token of its own (vLLM)
    r = chat(url, YES_NO, max_tokens=20, logprobs=True)
    content = r["choices"][0]["logprobs"]["content"]
    assert r["choices"][0]["finish_reason"] == "stop"
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(e["top_logprobs"] == [] for e in content)
    assert content[-1]["token"] == "<|im_end|>"
    assert chat(url, YES_NO, max_tokens=3)["choices"][0]["logprobs"] is None


def test_chat_stream_logprobs_concatenate_to_non_stream(url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    full = post(url, "/v1/chat/completions", body).json()["choices"][0]
    text, content = "", []
    for chunk in stream_chunks(url, "/v1/chat/completions", body):
        for c in chunk["choices"]:
            text += c["delta"].get("content") or ""
            content += (c["logprobs"] or {}).get("content", [])
    assert text == full["message"]["content"]
    # read from the prefix cache the second time: equal up to float rounding
    want = full["logprobs"]["content"]
    assert [e["token"] for e in content] == [e["token"] for e in want]
    assert [[t["token"] for t in e["top_logprobs"]] for e in content] == \
        [[t["token"] for t in e["top_logprobs"]] for e in want]
    assert [e["logprob"] for e in content] == pytest.approx([e["logprob"] for e in want],
                                                           abs=1e-4)


def test_logprobs_errors(url):
    msgs = [{"role": "user", "content": "hi"}]
    assert_error(post(url, "/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}),
                 "top_logprobs")
    assert_error(post(url, "/v1/chat/completions", {"messages": msgs, "logprobs": True,
                                                    "top_logprobs": 21}), "top_logprobs")
    assert_error(post(url, "/v1/completions", {"prompt": "x", "logprobs": 21}), "logprobs")
    assert_error(post(url, "/v1/completions", {"prompt": "x", "logprobs": -1}), "logprobs")
    assert_error(post(url, "/v1/chat/completions", {"messages": msgs, "echo": True}), "echo")


# ---- tokenize / detokenize -----------------------------------------------------------------

def test_tokenize_and_detokenize_round_trip(url, ref_tokenizer):
    text = "Hello world! 😀 naïve 世界"
    r = post(url, "/v1/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200
    body = r.json()
    ids = ref_tokenizer.encode(text)
    assert body == {"tokens": ids, "count": len(ids), "max_model_len": 8192}
    r = post(url, "/v1/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.json()["token_strs"] == ref_tokenizer.convert_ids_to_tokens(ids)
    r = post(url, "/v1/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": ref_tokenizer.decode(ids)}
    assert r.json()["prompt"] == text
    msgs = [{"role": "user", "content": "Hi there"}]
    for gen in (True, False):
        r = post(url, "/v1/tokenize", {"messages": msgs, "add_generation_prompt": gen})
        want = ref_tokenizer.encode(ref_tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen), add_special_tokens=False)
        assert r.json()["tokens"] == want
    # the vLLM paths answer too
    assert post(url, "/tokenize", {"prompt": "a"}).json()["tokens"] == ref_tokenizer.encode("a")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/detokenize", {"tokens": [5, 49152]}, "tokens"),
    ("/v1/detokenize", {"tokens": [-1]}, "tokens"),
    ("/v1/detokenize", {"tokens": "abc"}, "tokens"),
    ("/v1/detokenize", {}, "tokens"),
    ("/v1/detokenize", {"tokens": [1] * ((1 << 17) + 1)}, "tokens"),
    ("/v1/tokenize", {}, "prompt"),
    ("/v1/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
     "prompt"),
    ("/v1/tokenize", {"messages": []}, "messages"),
    ("/v1/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages[0].role"),
])
def test_tokenize_errors(url, path, body, param):
    assert_error(post(url, path, body), param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_prompt_logprobs_equal_the_non_stream_ones(url, path):
    """vLLM's prompt_logprobs in a stream: once, in the first chunk of the choice that the
    engine's prompt logprobs reached, equal to the non-stream body's."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    # vLLM's placement: chat at the top level, completions in each choice
    want = r.json()["choices"][0]["prompt_logprobs"] if path == "/v1/completions" \
        else r.json()["prompt_logprobs"]
    assert want[0] is None and len(want) > 3
    chunks = stream_chunks(url, path, body)
    got = [c["choices"][0]["prompt_logprobs"] for c in chunks
           if c["choices"] and "prompt_logprobs" in c["choices"][0]]
    assert len(got) == 1
    assert [None if e is None else set(e) for e in got[0]] == \
        [None if e is None else set(e) for e in want]
    for g, w in zip(got[0][1:], want[1:]):
        for tid in w:
            assert g[tid]["logprob"] == pytest.approx(w[tid]["logprob"], abs=LP_TOL)


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"echo": True, "logprobs": 20}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 20, "echo": True, "logprobs": 0},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 20}, "prompt_logprobs"),
])
def test_prompt_logprobs_beyond_the_limit_are_a_400(url, path, extra, param):
    """Issue 34 kind 3: n x prompt_logprobs (x echo) on a long prompt built answers of tens
    of MB on the event loop; past MAX_PROMPT_LOGPROBS entries it is a 400 naming the field
    and the limit, before any engine work. Just under it is served."""
    from server.pipeline.job import MAX_PROMPT_LOGPROBS

    words = " ".join(["ferry"] * 1000)  # 1001+ tokens: x 16 x 21 (336,336) is past 2**18
    body = {"model": MODEL, "max_tokens": 1, "n": 16, **extra}
    body.update({"prompt": words} if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": words}]})
    r = post(url, path, body)
    assert_error(r, param)
    err = r.json()["error"]
    assert err["code"] == "too_many_prompt_logprobs" and str(MAX_PROMPT_LOGPROBS) in \
        err["message"], err
    body.update(n=1, prompt_logprobs=0)
    body.pop("echo", None)
    body.pop("logprobs", None)
    assert post(url, path, body).status_code == 200
