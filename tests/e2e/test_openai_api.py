"""The OpenAI API of a real server (embedded SmolLM2, CPU): shapes, streaming, usage,
batching invariance, UTF-8 safety, stop strings, and client disconnects.

References: the HF tokenizer (prompt token counts, chat template), the same request sent
alone (batching), the non-stream text (streaming), the first greedy output (stop strings).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
#: the session's shared server (conftest.SHARED_SERVER_ARGS): these tests only send requests
SERVER_ARGS = ["--max-total-tokens", "16384", "--max-request-bytes", "1048576"]
SERVER_SHARED = True
HTTP_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                         timeout=HTTP_TIMEOUT_S, max_retries=0)


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


def stream_text(client, prompt, **kw) -> tuple[str, list, object]:
    """Concatenated text, finish reasons and the usage chunk of a streamed completion."""
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    text, reasons, usage = "", [], None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True, **kw):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            assert "\ufffd" not in c.text
            text += c.text
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
    return text, reasons, usage


def info(server) -> dict:
    r = httpx.get(server.url + "/server_info", timeout=10)
    assert r.status_code == 200
    return r.json()


def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and "ferry:" in r.text
    i = info(server)
    assert i["kv_total_tokens"] == 16384 and i["kv_used_tokens"] == 0
    assert i["engine_pid"] and i["detokenizer_pid"]
    assert i["dtype"] == "float32" and i["kv_cache_dtype"] == "float32"


def test_server_info_splits_ttft(server, client):
    """/server_info sums each request's TTFT parts: arrival at the server -> the scheduler
    (HTTP, tokenization, IPC) and the scheduler -> the first token read back. Together they
    fit inside the time the client waited for the whole (one-token) completion."""
    before = info(server)["stats"]
    t0 = time.monotonic()
    complete(client, "Hello there", max_tokens=1)
    waited = time.monotonic() - t0
    after = info(server)["stats"]
    assert after["first_tokens"] == before["first_tokens"] + 1
    queue = after["ttft_queue_s_sum"] - before["ttft_queue_s_sum"]
    engine = after["ttft_engine_s_sum"] - before["ttft_engine_s_sum"]
    assert 0.0 <= queue and 0.0 < engine
    assert queue + engine <= waited + 0.05  # clocks of two processes: small skew allowed


def _counts(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_completion_stream_equals_non_stream(client, ref_tokenizer):
    prompt = "The three primary colors are"
    r = complete(client, prompt)
    n_prompt = len(ref_tokenizer.encode(prompt))
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    ch = r.choices[0]
    assert ch.finish_reason in ("length", "stop") and ch.text
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == (12 if ch.finish_reason == "length"
                                         else r.usage.completion_tokens)
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    text, reasons, usage = stream_text(client, prompt,
                                       stream_options={"include_usage": True})
    assert text == ch.text and reasons == [ch.finish_reason]
    # the same prompt again: everything but its last token now comes from the prefix cache
    assert usage is not None and _counts(usage) == _counts(r.usage)
    assert usage.prompt_tokens_details.cached_tokens == n_prompt - 1
    # no usage chunk unless asked; stream_options null is the same as absent
    text2, _, usage2 = stream_text(client, prompt, extra_body={"stream_options": None})
    assert text2 == ch.text and usage2 is None


def test_chat_stream_and_non_stream(client, ref_tokenizer):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                       temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    tmpl = [dict(m, content=m["content"] if isinstance(m["content"], str)
                 else m["content"][0]["text"]) for m in messages]
    ref_ids = ref_tokenizer.apply_chat_template(tmpl, add_generation_prompt=True,
                                                tokenize=False)
    assert r.usage.prompt_tokens == len(ref_tokenizer.encode(ref_ids, add_special_tokens=False))

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in body][-1] == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    content = "".join(c.choices[0].delta.content or "" for c in body)
    assert content == msg.content
    assert chunks[-1].choices == []
    assert _counts(chunks[-1].usage) == _counts(r.usage)
    # the stream repeats the prompt: all but its last token come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_concurrent_requests_match_sequential(client):
    base = "In the beginning there was a small village near the river. "
    prompts = [base[: 20 + 7 * i] * (1 + i * i // 2) + " Then" for i in range(8)]  # 5-350 tok
    alone = [complete(client, p, max_tokens=8).choices[0].text for p in prompts]
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda p: complete(client, p, max_tokens=8).choices[0].text,
                               prompts))
    assert together == alone


def test_emoji_and_cjk_stream_without_replacement_chars(client):
    prompts = ["Emoji list: 😀 😃 😄 😁 😆 😅 🤣 😂 🙂 🙃 😉",
               "中文句子：我爱北京天安门，天安门上太阳升。我们",
               "日本語：こんにちは、世界。今日は"]
    non_ascii = 0
    for p in prompts:
        full = complete(client, p, max_tokens=16).choices[0].text
        streamed, _, _ = stream_text(client, p, max_tokens=16)
        assert "\ufffd" not in full
        assert streamed == full
        non_ascii += sum(ord(c) > 0x7F for c in full)
    assert non_ascii >= 3  # the case under test really happened


def _stop_spanning_tokens(tok, text: str) -> str | None:
    """A 3-6 character substring of ``text`` that starts inside one token and ends inside
    a later one (by the reference tokenizer's segmentation)."""
    ids = tok.encode(text, add_special_tokens=False)
    ends = [len(tok.decode(ids[:k])) for k in range(1, len(ids) + 1)]
    for k in range(len(ends) // 3, len(ends) - 1):
        lo = ends[k] - 2
        if lo <= (ends[k - 1] if k else 0):
            continue  # the token is too short to start inside it
        s = text[lo:ends[k] + 2]
        if len(s) >= 3 and s.strip() == s and "\ufffd" not in s:
            return s
    return None


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens(client, ref_tokenizer, stream):
    prompt = "Here is a short story about a robot who learns to paint:"
    first = complete(client, prompt, max_tokens=24).choices[0].text
    stop = _stop_spanning_tokens(ref_tokenizer, first)
    assert stop is not None, first
    expected = first[:first.find(stop)]
    if stream:
        text, reasons, _ = stream_text(client, prompt, max_tokens=24, stop=[stop, "#@never"])
        assert reasons == ["stop"]
    else:
        r = complete(client, prompt, max_tokens=24, stop=[stop, "#@never"])
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
    assert text == expected


def test_n_and_several_prompts(client):
    kw = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 8,
          "extra_body": {"ignore_eos": True}}
    r = complete(client, "Once upon a time", **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 3 * 8  # summed over the choices
    again = complete(client, "Once upon a time", **kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded
    # several prompts: choice i*n+j belongs to prompt i
    r2 = complete(client, ["The sky is", "Water is"], max_tokens=6)
    solo = [complete(client, p, max_tokens=6).choices[0].text for p in ["The sky is", "Water is"]]
    assert [c.text for c in sorted(r2.choices, key=lambda c: c.index)] == solo
    # n > 1 streamed: chunks of both choices, each ending with a finish reason
    reasons = {}
    for chunk in client.completions.create(model=MODEL, prompt="Hello", n=2, max_tokens=5,
                                           temperature=0.7, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert set(reasons) == {0, 1}


def test_token_id_prompt_and_max_tokens_alias(client, ref_tokenizer):
    prompt = "The capital of France is"
    ids = ref_tokenizer.encode(prompt)
    by_text = complete(client, prompt)
    by_ids = complete(client, ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def _wait_kv_free(server, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        i = info(server)
        if i["kv_used_tokens"] == 0 and i["num_running"] == 0 and i["num_waiting"] == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"KV not freed after {timeout} s: {info(server)}")


def test_stream_disconnect_frees_kv(server):
    body = {"model": MODEL, "prompt": "Count from one to one thousand: one, two,",
            "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as c, \
            c.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    # asked while the stream is still read: leaving the loop closes the
                    # generator and can close the connection, and on a loaded machine the
                    # abort then reached the engine before this query (a CI failure)
                    assert info(server)["kv_used_tokens"] > 0  # the request holds KV now
                    break
        assert got == 3
    # freed once the abort reaches the engine (a step can take seconds on a loaded CI box;
    # without the abort the 1000 tokens would take minutes)
    assert _wait_kv_free(server, 60.0) < 60.0


def test_non_stream_disconnect_frees_kv(server):
    body = {"model": MODEL, "prompt": "Write a very long essay about the sea.",
            "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(
            10.0, read=1.5))
    # freed once the abort reaches the engine (a step can take seconds on a loaded CI box;
    # without the abort the 1000 tokens would take minutes)
    assert _wait_kv_free(server, 60.0) < 60.0


# ---- the error table ------------------------------------------------------------------

def post(server, path, body, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, timeout=30,
                      headers={"Content-Type": "application/json"}, **kw)


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("field,value", [
    ("temperature", 3), ("top_p", 0), ("top_k", -5), ("max_tokens", 0), ("n", 17),
    ("stop", ["s"] * 17), ("logit_bias", {"999999": 1}), ("stop_token_ids", [10**9]),
    ("seed", 2**64), ("presence_penalty", 9), ("tools", [{"type": "function"}]),
    ("max_tokens", 10**30), ("min_tokens", 10**30), ("n", 0), ("temperature", -0.5),
    ("top_p", 1.5), ("top_k", 49153), ("top_k", 2**31), ("min_p", 1.5), ("min_p", -1),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0), ("repetition_penalty", 3),
    ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {str(i): 1 for i in range(1025)}), ("stop", "s" * 257), ("stop", [""]),
    ("stop_token_ids", list(range(17))), ("stop_token_ids", [-1]), ("seed", -(2**63) - 1),
    ("ignore_eos", "maybe"), ("skip_special_tokens", 2),
    # strict JSON types, as OpenAI's API: no coercion of booleans, strings or 2.0 to int
    ("max_tokens", True), ("max_tokens", 2.0), ("n", "5"), ("temperature", True),
    ("seed", "5"), ("stream", "yes"), ("stream", "on"), ("stream", 1),
    ("logit_bias", {" 5 ": 1}), ("logit_bias", {"1_0": 1}), ("logit_bias", {"٣": 1}),
    ("stream_options", {"include_usage": True}),  # without stream: true
])
def test_400_names_the_param(server, field, value):
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        if field == "tools" and path == "/v1/completions":
            continue
        # a tool without its function: the param names the missing part
        assert_error(post(server, path, dict(base, model=MODEL, **{field: value})), 400,
                     "tools[0].function" if field == "tools" else field)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": ["hi"] * 129}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": "maybe"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": 0}, "logprobs"),
    ("/v1/chat/completions", {"stream": False, "stream_options": {}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 9000}, "max_completion_tokens"),
])
def test_400_names_the_param_per_endpoint(server, path, body, param):
    if "chat" in path:
        body = dict(body, messages=[{"role": "user", "content": "hi"}])
    assert_error(post(server, path, body), 400, param)


def test_400_prompts_and_bodies(server):
    assert_error(post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": []}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": [5, 49152]}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": [-1]}), 400, "prompt")
    assert_error(post(server, "/v1/completions", b"{not json"), 400)
    assert_error(post(server, "/v1/completions", b'{"prompt": "a\\ud800b"}'), 400)  # surrogate
    assert_error(post(server, "/v1/completions", b'{"prompt": "a", "top_p": NaN}'), 400)
    assert_error(post(server, "/v1/completions", b'{"prompt": "\xff\xfe"}'), 400)
    assert_error(post(server, "/v1/completions", b""), 400)
    assert_error(post(server, "/v1/completions", [1, 2]), 400)
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        400, "messages[0].content[0].image_url")  # a text-only model
    assert_error(post(server, "/v1/completions", {"prompt": "x", "suffix": "y"}), 400,
                 "suffix")
    # prompt + max_tokens beyond the context (8192 tokens): max_tokens is at fault when the
    # prompt alone fits, else the prompt
    err = assert_error(post(server, "/v1/completions", {"prompt": [1] * 8000,
                                                        "max_tokens": 500}),
                       400, "max_tokens", "context_length_exceeded")
    assert "8192" in err["message"]
    assert_error(post(server, "/v1/completions", {"prompt": [1] * 8192, "max_tokens": 1}),
                 400, "prompt", "context_length_exceeded")
    assert_error(post(server, "/v1/completions", {"prompt": [1] * 8190}), 400, "prompt",
                 "context_length_exceeded")  # the default max_tokens (16) is not the client's
    hi = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        assert_error(post(server, "/v1/chat/completions", {"messages": hi, field: 8190}),
                     400, field, "context_length_exceeded")
    # min_tokens is bounded by the context too when max_tokens is absent (chat)
    assert_error(post(server, "/v1/chat/completions", {"messages": hi,
                                                       "min_tokens": 2**31 - 1}),
                 400, "min_tokens", "context_length_exceeded")


def test_400_for_deeply_nested_json(server):
    deep = b"[" * 1000 + b"]" * 1000
    for path, rest in (("/v1/completions", b'"prompt": "Hi"'),
                       ("/v1/chat/completions",
                        b'"messages": [{"role": "user", "content": "Hi"}]'),
                       ("/v1/tokenize", b'"prompt": "Hi"'), ("/v1/detokenize", b'"tokens": [1]')):
        assert_error(post(server, path, b'{"x": ' + deep + b", " + rest + b"}"), 400)
        assert_error(post(server, path, b'{"a":' * 3000 + b"1" + b"}" * 3000), 400)


def test_n_beyond_max_n_states_the_real_limit(server):
    for n in (17, 1000):
        err = assert_error(post(server, "/v1/completions", {"prompt": "hi", "n": n}), 400, "n")
        assert "16" in err["message"] and "128" not in err["message"]  # --max-n (default 16)


def test_stream_options_null_without_stream_is_fine(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                         "stream_options": None})
    assert r.status_code == 200, r.text


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        complete(client, "hi", temperature=5)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "temperature"


def test_openai_client_sees_tool_reply_and_schema_name_400s(client):
    """A tool message whose tool_call_id names no earlier call, and a json_schema name
    outside OpenAI's ^[a-zA-Z0-9_-]{1,64}$: 400 invalid_request_error naming the field, as
    OpenAI answers; the server answers the next request."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    bad = [
        ({"messages": ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_2", "content": "21"}]},
         "messages[2].tool_call_id"),
        ({"messages": ask, "response_format": {"type": "json_schema", "json_schema": {
            "name": "my schema", "schema": {"type": "object"}}}},
         "response_format.json_schema.name")]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, max_tokens=1, **kw)
        assert ei.value.status_code == 400
        assert (ei.value.body["type"], ei.value.body["param"]) == ("invalid_request_error",
                                                                   param)
    ok = client.chat.completions.create(model=MODEL, max_tokens=1, messages=ask + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}])
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_404_405_413(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404,
                 "model", "model_not_found")
    assert_error(httpx.get(server.url + "/v1/nothing", timeout=10), 404)
    assert_error(httpx.get(server.url + "/v1/completions", timeout=10), 405)
    # a trailing slash is another (unknown) route: no redirect built from the Host header
    for method, path in (("POST", "/v1/completions/"), ("GET", "/health/"),
                         ("POST", "/v1/chat/completions/")):
        r = httpx.request(method, server.url + path, json={"prompt": "x"}, timeout=10,
                          headers={"Host": "evil.example"})
        assert "location" not in r.headers
        assert_error(r, 404)
    big = {"prompt": "x" * 1_100_000}
    assert_error(post(server, "/v1/completions", big), 413)

    def chunks():  # no Content-Length: the streamed size is what counts
        for _ in range(40):
            yield b" " * 30_000

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert_error(r, 413)
    # the server is fine afterwards
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_request_id_reused_right_after_a_disconnect(server):
    """A client that drops a stream and retries at once with the same X-Request-Id gets a
    clean answer: the engine may still hold the aborted request for a step, so the id stays
    reserved until its end comes back (it was a 'duplicate request id' 400, or the old
    request's last token in the new answer)."""
    body = {"model": MODEL, "prompt": "Tell me a story about a dragon:", "max_tokens": 6,
            "temperature": 0}
    want = httpx.post(server.url + "/v1/completions", json=body,
                      timeout=HTTP_TIMEOUT_S).json()["choices"][0]["text"]
    for i in range(5):
        hdr = {"X-Request-Id": f"retry-{i}"}
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as c, c.stream(
                "POST", server.url + "/v1/completions",
                json=dict(body, max_tokens=200, stream=True), headers=hdr) as r:
            for n, _line in enumerate(r.iter_lines()):
                if n >= 3:
                    break
        again = httpx.post(server.url + "/v1/completions", json=body, headers=hdr,
                           timeout=HTTP_TIMEOUT_S)
        assert again.status_code == 200, again.text
        assert again.headers["x-request-id"] == f"retry-{i}"
        assert again.json()["choices"][0]["text"] == want
    assert _wait_kv_free(server, 60.0) < 60.0


# ---- issue 34 kind 7: a half-closed client still gets its answer ------------------------

def _raw_request(server, body: bytes, half_close: bool = True) -> bytes:
    """Send one request on a raw socket, shut our writing side, read to EOF."""
    import socket

    s = socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT_S)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data
    finally:
        s.close()


@pytest.mark.parametrize("stream", [False, True])
def test_half_closed_client_gets_its_answer(server, stream):
    """A client that shuts its sending side after a complete request (shutdown(SHUT_WR))
    got no answer: the EOF was taken for a disconnect. It is answered, then the connection
    is closed (the client can send nothing more)."""
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
                       "stream": stream}).encode()
    data = _raw_request(server, body)
    # interim 100s probe a half-closed client while its answer is computed
    while data.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
        data = data[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
    assert data.startswith(b"HTTP/1.1 200 OK"), data[:200]
    assert (b"data: [DONE]" in data) if stream else b'"finish_reason":"length"' in data


def test_half_closed_client_is_probed_and_a_long_answer_arrives(server):
    """A request that takes several seconds: the half-closed client gets interim 100s, then
    its whole answer (a closed client would have made a probe fail and the request abort:
    test_non_stream_disconnect_frees_kv)."""
    body = json.dumps({"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 120,
                       "ignore_eos": True, "temperature": 0}).encode()
    data = _raw_request(server, body)
    while data.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
        data = data[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
    assert data.startswith(b"HTTP/1.1 200 OK"), data[:200]
    assert b'"completion_tokens":120' in data


def test_eof_before_the_body_is_complete_is_a_disconnect(server):
    """An EOF inside the body (or before any request) still ends the connection with no
    answer, and nothing reaches the engine."""
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()
    import socket

    s = socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT_S)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])
    s.shutdown(socket.SHUT_WR)
    assert s.recv(65536) == b""
    s.close()
    assert _wait_kv_free(server, 30.0) < 30.0
