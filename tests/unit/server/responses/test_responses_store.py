"""Issue 28 item 1: the stateful Responses API (``store``, ``previous_response_id``,
``GET``/``DELETE /v1/responses/{id}``, ``input_items``, ``background`` and ``cancel``), through
the official ``openai`` client over the app and a fake engine (every request answers "ok").

References: the HF tokenizer's chat template of the whole conversation (the prompt a
continued response must send to the engine), hand-written items and statuses.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from app_helpers import make_app

from engine import io_struct as io
from server.responses.store import (
    ResponseStore,
    StoredResponse,
    estimate_size,
    new_response_id,
)

M = "SmolLM2-135M-Instruct"  # the served name of a server without --model-path
RESP_ID = re.compile(r"resp_[0-9a-f]{48}")  # OpenAI's shape: resp_ and 48 hex digits


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
    with pytest.raises(openai.BadRequestError) as exc:  # OpenAI's 400, not a 404
        await client.responses.create(model=M, input="more", previous_response_id=r.id)
    assert exc.value.body["param"] == "previous_response_id"
    assert exc.value.body["code"] == "previous_response_not_found"


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


async def test_a_request_id_never_reaches_another_response(tok):
    """Issue 41 item 2: a stored response's id is server-made; a later request whose client
    id (``X-Request-Id``, ``rid``, ``request_id``) equals it gets its own response and
    leaves the first as it was: still stored, same input, its engine request not aborted.
    The request id still names the engine request and comes back as ``X-Request-Id``."""
    client, engine = _app(tok)
    engine.hold = True
    r1 = await client.responses.create(model=M, input="long story", background=True)
    await asyncio.sleep(0.05)
    assert RESP_ID.fullmatch(r1.id)
    first = [m.rid for m in engine.sent if isinstance(m, io.TokenizedGenerateReq)]
    assert first == [r1.id]  # no client id: the engine request is named by the response id
    items = (await client.responses.input_items.list(r1.id)).model_dump()
    others = []
    for extra in ({}, {"rid": r1.id}, {"request_id": r1.id}):
        for background in (True, False):
            if not background:
                engine.hold = False
            raw = await client.responses.with_raw_response.create(
                model=M, input="another", background=background,
                extra_headers={"X-Request-Id": r1.id}, extra_body=extra)
            r2 = raw.parse()
            assert raw.headers["x-request-id"] == r1.id  # the client's id, echoed
            assert RESP_ID.fullmatch(r2.id) and r2.id != r1.id
            others.append(r2.id)
            engine.hold = True
    await asyncio.sleep(0.05)
    assert len(set(others)) == len(others)
    assert not any(isinstance(m, io.AbortReq) for m in engine.sent)  # nothing cancelled
    got = await client.responses.retrieve(r1.id)
    assert (got.id, got.status, got.background) == (r1.id, "queued", True)
    assert (await client.responses.input_items.list(r1.id)).model_dump() == items
    # deleting the first still cancels it (its engine request aborted), and only it
    await client.responses.delete(r1.id)
    await asyncio.sleep(0.05)
    aborted = {m.rid for m in engine.sent if isinstance(m, io.AbortReq)}
    assert r1.id in aborted
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r1.id)
    for rid in others:
        assert (await client.responses.retrieve(rid)).id == rid


async def test_a_response_bigger_than_the_store_is_not_stored(tok):
    """Issue 41 item 1: ``--responses-store-bytes`` bounds the store's estimated size; a
    response bigger than all of it is answered with ``store: false`` and not kept (the
    others stay); a background one is a 400 naming ``background`` before it starts."""
    # estimated sizes here: a response to "hi" about 3.4 kB, each 1000 more characters of
    # input 2 kB more (kept twice: its input items and its conversation)
    client, engine = _app(tok, responses_store_bytes=10_000)
    small = await client.responses.create(model=M, input="hi")
    assert small.store is True
    big = await client.responses.create(model=M, input="x" * 4000)
    assert big.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(big.id)
    assert (await client.responses.retrieve(small.id)).id == small.id
    n = len(engine.rids)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.create(model=M, input="x" * 3000, background=True, metadata={
            f"k{i}": "v" * 400 for i in range(16)})  # metadata is kept too
    assert exc.value.body["param"] == "background" and len(engine.rids) == n
    # storing more evicts the oldest until the new one fits (the count cap is far)
    y1 = await client.responses.create(model=M, input="y" * 1000)  # 3.4 + 5.4 kB: both fit
    assert (await client.responses.retrieve(small.id)).id == small.id
    y2 = await client.responses.create(model=M, input="z" * 1000)  # 3 x 5.4 kB: two go
    for gone in (small.id, y1.id):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(gone)
    assert y1.store is True and (await client.responses.retrieve(y2.id)).store is True


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


async def test_metrics_show_the_stores_size(tok):
    """Issue 41: ``/metrics`` shows the store's responses and estimated bytes."""
    client, _ = _app(tok)

    async def gauges() -> tuple[float, float]:
        text = (await client._client.get("http://t/metrics")).text
        return tuple(float(re.search(rf"^ferry:responses_store_{name}{{[^}}]*}} (\S+)$",
                                     text, re.M).group(1)) for name in ("items", "bytes"))

    assert await gauges() == (0, 0)
    r1 = await client.responses.create(model=M, input="one")
    items, one = await gauges()
    assert items == 1 and one > 1000  # a response object alone is kilobytes of JSON
    r2 = await client.responses.create(model=M, input="two" * 500)
    items, both = await gauges()
    assert items == 2 and both > 2 * one + 2 * 1000  # its input is kept twice
    await client.responses.delete(r1.id)
    assert await gauges() == (1, both - one)
    await client.responses.delete(r2.id)
    assert await gauges() == (0, 0)


# ---- issue 41: the store's byte bound, size estimate, ids and refusal to overwrite -------

def _st(rid: str, text: str = "", **response) -> StoredResponse:
    item = {"id": "msg_1", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}]}
    return StoredResponse({"id": rid, **response}, [item], [item])


def test_estimate_size_is_the_json_plus_64_per_container():
    # written out by hand: [{"id":"r"},[],[]] is 18 characters, 4 containers
    assert estimate_size(StoredResponse({"id": "r"}, [], [])) == 18 + 4 * 64
    # each character of a message's text is counted twice (input items, conversation)
    base = estimate_size(_st("r"))
    assert estimate_size(_st("r", "a" * 1000)) == base + 2000
    assert estimate_size(_st("r", metadata={"k": "v" * 100})) == \
        base + len(',"metadata":{"k":""}') + 100 + 64
    # non-ASCII text is counted as its \\uXXXX escapes: never below its UTF-8 bytes
    assert estimate_size(_st("r", "\u00e9" * 10)) == base + 2 * 60


def test_store_bound_in_bytes_evicts_the_oldest_first():
    size = estimate_size(_st("r0", "a" * 100))
    store = ResponseStore(100, 60.0, max_bytes=3 * size)
    for i in range(3):
        assert store.put(_st(f"r{i}", "a" * 100))
    assert store.stats() == (3, 3 * size) and store.nbytes == 3 * size
    assert store.put(_st("r3", "a" * 100))  # one more: the oldest goes
    assert store.stats() == (3, 3 * size)
    with pytest.raises(Exception) as exc:
        store.get("r0")
    assert exc.value.status == 404
    more = "b" * (size // 2)  # counted twice: about as much as two of the others
    bigger = estimate_size(_st("r4", "a" * 100 + more))
    assert 2 * size - 1 <= bigger <= 2 * size
    assert store.put(_st("r4", "a" * 100 + more))  # r1 and r2 make room
    assert [rid for rid in ("r1", "r2", "r3", "r4") if _has(store, rid)] == ["r3", "r4"]
    assert store.stats() == (2, size + bigger)
    store.delete("r3")
    assert store.stats() == (1, bigger)


def _has(store: ResponseStore, rid: str) -> bool:
    try:
        store.get(rid)
    except Exception:  # noqa: BLE001 - the 404
        return False
    return True


def test_a_response_bigger_than_the_whole_store_is_not_stored():
    store = ResponseStore(100, 60.0, max_bytes=2000)
    assert store.put(_st("small"))
    assert store.put(_st("big", "a" * 2000)) is False  # nothing stored, nothing evicted
    assert not _has(store, "big") and _has(store, "small")
    assert store.stats() == (1, estimate_size(_st("small")))
    with pytest.raises(Exception) as exc:
        store.put(_st("big", "a" * 2000), refuse_param="background")
    assert (exc.value.status, exc.value.param) == (400, "background")
    assert ResponseStore(100, 60.0, max_bytes=0).put(_st("r")) is False  # the store off
    assert not ResponseStore(100, 60.0, max_bytes=0).enabled


def test_the_store_never_replaces_a_stored_id():
    store = ResponseStore(100, 60.0)
    first = _st("resp_x", "first")
    assert store.put(first)
    with pytest.raises(ValueError):
        store.put(_st("resp_x", "second"))
    assert store.get("resp_x") is first and store.stats() == (1, estimate_size(first))
    with pytest.raises(ValueError):  # the same object is not put twice either
        store.put(first)


def test_update_reestimates_and_drops_what_outgrew_the_store():
    now = [0.0]
    store = ResponseStore(100, 60.0, max_bytes=5000, clock=lambda: now[0])
    st = _st("bg")
    assert store.put(st) and store.put(_st("other"))
    st.conversation = [*st.conversation, {"type": "message", "text": "a" * 1000}]
    now[0] = 1.0
    assert store.update(st)  # stored again as the newest, with its new size
    assert st.size == estimate_size(st) and st.stored_at == 1.0
    assert store.nbytes == st.size + estimate_size(_st("other"))
    assert store.update(_st("bg")) is False  # another object under its id: not this one's
    st.conversation.append({"type": "message", "text": "a" * 5000})
    assert store.update(st) is False  # outgrew the whole store: dropped, like evicted
    assert not _has(store, "bg") and store.stats() == (1, estimate_size(_st("other")))
    store.delete("other")
    assert store.update(_st("other")) is False and store.stats() == (0, 0)


def test_response_ids_are_server_made_and_random():
    ids = {new_response_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(RESP_ID.fullmatch(i) for i in ids)
