"""Sampling parameters end to end through the HTTP API (embedded SmolLM2, CPU).

References: the greedy output (top_k=1, tiny top_p, min_p=1 must equal it), the HF tokenizer
(the text of forced or cut token sequences), the same seeded request sent alone (batch
invariance), the documented seed derivation (choice j of seed s is choice 0 of seed s + j),
and counts of repeated tokens with and without a penalty (behaviour, not our own numbers).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json

import httpx
import pytest
from api_helpers import HTTP_TIMEOUT_S, MODEL, chat, comp

pytestmark = pytest.mark.slow

REPEAT_PROMPT = "Repeat after me: hello hello hello hello"
YES_NO = [{"role": "user", "content": "Answer yes or no: is the sky blue?"}]


def text(body: dict, i: int = 0) -> str:
    ch = body["choices"][i]
    return ch["text"] if "text" in ch else ch["message"]["content"]


def token_ids(body: dict, i: int = 0) -> list[int]:
    """Generated token ids (asked with logprobs=0 and return_tokens_as_token_ids)."""
    return [int(t.removeprefix("token_id:")) for t in body["choices"][i]["logprobs"]["tokens"]]


def repeats(url: str, **kw) -> int:
    """How many generated tokens repeat an earlier generated token."""
    ids = token_ids(comp(url, REPEAT_PROMPT, max_tokens=16, ignore_eos=True, logprobs=0,
                         return_tokens_as_token_ids=True, **kw))
    return len(ids) - len(set(ids))


# ---- cuts: top_k, top_p, min_p --------------------------------------------------------

def test_cuts_that_leave_one_token_equal_greedy(url):
    prompt = "The three primary colors are"
    greedy = text(comp(url, prompt, max_tokens=10))
    for cut in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        # sampled at temperature 1 (no seed): only the top token survives the cut
        assert text(comp(url, prompt, max_tokens=10, temperature=1.0, **cut)) == greedy, cut


# ---- logit_bias ------------------------------------------------------------------------

def test_logit_bias_forces_and_bans(url, ref_tokenizer):
    banana = ref_tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = comp(url, "My favourite fruit is", max_tokens=5, logit_bias={str(banana): 100},
             logprobs=0, return_tokens_as_token_ids=True)
    assert token_ids(r) == [banana] * 5
    assert text(r) == ref_tokenizer.decode([banana] * 5)
    # -100 on the greedy first token: something else comes first
    first = token_ids(comp(url, "My favourite fruit is", max_tokens=1, logprobs=0,
                           return_tokens_as_token_ids=True))[0]
    r = comp(url, "My favourite fruit is", max_tokens=1, logit_bias={str(first): -100},
             logprobs=0, return_tokens_as_token_ids=True)
    assert token_ids(r)[0] != first


# ---- seeds and n -----------------------------------------------------------------------

def test_seed_reproducible_alone_and_beside_other_requests(url):
    kw = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    prompt = "Once upon a time"
    alone = text(comp(url, prompt, seed=1234, **kw))
    assert text(comp(url, prompt, seed=1234, **kw)) == alone
    assert text(comp(url, prompt, seed=1235, **kw)) != alone
    with cf.ThreadPoolExecutor(4) as ex:
        # a long unseeded request first, so the seeded one decodes beside it
        others = [ex.submit(comp, url, "Write a long story about a dragon.", max_tokens=40,
                            temperature=1.0, ignore_eos=True)]
        mine = ex.submit(comp, url, prompt, seed=1234, **kw)
        others += [ex.submit(comp, url, prompt, seed=99, **kw),
                   ex.submit(comp, url, "The sky is", max_tokens=12)]
        assert text(mine.result()) == alone
        for f in others:
            f.result()


def test_n_with_seed_and_usage(url, ref_tokenizer):
    prompt = "Once upon a time"
    kw = {"n": 3, "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    r = comp(url, prompt, seed=42, **kw)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    texts = [text(r, i) for i in range(3)]
    assert len(set(texts)) > 1  # the choices are different samples
    assert r["usage"]["completion_tokens"] == 3 * 6
    assert r["usage"]["prompt_tokens"] == len(ref_tokenizer.encode(prompt))  # counted once
    assert [text(comp(url, prompt, seed=42, **kw), i) for i in range(3)] == texts
    # documented derivation (docs/usage.md): choice j > 0 gets the signed int64 of the first
    # 8 bytes of BLAKE2b-64(person "ferry-n") over (seed mod 2**64, j) as little-endian u64s
    digest = hashlib.blake2b((42).to_bytes(8, "little") + (1).to_bytes(8, "little"),
                             digest_size=8, person=b"ferry-n").digest()
    seed_1 = int.from_bytes(digest, "little", signed=True)
    assert text(comp(url, prompt, seed=seed_1, **dict(kw, n=1))) == texts[1]
    # issue 16: with seed + j, seed 43's choice 0 was seed 42's choice 1
    assert text(comp(url, prompt, seed=43, **dict(kw, n=1))) != texts[1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_stream_one_finish_reason_per_index(url, path):
    body = {"model": MODEL, "n": 3, "max_tokens": 5, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({"prompt": "Hello"} if "chat" not in path else
                {"messages": [{"role": "user", "content": "Hello"}]})
    finishes: dict[int, int] = {}
    usage = None
    with httpx.stream("POST", url + path, json=body, timeout=HTTP_TIMEOUT_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                if c["finish_reason"] is not None:
                    finishes[c["index"]] = finishes.get(c["index"], 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert 3 <= usage["completion_tokens"] <= 15


# ---- penalties ---------------------------------------------------------------------------

def test_penalties_reduce_repetition(url):
    base = repeats(url)
    assert base >= 12  # the greedy model repeats "hello"
    for field, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0),
                         ("repetition_penalty", 2.0)):
        assert repeats(url, **{field: value}) < base / 2, field


def test_explicit_neutral_penalties_equal_omitted(url):
    plain = text(comp(url, REPEAT_PROMPT, max_tokens=10))
    neutral = text(comp(url, REPEAT_PROMPT, max_tokens=10, presence_penalty=0,
                        frequency_penalty=0, repetition_penalty=1))
    assert neutral == plain


# ---- stop conditions -----------------------------------------------------------------------

def test_min_tokens_and_ignore_eos_keep_going(url):
    short = chat(url, YES_NO, max_tokens=20)
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 8  # EOS-prone prompt
    longer = chat(url, YES_NO, max_tokens=n + 4, min_tokens=n + 4)
    assert longer["usage"]["completion_tokens"] == n + 4
    assert longer["choices"][0]["finish_reason"] == "length"
    r = chat(url, YES_NO, max_completion_tokens=n + 3, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == n + 3
    assert r["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_end_right_there(url, ref_tokenizer):
    prompt = "The capital of France is"
    ids = token_ids(comp(url, prompt, max_tokens=10, ignore_eos=True, logprobs=0,
                         return_tokens_as_token_ids=True))
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    r = comp(url, prompt, max_tokens=10, stop_token_ids=[ids[k]])
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == k + 1  # the stop token counts, unseen
    assert text(r) == ref_tokenizer.decode(ids[:k])


def test_special_tokens_shown_when_not_skipped(url, ref_tokenizer):
    start = ref_tokenizer.convert_tokens_to_ids("<|im_start|>")
    kw = {"max_tokens": 3, "logit_bias": {str(start): 100}}
    assert text(comp(url, "Hi", **kw)) == ""
    for spaces in (True, False):
        got = text(comp(url, "Hi", skip_special_tokens=False,
                        spaces_between_special_tokens=spaces, **kw))
        assert got == ref_tokenizer.decode([start] * 3, skip_special_tokens=False,
                                           spaces_between_special_tokens=spaces)
        assert got.count("<|im_start|>") == 3


def test_stream_options_null_and_openai_client(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                  stream=True, stream_options=None)
    chunks = list(r)
    assert chunks and all(c.usage is None for c in chunks)
    r = client.chat.completions.create(
        model=MODEL, messages=YES_NO, temperature=0, max_completion_tokens=4, seed=3,
        extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert r.choices[0].message.content
