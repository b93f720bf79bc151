"""Issue 16's fault kinds, each against a hand-computed value: no request field silently
dropped (walked over the request models and the peers' extension fields), 415 for a non-JSON
Content-Type, text_offset/tokens/bytes that index the text, stop strings only after
min_tokens, and per-choice seeds that do not collide."""

from __future__ import annotations

import hashlib

import pytest

from engine.args import ServerArgs
from engine.io_struct import BatchTokenIdOut
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req
from engine.scheduler.scheduler import Scheduler
from engine.tokenizer.detokenizer import DetokenizerManager
from server.http.body import check_json_content_type
from server.http.errors import APIError
from server.openai.extensions import ALIASES, EXTENSION_FIELDS, ROUTE_FIELDS, check_extension
from server.openai.formats import ChatFormat, CompletionFormat, LogprobOptions
from server.openai.logprobs import TokenStrings
from server.openai.protocol import (
    ACCEPTED_NOOPS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from server.pipeline.job import choice_seed
from server.tokenizer_manager import ReqOutput

# ---- 1. no field silently dropped ---------------------------------------------------------

#: request fields the routes consume themselves (written here by hand: a new declared field
#: must be added to this list, i.e. someone decided what it does)
HANDLED = {"model", "n", "stream", "stream_options", "prompt", "echo", "logprobs", "best_of",
           "suffix", "messages", "max_completion_tokens", "top_logprobs", "max_tokens",
           "return_tokens_as_token_ids", "prompt_logprobs", "add_special_tokens",
           "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "user",
           "return_token_ids", "truncate_prompt_tokens", "truncation_side"}
SAMPLING = {"min_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
            "ignore_eos", "logit_bias", "skip_special_tokens", "spaces_between_special_tokens",
            "stop_regex"}
#: issue 13's fields (structured output, tools): refused until their module lands
STRUCTURED = {"response_format", "regex", "ebnf", "json_schema", "guided_json", "guided_regex",
              "guided_choice", "guided_grammar", "structured_outputs", "tools", "tool_choice",
              "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern"}
#: the peers' extension fields (vLLM's CompletionRequest/ChatCompletionRequest and SGLang's
#: OpenAI protocol models, 2025), with a non-default value each
PEER_FIELDS = {
    "use_beam_search": True, "length_penalty": 0.5, "include_stop_str_in_output": True,
    "truncate_prompt_tokens": 4, "allowed_token_ids": [1, 2], "bad_words": ["x"],
    "priority": 1, "request_id": "abc", "logits_processors": ["x"], "cache_salt": "s",
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "return_token_ids": True,
    "documents": [{"text": "d"}], "chat_template": "{{x}}", "mm_processor_kwargs": {"a": 1},
    "media_io_kwargs": {"a": 1}, "prompt_embeds": "AAAA", "thinking_token_budget": 8,
    "no_stop_trim": True, "lora_path": "x", "session_params": {"id": "s"},
    "separate_reasoning": False, "stream_reasoning": False, "return_hidden_states": True,
    "custom_logit_processor": "x", "custom_params": {"a": 1}, "bootstrap_host": "h",
    "bootstrap_port": 1, "bootstrap_room": 1, "rid": "r", "sampling_seed": 1,
    "stop_regex": "x", "max_new_tokens": 3, "min_new_tokens": 2, "stream_interval": 2,
    "some_future_field": 1,
}


def _fields(model) -> set[str]:
    return set(model.model_fields)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_declared_field_is_implemented(model):
    # STRUCTURED: issue 13's fields, implemented by their module as they land
    assert _fields(model) - HANDLED - SAMPLING - STRUCTURED == set()


def _body(model, **kw):
    base = {"prompt": "hi"} if model is CompletionRequest else {
        "messages": [{"role": "user", "content": "hi"}]}
    return {**base, **kw}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("name", sorted(PEER_FIELDS) + sorted(STRUCTURED))
def test_peer_fields_are_implemented_noops_or_refused_by_name(model, name):
    value = PEER_FIELDS.get(name, {"type": "json_object"} if name == "response_format"
                            else "[0-9]+")
    if name in _fields(model) or name in ACCEPTED_NOOPS or name in ALIASES:
        return  # implemented (ALIASES: sampling_seed, rid, request_id)
    if name in ROUTE_FIELDS:
        return  # lora_path: checked by the route (tests/unit/server/openai/test_lora_path.py)
    if name in EXTENSION_FIELDS and check_extension(name, value) is None:
        return  # a value ferry's output already is (test_extension_fields.py)
    if name in STRUCTURED:  # issue 13's: handled by their module once it lands
        try:
            from server.tools import structured
        except ImportError:
            structured = None
        theirs = set().union(*(getattr(structured, a, ()) for a in (
            "STRUCTURED_FIELDS", "STRUCTURED_NOOPS", "TOOL_REQUEST_FIELDS")))
        if name in theirs:
            return
    with pytest.raises(APIError) as ei:
        parse_request(model, _body(model, **{name: value}))
    assert ei.value.status == 400 and ei.value.param == name, ei.value


def test_the_issues_examples():
    # ("regex" is issue 13's: implemented by their module, or refused until it lands)
    for bad in (-1, 21):
        with pytest.raises(APIError) as ei:
            parse_request(CompletionRequest, _body(CompletionRequest, prompt_logprobs=bad))
        assert ei.value.param == "prompt_logprobs"
    with pytest.raises(APIError) as ei:
        parse_request(ChatCompletionRequest, _body(ChatCompletionRequest,
                                                   stream=True, stream_options={"x": 1}))
    assert ei.value.param == "stream_options.x"
    # noops stay accepted
    parse_request(ChatCompletionRequest, _body(ChatCompletionRequest, user="u", store=True,
                                               metadata={"a": "b"}, service_tier="auto"))


def test_message_fields():
    from server.pipeline.prompt import messages_for_template

    req = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "x", "refusal": None, "reasoning_content": "r"}]})
    assert messages_for_template(req.messages) == [
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "x", "reasoning_content": "r"}]
    req = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "hi", "audio": {"id": "a"}}]})
    with pytest.raises(APIError) as ei:
        messages_for_template(req.messages)
    assert ei.value.param == "messages[0].audio"


def test_continuation_rules():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    # SGLang's convention: continue_final_message alone implies add_generation_prompt false
    req = parse_request(ChatCompletionRequest, {"messages": msgs,
                                                "continue_final_message": True})
    assert req.add_generation_prompt is False
    for kw, param in (({"continue_final_message": True, "add_generation_prompt": True},
                       "continue_final_message"),
                      ({"chat_template_kwargs": {"tokenize": True}},
                       "chat_template_kwargs.tokenize")):
        with pytest.raises(APIError) as ei:
            parse_request(ChatCompletionRequest, {"messages": msgs, **kw})
        assert ei.value.param == param
    with pytest.raises(APIError) as ei:  # the last message must be the assistant's
        parse_request(ChatCompletionRequest, {
            "messages": msgs[:1], "continue_final_message": True,
            "add_generation_prompt": False})
    assert ei.value.param == "continue_final_message"


FN_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("fields,other", [
    ({"tools": FN_TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": FN_TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format"),
])
def test_continuation_refuses_a_forced_structure(fields, other):
    """A forced tool call or JSON answer constrains only the continued part, so the whole
    message would not be the structure asked for: a 400 naming both fields (SGLang and vLLM
    do not combine them either). Without continue_final_message, or with ``auto`` and
    ``text``, the same bodies parse."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{\"a\": "}]
    with pytest.raises(APIError) as ei:
        parse_request(ChatCompletionRequest, {"messages": msgs, "continue_final_message": True,
                                              **fields})
    assert ei.value.status == 400 and ei.value.param == "continue_final_message"
    assert other in ei.value.message and "continue_final_message" in ei.value.message
    parse_request(ChatCompletionRequest, {"messages": msgs, **fields})
    for ok in ({"tools": FN_TOOLS, "tool_choice": "auto"}, {"tools": FN_TOOLS,
               "tool_choice": "none"}, {"response_format": {"type": "text"}}):
        parse_request(ChatCompletionRequest, {"messages": msgs, "continue_final_message": True,
                                              **ok})


# ---- 2. content type ----------------------------------------------------------------------

@pytest.mark.parametrize("value", ["application/json", "application/json; charset=utf-8",
                                   "Application/JSON;charset=UTF-8"])
def test_json_content_types(value):
    check_json_content_type(value)


@pytest.mark.parametrize("value", [None, "", "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/jsonx"])
def test_other_content_types_are_415(value):
    with pytest.raises(APIError) as ei:
        check_json_content_type(value)
    assert ei.value.status == 415 and ei.value.body()["error"]["type"]


# ---- 5. per-choice seeds ------------------------------------------------------------------

def test_choice_seeds_do_not_collide():
    ref = hashlib.blake2b((1).to_bytes(8, "little") + (1).to_bytes(8, "little"),
                          digest_size=8, person=b"ferry-n").digest()
    assert choice_seed(1, 1) == int.from_bytes(ref, "little", signed=True)
    assert choice_seed(7, 0) == 7
    seeds = {choice_seed(s, j) for s in range(-50, 50) for j in range(8)}
    assert len(seeds) == 100 * 8  # seed s + j would give 107 distinct values
    assert choice_seed(-1, 3) == choice_seed(2**64 - 1, 3)  # the seed mod 2**64


# ---- 4. stop strings after min_tokens -----------------------------------------------------

@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


def _run_stop(tok, text: str, stop: str, min_tokens: int):
    """Feed ``text``'s tokens through the engine's stop check and the detokenizer; return
    (tokens generated, the text the detokenizer returns)."""
    from test_scheduler import FakeRunner

    ids = tok.encode(text, add_special_tokens=False)
    sched = Scheduler(ServerArgs(), FakeRunner(max_total_tokens=256), tokenizer=tok)
    r = Req("s", [1], SamplingParams(max_tokens=100, stop=[stop], min_tokens=min_tokens))
    n = len(ids)
    for i, t in enumerate(ids):
        r.output_ids.append(t)
        if sched.out.check_finished(r, t, i + 1) is not None:
            n = i + 1
            break
    det = DetokenizerManager(tok)
    out = ""
    for i in range(n):
        fin = {"type": "stop", "matched": stop} if i == n - 1 else None
        b = BatchTokenIdOut(rids=["s"], new_token_ids=[[ids[i]]], finished_reasons=[fin],
                            prompt_tokens=[1], completion_tokens=[i + 1], stop_strs=[[stop]],
                            skip_special_tokens=[True], spaces_between_special_tokens=[True],
                            min_tokens=[min_tokens])
        out += det.process(b).texts[0]
    return ids, n, out


def test_stop_string_before_min_tokens_stays_in_the_text(tok):
    text = " 6, 7, 8, 9, 7, 10, 11"
    ids, n, out = _run_stop(tok, text, " 7", 0)
    assert out == " 6,"  # no min_tokens: cut at the first " 7"
    assert tok.decode(ids[:n]).startswith(" 6, 7")
    # min_tokens past the first " 7": it is text; the second one stops, and the tokens
    # counted are exactly those up to it (nothing generated after the text ended)
    first_7 = next(i for i in range(len(ids)) if " 7" in tok.decode(ids[:i + 1]))
    ids, n, out = _run_stop(tok, text, " 7", first_7 + 3)
    assert out == " 6, 7, 8, 9,"
    assert tok.decode(ids[:n]) == " 6, 7, 8, 9, 7"
    # min_tokens beyond both: never cut
    ids, n, out = _run_stop(tok, text, " 7", len(ids))
    assert n == len(ids) and out == text


# ---- 3. offsets that index the text -------------------------------------------------------

def _outs(ids, texts, fin):
    return [ReqOutput(0, t, [i], fin if k == len(ids) - 1 else None, 3, k + 1,
                      [(-0.5, [[i, -0.5]])])
            for k, (i, t) in enumerate(zip(ids, texts, strict=True))]


def _check_law(text: str, lp: dict):
    assert "".join(lp["tokens"]) == text
    for tok_s, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[off:off + len(tok_s)] == tok_s


@pytest.mark.parametrize("skip", [True, False])
def test_completion_offsets_with_special_tokens_and_echo(tok, skip):
    strings = TokenStrings(tok)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    prompt = [im_start, *tok.encode("user hi", add_special_tokens=False), im_end]
    # echo gives the prompt verbatim: its special tokens whatever skip_special_tokens says
    # (that applies to the output)
    prompt_text = tok.decode(prompt, skip_special_tokens=False)
    assert prompt_text.startswith("<|im_start|>")
    out_ids = tok.encode(" Hello world", add_special_tokens=False) + [im_end]
    # the detokenizer's deltas: the EOS (matched) is never shown
    deltas = [tok.decode([t]) for t in out_ids[:-1]] + [""]
    lp = LogprobOptions(k=0, echo=True, prompt_texts=[prompt_text], prompt_ids=[prompt],
                        skip_special_tokens=skip)
    fin = {"type": "stop", "matched": im_end}
    fmt = CompletionFormat("c", "m", 1, len(prompt), False, strings=strings, lp=lp)
    body = fmt.full([_outs(out_ids, deltas, fin)])
    choice = body["choices"][0]
    assert choice["text"] == prompt_text + " Hello world"
    _check_law(choice["text"], choice["logprobs"])
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + len(out_ids)
    assert choice["matched_stop"] == im_end
    # streamed: the chunks' logprobs concatenate to the same object
    fmt = CompletionFormat("c", "m", 1, len(prompt), False, strings=strings, lp=lp)
    chunks = [c for o in _outs(out_ids, deltas, fin) for c in fmt.chunks(o)]
    merged = {k: [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get(k, [])]
              for k in ("tokens", "text_offset")}
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert merged["tokens"] == choice["logprobs"]["tokens"]
    assert merged["text_offset"] == choice["logprobs"]["text_offset"]


def test_offsets_with_a_stop_string_and_split_characters(tok):
    strings = TokenStrings(tok)
    ids = tok.encode(" café 🎉 ok STOP more", add_special_tokens=False)
    # the returned text is cut at " STOP"; the last token crosses the cut
    n = next(i for i in range(len(ids)) if "STOP" in tok.decode(ids[:i + 1])) + 1
    text = " café 🎉 ok"
    deltas = [""] * (n - 1) + [text]  # all held back, released at the finish
    fin = {"type": "stop", "matched": " STOP"}
    for fmt_cls in (CompletionFormat, ChatFormat):
        lp = LogprobOptions(k=0)
        fmt = fmt_cls("c", "m", 1, 3, False, strings=strings, lp=lp)
        body = fmt.full([_outs(ids[:n], deltas, fin)])
        ch = body["choices"][0]
        if fmt_cls is CompletionFormat:
            assert ch["text"] == text
            _check_law(text, ch["logprobs"])
        else:
            got = bytes(b for e in ch["logprobs"]["content"] for b in e["bytes"])
            assert got.decode() == ch["message"]["content"] == text
            assert ch["matched_stop"] == " STOP"


@pytest.mark.parametrize("fmt_cls", [ChatFormat, CompletionFormat])
def test_prompt_logprobs_shape_and_place(tok, fmt_cls):
    """vLLM's placement (issue 28 item 2): chat at the body's top level, completions in each
    choice; the prompt token's own rank (the engine's third entry) even outside the top k."""
    strings = TokenStrings(tok)
    prompt = [10, 20, 30]
    lp = LogprobOptions(prompt_k=1, prompt_ids=[prompt])
    fmt = fmt_cls("c", "m", 1, 3, False, strings=strings, lp=lp)
    out = ReqOutput(0, "x", [5], {"type": "length", "matched": None}, 3, 1,
                    prompt_logprobs=[None, (-1.5, [[7, -0.5], [20, -1.5]], 2),
                                     (-0.25, [[30, -0.25]], 1)])
    body = fmt.full([[out]])
    if fmt_cls is ChatFormat:
        got = body["prompt_logprobs"]
        assert "prompt_logprobs" not in body["choices"][0]
    else:
        got = body["choices"][0]["prompt_logprobs"]
        assert "prompt_logprobs" not in body
    assert got == [None,
                   {"7": {"logprob": -0.5, "rank": 1, "decoded_token": tok.decode([7])},
                    "20": {"logprob": -1.5, "rank": 2, "decoded_token": tok.decode([20])}},
                   {"30": {"logprob": -0.25, "rank": 1, "decoded_token": tok.decode([30])}}]


# ---- issue 34 kind 6: matched_stop is the stop string that cut the text ------------------

def stream_stops(tok, text: str, stops: list[str], stop_regex: list[str] = ()):
    """Feed ``text``'s tokens through the engine's stop check and then, one at a time, the
    detokenizer, with stop strings and ``stop_regex`` patterns; return (the engine's matched
    stop or None, the detokenizer's deltas, the ids up to the engine's stop)."""
    from test_scheduler import FakeRunner

    ids = tok.encode(text, add_special_tokens=False)
    sched = Scheduler(ServerArgs(), FakeRunner(max_total_tokens=256), tokenizer=tok)
    r = Req("s", [1], SamplingParams(max_tokens=200, stop=stops,
                                     stop_regex=list(stop_regex)))
    n, matched = len(ids), None
    for i, t in enumerate(ids):
        r.output_ids.append(t)
        fin = sched.out.check_finished(r, t, i + 1)
        if fin is not None:
            n, matched = i + 1, fin.matched
            break
    det = DetokenizerManager(tok)
    deltas = []
    for i in range(n):
        fin = ({"type": "stop" if matched else "length", "matched": matched}
               if i == n - 1 else None)
        b = BatchTokenIdOut(rids=["s"], new_token_ids=[[ids[i]]], finished_reasons=[fin],
                            prompt_tokens=[1], completion_tokens=[i + 1], stop_strs=[stops],
                            skip_special_tokens=[True], spaces_between_special_tokens=[True],
                            min_tokens=[0], stop_regex=[list(stop_regex)])
        deltas.append(det.process(b).texts[0])
    return matched, deltas, ids[:n]


def _run_stops(tok, text: str, stops: list[str]):
    """(the engine's matched stop or None, the returned text, the generated text)."""
    matched, deltas, ids = stream_stops(tok, text, stops)
    return matched, "".join(deltas), tok.decode(ids)


def test_matched_stop_is_the_earliest_match_not_the_first_listed(tok):
    # both end inside the token " world": "lo wor" starts first and cuts the text
    matched, out, _ = _run_stops(tok, " hello world", ["o w", "lo wor"])
    assert (matched, out) == ("lo wor", " hel")


def test_fuzz_matched_stop_names_the_cut(tok):
    """Random texts and stop lists: the text ends right before ``matched_stop`` and no stop
    string starts earlier in the generated text."""
    import random

    rng = random.Random(34)
    words = ["alpha", " beta", " gamma", ", delta", " epsilon", "\n", " zeta eta", " theta"]
    for _ in range(150):
        text = "".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        stops = []
        for _ in range(rng.randint(1, 4)):
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)] if rng.random() < 0.8 else "zz")
        matched, out, gen = _run_stops(tok, text, stops)
        firsts = [gen.find(s) for s in stops if s in gen]
        if matched is None:
            assert not firsts and out == gen, (text, stops)
            continue
        assert gen[len(out):].startswith(matched), (text, stops, matched, out)
        assert len(out) == min(firsts), (text, stops, matched, out)


# ---- issue 34 kind 5: no field silently dropped, at any depth ----------------------------

_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
#: chat bodies that hold every nested object of a request (together they cover them all)
NESTED_BODIES = [
    {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": "{}"}}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                 "parameters": _WEATHER, "strict": True}}],
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
     "stream": True, "stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_schema", "json_schema": {
         "name": "w", "description": "d", "schema": _WEATHER, "strict": True}}},
    {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_object", "schema": _WEATHER}},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"}},
    {"messages": [{"role": "user", "content": "x"}],
     "structured_outputs": {"json": _WEATHER, "disable_any_whitespace": True,
                            "disable_additional_properties": True, "disable_fallback": False}},
]
#: objects whose keys are the client's own, not fields: JSON schemas, template variables
FREE = ("parameters", "schema", "json", "chat_template_kwargs", "logit_bias", "metadata")


def _validate_chat(body: dict) -> None:
    """Everything the server checks of a chat body before it tokenizes."""
    import asyncio

    from server.pipeline.prompt import messages_for_template
    from server.tools.plan import prepare_chat

    req = parse_request(ChatCompletionRequest, body)
    messages_for_template(req.messages)
    asyncio.run(prepare_chat(req, req.sampling_params(None), None))


def _object_paths(value, path=""):
    """(param path, the dict) of every object nested in ``value``, but the FREE ones."""
    if isinstance(value, dict):
        if path:
            yield path, value
        for k, v in value.items():
            if k not in FREE:
                yield from _object_paths(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _object_paths(v, f"{path}[{i}]")


@pytest.mark.parametrize("body", NESTED_BODIES)
def test_unknown_fields_at_any_depth_are_400s_naming_them(body):
    """Issue 34 kind 5: a key the server would drop, anywhere in the body (a message, a
    content part, a tool call and its function, a tool and its function, tool_choice,
    response_format and its json_schema, structured_outputs, stream_options), is a 400
    naming its path; the bodies themselves are valid."""
    import copy

    _validate_chat(body)
    paths = list(_object_paths(body))
    assert len(paths) >= 2
    for path, _ in paths:
        bad = copy.deepcopy(body)
        target = dict(_object_paths(bad))[path]
        target["zz_unknown"] = 1
        with pytest.raises(APIError) as ei:
            _validate_chat(bad)
        assert ei.value.status == 400 and ei.value.param == f"{path}.zz_unknown", (
            path, ei.value.param, ei.value.message)


@pytest.mark.parametrize("patch,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": _WEATHER, "strict": "yes"}}}, "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": _WEATHER, "description": 3}}},
     "response_format.json_schema.description"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": False}},
     "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": False}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": "[ ]?"}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": "no"}},
     "structured_outputs.disable_fallback"),
    ({"guided_regex": "a", "guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "system", "content": "x", "function_call": {
        "name": "f", "arguments": "{}"}}, {"role": "user", "content": "x"}]},
     "messages[0].function_call"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}],
        "function_call": {"name": "f", "arguments": "{}"}}]}, "messages[0].function_call"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools[0].function.strict"),
])
def test_fields_of_the_wrong_type_or_role_are_400s(patch, param):
    body = {"messages": [{"role": "user", "content": "x"}], **patch}
    with pytest.raises(APIError) as ei:
        _validate_chat(body)
    assert ei.value.status == 400 and ei.value.param == param, ei.value.message


def test_json_object_schema_and_function_call_are_implemented():
    import asyncio

    from server.pipeline.prompt import messages_for_template
    from server.tools.plan import prepare_chat

    req = parse_request(ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_object", "schema": _WEATHER}})
    _, sp = asyncio.run(prepare_chat(req, req.sampling_params(None), None))
    import json

    assert json.loads(sp.json_schema) == _WEATHER  # was {"type": "object"}: schema dropped
    req = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                           "function_call": {"name": "f",
                                                             "arguments": '{"a": 1}'}}]})
    assert messages_for_template(req.messages)[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    for ok in ({"guided_decoding_backend": "xgrammar"},
               {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}):
        req = parse_request(ChatCompletionRequest, {
            "messages": [{"role": "user", "content": "x"}], "guided_regex": "a", **ok}
            if "guided" in next(iter(ok)) else {
            "messages": [{"role": "user", "content": "x"}], **ok})
        asyncio.run(prepare_chat(req, req.sampling_params(None), None))
