"""Issue 29: SGLang's per-request ``lora_path`` (the adapter's name) on /v1/completions,
/v1/chat/completions and /v1/responses, over a fake engine that records the ``lora_name``
of every engine request the routes send (``tests/unit/app_helpers.py``).

Checked against hand-written expectations: a string picks the adapter like ``model``; a list
gives one adapter per prompt of a completions request (each of its ``n`` choices on it);
``null`` is absent; a ``model`` naming another adapter is a 400, an unknown name the 404 of
an unknown model, a list of the wrong length or a value of another type a 400, all naming
``lora_path`` (or ``lora_path[i]``) and sending nothing to the engine; ``lora_id`` stays
refused. The adapters' outputs against transformers + peft: tests/e2e/test_lora_path.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from app_helpers import make_app

from engine import io_struct as io
from server.http.errors import APIError
from server.openai.lora_choice import adapter_of_model, adapters_of_request, shown_model

ADAPTERS = {"a1": "/adapters/a1", "a2": "/adapters/a2"}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


def _app(tok, adapters=ADAPTERS):
    app, engine = make_app(served_model_name="tiny")
    engine.tm.set_tokenizer(tok)
    engine.tm.lora_enabled = bool(adapters)
    engine.tm.lora_adapters = dict(adapters)
    return app, engine


@pytest.fixture
def app(tok):
    return _app(tok)


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app[0]),
                                 base_url="http://t") as c:
        return await c.post(path, json=body)


def _sent(engine) -> dict[str, str | None]:
    """rid -> lora_name of the engine requests sent so far (then forgotten)."""
    out = {m.rid: m.lora_name for m in engine.sent if isinstance(m, io.TokenizedGenerateReq)}
    engine.sent.clear()
    return out


BODIES = {"/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 1},
          "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 1},
          "/v1/responses": {"input": "hi", "max_output_tokens": 1}}


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_a_string_picks_the_adapter_like_model(app, path):
    body = BODIES[path]
    for extra, want in (({}, None), ({"lora_path": None}, None),
                        ({"lora_path": "a1"}, "a1"), ({"model": "a1"}, "a1"),
                        ({"model": "tiny:a2"}, "a2"), ({"lora_path": "a2"}, "a2"),
                        # model naming the base model, or the same adapter: no conflict
                        ({"model": "tiny", "lora_path": "a2"}, "a2"),
                        ({"model": "tiny:a1", "lora_path": "a1"}, "a1"),
                        ({"model": "a1", "lora_path": None}, "a1"),
                        ({"lora_path": ["a2"]}, "a2")):  # a list of one for one prompt
        r = await _post(app, path, {**body, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert list(_sent(app[1]).values()) == [want], extra
        # the adapter is the response's model (Responses too: it showed the served name)
        assert r.json()["model"] == (want or "tiny"), (path, extra)


async def test_a_list_gives_each_prompt_its_adapter(app):
    prompts = [[1, 2], [3, 4], [5, 6]]
    r = await _post(app, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "n": 2,
                                             "lora_path": ["a1", None, "a2"]})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    # choice i = prompt * n + j runs on its prompt's adapter
    assert _sent(app[1]) == {f"{rid}-0": "a1", f"{rid}-1": "a1", f"{rid}-2": None,
                             f"{rid}-3": None, f"{rid}-4": "a2", f"{rid}-5": "a2"}
    assert r.json()["model"] == "tiny"  # several adapters: the served name
    assert len(r.json()["choices"]) == 6
    # null entries take what model names; the same name everywhere is that adapter's answer
    r = await _post(app, "/v1/completions", {"prompt": prompts[:2], "max_tokens": 1,
                                             "model": "a2", "lora_path": [None, "a2"]})
    assert r.status_code == 200, r.text
    assert list(_sent(app[1]).values()) == ["a2", "a2"] and r.json()["model"] == "a2"
    # a string applies to every prompt; streaming sends the same
    r = await _post(app, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1,
                                             "lora_path": "a1", "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    assert list(_sent(app[1]).values()) == ["a1", "a1"]


@pytest.mark.parametrize("path,extra,status,param", [
    ("/v1/completions", {"model": "a1", "lora_path": "a2"}, 400, "lora_path"),
    ("/v1/chat/completions", {"model": "tiny:a1", "lora_path": "a2"}, 400, "lora_path"),
    ("/v1/responses", {"model": "a2", "lora_path": "a1"}, 400, "lora_path"),
    ("/v1/completions", {"model": "a1", "lora_path": ["a2"]}, 400, "lora_path[0]"),
    ("/v1/completions", {"lora_path": "nope"}, 404, "lora_path"),
    ("/v1/chat/completions", {"lora_path": "nope"}, 404, "lora_path"),
    ("/v1/responses", {"lora_path": "nope"}, 404, "lora_path"),
    ("/v1/completions", {"lora_path": ["nope"]}, 404, "lora_path[0]"),
    ("/v1/completions", {"lora_path": ["a1", "a2"]}, 400, "lora_path"),  # one prompt
    ("/v1/chat/completions", {"lora_path": []}, 400, "lora_path"),
    ("/v1/completions", {"lora_path": 5}, 400, "lora_path"),
    ("/v1/completions", {"lora_path": ""}, 400, "lora_path"),
    ("/v1/completions", {"lora_path": {"name": "a1"}}, 400, "lora_path"),
    ("/v1/completions", {"lora_path": [["a1"]]}, 400, "lora_path[0]"),
    ("/v1/chat/completions", {"lora_id": 1}, 400, "lora_id"),
    ("/v1/responses", {"lora_id": 1}, 400, "lora_id"),
    ("/v1/completions", {"model": "nope", "lora_path": "a1"}, 404, "model"),
])
async def test_refusals_name_the_field_and_send_nothing(app, path, extra, status, param):
    r = await _post(app, path, {**BODIES[path], **extra})
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (status, param), r.text
    assert _sent(app[1]) == {}
    if status == 404:
        assert err["code"] == "model_not_found" and "'nope'" in err["message"]
        assert "a1, a2" in err["message"]  # the adapters it could have named
    if param == "lora_id":
        assert "lora_path" in err["message"] and "model" in err["message"]
    if "model" in extra and status == 400:  # the conflict names both adapters
        assert "'a1'" in err["message"] and "'a2'" in err["message"]


async def test_list_length_must_match_the_prompts(app):
    r = await _post(app, "/v1/completions", {"prompt": ["x", "y", "z"], "max_tokens": 1,
                                             "lora_path": ["a1", "a2"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "2 entries" in r.json()["error"]["message"] and "3 prompts" in \
        r.json()["error"]["message"]
    assert _sent(app[1]) == {}


async def test_a_server_without_adapters(tok):
    app = _app(tok, adapters={})
    r = await _post(app, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1,
                                             "lora_path": "a1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
    assert "no LoRA adapters" in r.json()["error"]["message"]
    r = await _post(app, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1,
                                             "lora_path": [None]})
    assert r.status_code == 200 and list(_sent(app[1]).values()) == [None]


def test_the_resolution_functions():
    bases = ("tiny", "/models/tiny")
    assert adapter_of_model(None, bases, "tiny", ADAPTERS) is None
    assert adapter_of_model("unknown", bases, "tiny", ADAPTERS) is None  # sglang-router's
    assert adapter_of_model("/models/tiny", bases, "tiny", ADAPTERS) is None
    assert adapter_of_model("/models/tiny:a2", bases, "tiny", ADAPTERS) == "a2"
    with pytest.raises(APIError) as ei:
        adapter_of_model("tiny:nope", bases, "tiny", ADAPTERS)
    assert (ei.value.status, ei.value.param) == (404, "model")
    assert adapters_of_request(None, None, "tiny", ADAPTERS, 3) == [None] * 3
    assert adapters_of_request("a1", None, "tiny", ADAPTERS, 2) == ["a1", "a1"]
    assert adapters_of_request(None, "a2", "tiny", ADAPTERS, 2) == ["a2", "a2"]
    assert adapters_of_request(None, [None, "a1"], "tiny", ADAPTERS, 2) == [None, "a1"]
    assert adapters_of_request("a1", [None, "a1"], "tiny", ADAPTERS, 2) == ["a1", "a1"]
    with pytest.raises(APIError) as ei:
        adapters_of_request("a1", [None, "a2"], "tiny", ADAPTERS, 2)
    assert (ei.value.status, ei.value.param) == (400, "lora_path[1]")
    assert shown_model(["a1", "a1"], "tiny") == "a1"
    assert shown_model(["a1", None], "tiny") == "tiny"
    assert shown_model([None, None], "tiny") == "tiny"
    assert shown_model(["a1", "a2"], "tiny") == "tiny"


def _unloaded_meanwhile(engine, name: str) -> None:
    """The fake engine answers requests for adapter ``name`` as engine_loop.lora_id does for
    an adapter unloaded between the route's check and the engine (the 404 naming model)."""
    send = engine.send

    def send_or_404(msg):
        if isinstance(msg, io.TokenizedGenerateReq) and msg.lora_name == name:
            engine.sent.append(msg)
            asyncio.get_running_loop().call_soon(engine.tm._dispatch, io.ErrorOut(
                rid=msg.rid, message=f"The model '{name}' does not exist: no such LoRA "
                "adapter is loaded", status=404, param="model", code="model_not_found"))
        else:
            send(msg)
    engine.send = send_or_404


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"lora_path": "a2"}, "lora_path"),
    ("/v1/completions", {"prompt": ["x", "y"], "lora_path": ["a1", "a2"]}, "lora_path[1]"),
    ("/v1/completions", {"prompt": ["x", "y"], "n": 2, "lora_path": [None, "a2"]},
     "lora_path[1]"),
    ("/v1/completions", {"prompt": ["x", "y"], "lora_path": ["a1", "a2"], "stream": True},
     "lora_path[1]"),
    ("/v1/chat/completions", {"lora_path": "a2"}, "lora_path"),
    ("/v1/chat/completions", {"lora_path": ["a2"], "stream": True}, "lora_path[0]"),
    ("/v1/responses", {"lora_path": "a2"}, "lora_path"),
    ("/v1/responses", {"lora_path": "a2", "stream": True}, "lora_path"),
    ("/v1/completions", {"model": "a2"}, "model"),
    ("/v1/chat/completions", {"model": "tiny:a2", "lora_path": [None]}, "model"),
])
async def test_an_adapter_unloaded_after_the_check_is_named_by_its_field(app, path, extra,
                                                                         param):
    """The engine's 404 (the adapter went between the route's check and the engine) names
    the field the body named the adapter with; it named model before the fix."""
    _unloaded_meanwhile(app[1], "a2")
    r = await _post(app, path, {**BODIES[path], **extra})
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.status_code == 200 and '"model_not_found"' in r.text, r.text
        err = json.loads(next(ln[6:] for ln in r.text.splitlines()
                              if "model_not_found" in ln))["error"]
    else:
        assert r.status_code == 404, r.text
        err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "model_not_found"), err
    assert "'a2'" in err["message"]


@pytest.mark.parametrize("name", ["tiny", "unknown"])
async def test_an_adapter_may_not_take_the_base_models_name(app, name):
    """Loaded as "tiny" (the served name), model: "tiny" would pick the base model but
    lora_path: "tiny" the adapter, and /v1/models would list "tiny" twice; "unknown" is
    sglang-router's model for none. Refused before the engine hears of it."""
    r = await _post(app, "/load_lora_adapter", {"lora_name": name, "lora_path": "/adapters/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert f"'{name}'" in r.json()["error"]["message"]
    assert not any(isinstance(m, io.LoadLoRAReq) for m in app[1].sent)


@pytest.mark.parametrize("field", ["lora_path", "model"])
async def test_a_long_unknown_name_is_not_echoed_whole(app, field):
    """A 100 000-character name: the 404 quotes its first 100 characters and its length
    (it echoed all of it)."""
    r = await _post(app, "/v1/completions", {**BODIES["/v1/completions"], field: "é" * 100_000})
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (404, field), r.text
    assert "'" + "é" * 100 + "... (100000 characters)'" in err["message"]
    assert len(err["message"]) < 400
    assert _sent(app[1]) == {}


async def test_a_failed_load_keeps_an_adapter_already_loaded(app):
    """Loading a name that is loaded already fails in the engine (400 naming lora_name);
    the adapter stays usable (the server forgot it: /v1/models dropped it and model or
    lora_path naming it became a 404 while the engine still held it)."""
    engine = app[1]
    send = engine.send

    def answer_lora(msg):
        if isinstance(msg, io.LoadLoRAReq):  # as engine_loop.lora_out answers a taken name
            engine.sent.append(msg)
            asyncio.get_running_loop().call_soon(engine.tm._dispatch, io.LoRAOut(
                rid=msg.rid, success=False, status=400, param="lora_name",
                message=f"a LoRA adapter named {msg.lora_name!r} is already loaded",
                adapters=dict(ADAPTERS)))
        else:
            send(msg)
    engine.send = answer_lora
    r = await _post(app, "/load_lora_adapter", {"lora_name": "a1", "lora_path": "/adapters/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert engine.tm.lora_adapters == ADAPTERS
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app[0]),
                                 base_url="http://t") as c:
        ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
    assert ids == ["tiny", "a1", "a2"]
    r = await _post(app, "/v1/completions", {**BODIES["/v1/completions"], "lora_path": "a1"})
    assert r.status_code == 200 and list(_sent(app[1]).values()) == ["a1"], r.text


@pytest.mark.parametrize("argv,name", [
    (["--lora-paths", "SmolLM2-135M-Instruct=/adapters/x"], "SmolLM2-135M-Instruct"),
    (["--served-model-name", "tiny", "--lora-paths", "a1=/adapters/a1", "tiny=/adapters/x"],
     "tiny"),
    (["--lora-paths", "/adapters/unknown"], "unknown"),  # named after its directory
])
def test_start_up_refuses_an_adapter_named_like_the_base_model(argv, name, capsys,
                                                               monkeypatch):
    """``ferry serve --lora-paths`` with such a name: a usage error (exit 2, one line naming
    --lora-paths) before any process starts; it served two models of one name."""
    import server.launch
    from server.cli import serve

    monkeypatch.setattr(server.launch, "launch_server", lambda args: 0)  # never start one

    with pytest.raises(SystemExit) as ei:
        serve(["--device", "cpu", *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"--lora-paths: the adapter name '{name}' names the base model" in err
    assert "Traceback" not in err


def test_adapter_names_that_do_not_name_the_base_model_pass():
    from engine.args import ServerArgs
    from server.openai.lora import check_adapter_names

    check_adapter_names(ServerArgs(served_model_name="tiny", lora_paths=["a1=/a", "/b/a2"]),
                        "tiny")
    check_adapter_names(ServerArgs(enable_lora=True), "SmolLM2-135M-Instruct")


@pytest.mark.parametrize("item,says", [
    ("x" * 257 + "=/adapters/x", "257 characters, more than 256"),
    ("has space=/adapters/x", "must be 1 or more ASCII letters, digits"),
    ("/adapters/caf\u00e9", "must be 1 or more"),  # named after its directory
    ("a/b=/adapters/x", "must be 1 or more"),
])
def test_start_up_refuses_an_adapter_name_too_long_or_with_odd_characters(item, says, capsys,
                                                                         monkeypatch):
    """Issue 41 item 5d: adapter names are 1..256 of [A-Za-z0-9._-]; ``--lora-paths`` with
    another is a usage error (exit 2) naming --lora-paths."""
    import server.launch
    from server.cli import serve

    monkeypatch.setattr(server.launch, "launch_server", lambda args: 0)  # never start one
    with pytest.raises(SystemExit) as ei:
        serve(["--device", "cpu", "--lora-paths", item])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--lora-paths" in err and says in err and "Traceback" not in err
    from engine.args import adapter_name_error

    assert adapter_name_error("a" * 256) is None and adapter_name_error("v1.2_sql-x") is None


@pytest.mark.parametrize("name", ["x" * 257, "has space", "a/b", "caf\u00e9", "x:y", "a\nb"])
async def test_a_load_with_a_long_or_odd_name_is_a_400_naming_lora_name(app, name):
    """Issue 41 item 5d: refused by the route, before the engine hears of it."""
    r = await _post(app, "/load_lora_adapter", {"lora_name": name, "lora_path": "/adapters/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert len(r.json()["error"]["message"]) < 300
    assert not any(isinstance(m, io.LoadLoRAReq) for m in app[1].sent)


async def test_tokenize_takes_lora_path_like_the_generation_routes(app, tok):
    """Issue 41 item 5c: /v1/tokenize accepts ``lora_path`` (it was a 400 unknown field),
    checks it as the generation routes do (an unknown adapter is a 404 naming it), and
    gives the base model's tokens (an adapter has no tokenizer of its own)."""
    base = (await _post(app, "/v1/tokenize", {"prompt": "hello world"})).json()["tokens"]
    for extra in ({"lora_path": "a1"}, {"lora_path": ["a2"]}, {"model": "tiny:a1"},
                  {"model": "a1", "lora_path": "a1"},
                  {"messages": MESSAGES, "lora_path": "a1", "prompt": None}):
        r = await _post(app, "/v1/tokenize", {"prompt": "hello world", **extra})
        assert r.status_code == 200, (extra, r.text)
        if "messages" not in extra:
            assert r.json()["tokens"] == base
    for extra, status, param in (({"lora_path": "nope"}, 404, "lora_path"),
                                 ({"model": "nope"}, 404, "model"),
                                 ({"lora_path": 5}, 400, "lora_path"),
                                 ({"model": "a1", "lora_path": "a2"}, 400, "lora_path")):
        r = await _post(app, "/v1/tokenize", {"prompt": "hello world", **extra})
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (extra, r.text)
