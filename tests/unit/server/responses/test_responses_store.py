"""Issue 28 item 1: the stateful Responses API (``store``, ``previous_response_id``,
``GET``/``DELETE /v1/responses/{id}``, ``input_items``, ``background`` and ``cancel``), through
the official ``openai`` client over the app and a fake engine (every request answers "ok").

References: the HF tokenizer's chat template of the whole conversation (the prompt a
continued response must send to the engine), hand-written items and statuses.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from app_helpers import make_app

from engine import io_struct as io
from server.responses.store import ResponseStore, StoredResponse

M = "SmolLM2-135M-Instruct"  # the served name of a server without --model-path


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


def _app(tok, **kw):
    app, engine = make_app(**kw)
    engine.tm.set_tokenizer(tok)
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", max_retries=0,
                                http_client=httpx.AsyncClient(
                                    transport=httpx.ASGITransport(app=app),
                                    base_url="http://t"))
    return client, engine


def _template(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


async def test_store_retrieve_list_delete(tok):
    client, _ = _app(tok)
    r = await client.responses.create(model=M, input="What is 2+2?", max_output_tokens=4)
    assert r.store is True and r.output_text == "ok"
    got = await client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = await client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in items.data] == \
        [("message", "user", "input_text", "What is 2+2?")]
    await client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        await client.responses.retrieve(r.id)
    assert r.id in str(exc.value) and exc.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(r.id)


async def test_store_false_keeps_nothing(tok):
    client, _ = _app(tok)
    r = await client.responses.create(model=M, input="hi", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        await client.responses.create(model=M, input="more", previous_response_id=r.id)
    assert exc.value.body["param"] == "previous_response_id"


async def test_previous_response_id_sends_the_whole_conversation(tok):
    client, engine = _app(tok)
    r1 = await client.responses.create(model=M, input="Name a colour.",
                                       instructions="Be brief.")
    r2 = await client.responses.create(model=M, input=[
        {"role": "user", "content": "And another?"}], previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id
    # the first turn's instructions do not carry over (OpenAI's rule)
    assert engine.sent[-1].input_ids == _template(tok, [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "And another?"}])
    r3 = await client.responses.create(model=M, input="A third?",
                                       previous_response_id=r2.id)
    assert engine.sent[-1].input_ids == _template(tok, [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "And another?"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "A third?"}])
    items = await client.responses.input_items.list(r3.id)  # its own input only
    assert [i.content[0].text for i in items.data] == ["A third?"]


async def test_input_items_pages(tok):
    client, _ = _app(tok)
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    r = await client.responses.create(model=M, input=msgs)
    page = await client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["m0", "m1"] and page.has_more
    page2 = await client.responses.input_items.list(r.id, limit=2, order="asc",
                                                    after=page.data[-1].id)
    assert [i.content[0].text for i in page2.data] == ["m2", "m3"]
    desc = await client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in desc.data] == ["m4", "m3", "m2", "m1", "m0"]
    assert not desc.has_more
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.input_items.list(r.id, limit=101)
    assert exc.value.body["param"] == "limit"
    # digits str.isdigit() accepts but int() does not (superscript: a 500 once), or reads
    # as another number (fullwidth): only ASCII digits are a limit, as in OpenAI's API
    for raw in ("\u00b2", "\uff11", "1.0", " 1", "+1", "0x1"):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.get(f"/responses/{r.id}/input_items", cast_to=object,
                             options={"params": {"limit": raw}})
        assert exc.value.body["param"] == "limit", raw


async def test_size_cap_and_ttl(tok):
    client, _ = _app(tok, responses_store_size=2)
    ids = [(await client.responses.create(model=M, input=f"q{i}")).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(ids[0])  # the oldest was evicted
    assert (await client.responses.retrieve(ids[2])).id == ids[2]
    client, _ = _app(tok, responses_store_ttl=0.2)
    r = await client.responses.create(model=M, input="q")
    assert (await client.responses.retrieve(r.id)).id == r.id
    await asyncio.sleep(0.3)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    client, _ = _app(tok, responses_store_size=0)  # the store off: nothing is kept
    r = await client.responses.create(model=M, input="q")
    assert r.store is False


def test_store_evicts_oldest_and_expires_by_its_clock():
    now = [0.0]
    store = ResponseStore(2, 10.0, clock=lambda: now[0])
    for i in range(3):
        store.put(StoredResponse({"id": f"r{i}"}, [], []))
        now[0] += 1.0
    assert len(store) == 2 and store.snapshot("r1") == {"id": "r1"}
    now[0] = 11.5  # r1 stored at 1.0 expired at 11.0; r2 (2.0) lives until 12.0
    with pytest.raises(Exception) as exc:
        store.get("r1")
    assert exc.value.status == 404
    assert store.get("r2").response == {"id": "r2"}


async def test_background_poll_and_cancel(tok):
    client, engine = _app(tok)
    engine.hold = True
    r = await client.responses.create(model=M, input="long story", background=True)
    assert (r.status, r.background, r.store) == ("queued", True, True)
    await asyncio.sleep(0.05)
    assert (await client.responses.retrieve(r.id)).status in ("queued", "in_progress")
    cancelled = await client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert any(isinstance(m, io.AbortReq) and m.rid == r.id for m in engine.sent)
    assert (await client.responses.retrieve(r.id)).status == "cancelled"

    engine.hold = False
    r2 = await client.responses.create(model=M, input="short", background=True)
    for _ in range(50):
        got = await client.responses.retrieve(r2.id)
        if got.status not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.02)
    # the fake engine ends every request by length: max_output_tokens' "incomplete"
    assert got.status == "incomplete" and got.output_text == "ok"
    assert got.usage.output_tokens == 1
    with pytest.raises(openai.BadRequestError):  # a foreground response cannot be cancelled
        await client.responses.cancel((await client.responses.create(
            model=M, input="x")).id)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.create(model=M, input="x", background=True, store=False)
    assert exc.value.body["param"] == "background"


async def test_a_background_response_replaced_under_its_id_is_cancelled(tok):
    """A second response under the same id (the client's X-Request-Id) replaces the first in
    the store; a first still running in background is cancelled (its engine request
    aborted) as when it is deleted, not left generating where no id reaches it."""
    client, engine = _app(tok)
    engine.hold = True
    hdr = {"X-Request-Id": "bg-same"}
    await client.responses.create(model=M, input="long story", background=True,
                                  extra_headers=hdr)
    await asyncio.sleep(0.05)
    first = [m.rid for m in engine.sent if isinstance(m, io.TokenizedGenerateReq)]
    await client.responses.create(model=M, input="another", background=True,
                                  extra_headers=hdr)
    await asyncio.sleep(0.05)
    aborted = {m.rid for m in engine.sent if isinstance(m, io.AbortReq)}
    assert len(first) == 1 and first[0] in aborted
    await client.responses.delete("bg-same")
    await asyncio.sleep(0.05)
    engine_rids = {m.rid for m in engine.sent if isinstance(m, io.TokenizedGenerateReq)}
    assert len(engine_rids) == 2 and engine_rids <= {m.rid for m in engine.sent
                                                     if isinstance(m, io.AbortReq)}


async def test_function_call_output_needs_its_function_call(tok):
    """A ``function_call_output`` whose ``call_id`` names no ``function_call`` of the
    conversation (this input and the ``previous_response_id`` chain) is a 400 naming its
    ``call_id``, as OpenAI answers, and nothing reaches the engine; one that answers a call
    of the input or of a previous response runs."""
    client, engine = _app(tok)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.create(model=M, input=[
            {"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert exc.value.body["param"] == "input[0].call_id"
    assert "'nope'" in exc.value.body["message"]
    assert engine.rids == []
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    r1 = await client.responses.create(model=M, input=[{"role": "user", "content": "go"},
                                                       call])
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.create(model=M, previous_response_id=r1.id, input=[
            {"role": "user", "content": "and?"},
            {"type": "function_call_output", "call_id": "c2", "output": "x"}])
    assert exc.value.body["param"] == "input[1].call_id"
    assert len(engine.rids) == 1
    r2 = await client.responses.create(model=M, previous_response_id=r1.id, input=[
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert r2.output_text == "ok"
    r3 = await client.responses.create(model=M, input=[
        {"role": "user", "content": "go"}, call,
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert r3.output_text == "ok" and len(engine.rids) == 3


async def test_min_tokens_error_names_max_output_tokens(tok):
    """``min_tokens`` above ``max_output_tokens``: the 400 speaks of the Responses field,
    not of chat's ``max_tokens``."""
    client, _ = _app(tok)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.create(model=M, input="hi", max_output_tokens=2,
                                      extra_body={"min_tokens": 5})
    msg = exc.value.body["message"]
    assert exc.value.body["param"] == "min_tokens"
    assert "max_output_tokens" in msg and "max_tokens" not in msg
    assert "max_completion_tokens" not in msg
