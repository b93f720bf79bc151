"""/openapi.json lists every route of the app with its bodies and error responses, its
request schemas hold every field the server reads (and forbid the rest), and real response
bodies validate against its response schemas. /docs serves Swagger UI. Over a fake engine."""

from __future__ import annotations

import json
import re

import pytest
from app_helpers import make_app
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from starlette.routing import Route
from starlette.testclient import TestClient

from engine.sampling.params import SamplingParams
from server.openai.protocol import ACCEPTED_NOOPS, ENGINE_DERIVED, SAMPLING_FIELDS
from server.openapi.spec import build_openapi
from server.pipeline.prompt import MESSAGE_NOOPS, TEMPLATE_FIELDS, TOOL_FIELDS
from server.tools.structured import STRUCTURED_FIELDS, STRUCTURED_NOOPS, TOOL_REQUEST_FIELDS


@pytest.fixture(scope="module")
def app_engine():
    return make_app(max_n=5)


@pytest.fixture(scope="module")
def client(app_engine):
    return TestClient(app_engine[0])


@pytest.fixture(scope="module")
def doc(client):
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def validator(doc, name):
    registry = Registry().with_resource(
        "urn:ferry", Resource.from_contents(doc, default_specification=DRAFT202012))
    return Draft202012Validator({"$ref": f"urn:ferry#/components/schemas/{name}"},
                                registry=registry)


def test_every_route_and_method_is_described(app_engine, doc):
    app = app_engine[0]
    seen = 0
    for route in app.routes:
        assert isinstance(route, Route)
        path = route.path.replace("{model_id:path}", "{model_id}")
        for method in route.methods - {"HEAD"}:
            op = doc["paths"][path][method.lower()]
            assert op["summary"] and "200" in op["responses"], (path, method)
            seen += 1
        options = doc["paths"][path]["options"]
        assert "204" in options["responses"]
        assert [p["name"] for p in options["parameters"]] == re.findall(r"{(\w+)", path)
    # every method of every path besides OPTIONS comes from a route
    assert seen == sum(len(set(item) - {"options"}) for item in doc["paths"].values()) >= 15


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generation_routes_document_bodies_and_errors(doc, path):
    op = doc["paths"][path]["post"]
    name = "CompletionRequest" if path == "/v1/completions" else "ChatCompletionRequest"
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": f"#/components/schemas/{name}"}
    ok = op["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    for status in ("400", "401", "404", "408", "413", "415", "503"):
        err = op["responses"][status]
        assert err["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
        assert "X-Request-Id" in err["headers"]
    assert any(p["name"] == "X-Request-Id" and p["in"] == "header" for p in op["parameters"])


def test_count_tokens_documents_its_own_body(doc):
    """/v1/messages/count_tokens refuses max_tokens, stream and the sampling fields: its
    documented body must not require or offer them (it reused /v1/messages' body)."""
    ref = doc["paths"]["/v1/messages/count_tokens"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(schema["required"]) == {"model", "messages"}
    assert not {"max_tokens", "stream", "temperature", "stop_sequences"} & set(
        schema["properties"])


def test_request_schemas_hold_every_field_the_server_reads(doc):
    schemas = doc["components"]["schemas"]
    comp, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    engine = set(SAMPLING_FIELDS) - ENGINE_DERIVED
    shared = engine | ACCEPTED_NOOPS | STRUCTURED_FIELDS | STRUCTURED_NOOPS
    assert shared <= set(comp["properties"]) and shared <= set(chat["properties"])
    assert {"prompt", "echo", "logprobs", "best_of", "suffix"} <= set(comp["properties"])
    chat_only = TOOL_REQUEST_FIELDS | {"parallel_tool_calls", "messages", "top_logprobs"}
    assert chat_only <= set(chat["properties"])
    assert not (chat_only & set(comp["properties"]))
    assert comp["additionalProperties"] is False and chat["additionalProperties"] is False
    assert comp["properties"]["n"]["maximum"] == 5 == chat["properties"]["n"]["maximum"]
    assert comp["required"] == ["prompt"] and chat["required"] == ["messages"]
    # this server's facts: its model name, the vocabulary of token ids
    assert comp["properties"]["model"]["anyOf"][0] == {"enum": ["SmolLM2-135M-Instruct"]}
    ids = comp["properties"]["prompt"]["anyOf"][2]["items"]
    assert (ids["minimum"], ids["maximum"]) == (0, 49151)
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 49151
    msg = schemas["ChatMessage"]
    assert {"role", "content", *TEMPLATE_FIELDS, *MESSAGE_NOOPS, *TOOL_FIELDS} <= set(
        msg["properties"])
    assert msg["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant",
                                                 "tool"]


def test_request_schemas_accept_and_refuse_like_the_server(doc):
    comp = validator(doc, "CompletionRequest")
    assert comp.is_valid({"prompt": "hi", "stop": "\n", "logit_bias": {"5": -100}})
    assert comp.is_valid({"prompt": [[1, 2], [3]], "response_format": {"type": "json_object"}})
    for bad in ({"prompt": "hi", "n": 6}, {"prompt": "hi", "logit_bias": {"x": 1}},
                {"prompt": "hi", "some_field": 1}, {"prompt": []},
                {"prompt": "hi", "tools": []}, {}, {"prompt": [49152]},
                {"prompt": "hi", "model": "gpt-4"}):
        assert not comp.is_valid(bad), bad
    chat = validator(doc, "ChatCompletionRequest")
    assert chat.is_valid({"messages": [{"role": "user", "content": [{"type": "text",
                                                                     "text": "x"}]}],
                          "tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": "required", "parallel_tool_calls": False})
    assert not chat.is_valid({"messages": [{"role": "robot", "content": "x"}]})
    assert chat.is_valid({"messages": [{"role": "assistant", "content": None}]})
    assert not chat.is_valid({"messages": [{"role": "user", "content": None}]})
    assert not chat.is_valid({"messages": [{"role": "user"}]})
    tok = validator(doc, "TokenizeRequest")
    assert tok.is_valid({"prompt": "x"}) and tok.is_valid({"messages": [{"role": "user",
                                                                       "content": "x"}]})
    assert not tok.is_valid({}) and not tok.is_valid({"prompt": "x", "messages": []})


def test_responses_validate_against_their_schemas(client, doc):
    def check(name, body):
        errors = list(validator(doc, name).iter_errors(body))
        assert errors == [], (name, body, errors[0].message)

    r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "n": 2})
    check("CompletionResponse", r.json())
    check("ErrorResponse", client.post("/v1/completions", json={"prompt": 5}).json())
    check("ModelList", client.get("/v1/models").json())
    model_id = client.get("/v1/models").json()["data"][0]["id"]
    check("ModelCard", client.get(f"/v1/models/{model_id}").json())
    check("HealthResponse", client.get("/health").json())
    check("ServerInfo", client.get("/server_info").json())
    with client.stream("POST", "/v1/completions", json={
            "prompt": [1], "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert len(chunks) == 2  # the token, the usage
    for c in chunks:
        check("CompletionChunk", c)
    # the schemas are not vacuous
    assert not validator(doc, "CompletionResponse").is_valid(dict(chunks[0], usage=None))
    assert not validator(doc, "ErrorResponse").is_valid({"error": {"message": "x"}})


def test_chat_response_schemas_match_the_format():
    from server.openai.formats import ChatFormat
    from server.tokenizer_manager import ReqOutput

    client = TestClient(make_app()[0])
    doc = client.get("/openapi.json").json()
    fmt = ChatFormat("chatcmpl-1", "m", 1, 3, include_usage=True)
    out = ReqOutput(0, "hi", [5], {"type": "stop", "matched": 2}, 3, 1)
    body = fmt.full([[out]])
    assert validator(doc, "ChatCompletionResponse").is_valid(body)
    fmt = ChatFormat("chatcmpl-1", "m", 1, 3, include_usage=True)
    for c in fmt.start() + fmt.chunks(out) + [fmt.usage_chunk()]:
        assert validator(doc, "ChatCompletionChunk").is_valid(c), c


def test_sampling_params_fields_are_documented_with_their_defaults(doc):
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["temperature"]["default"] == SamplingParams().temperature == 1.0
    assert props["max_tokens"]["default"] == 16


def test_a_route_missing_from_operations_is_listed_generically():
    async def handler(request):
        return None

    doc = build_openapi([Route("/v1/new", handler, methods=["POST"]),
                         Route("/v1/new/{x}", handler, methods=["GET"])])
    op = doc["paths"]["/v1/new"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"type": "object"}
    assert {"200", "400", "401", "404", "408", "413", "415", "503"} == set(op["responses"])
    assert doc["paths"]["/v1/new/{x}"]["get"]["parameters"][0]["name"] == "x"
    assert "requestBody" not in doc["paths"]["/v1/new/{x}"]["get"]


def test_docs_page(client):
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in r.text and 'url: "openapi.json"' in r.text


def test_schema_is_open_with_an_api_key_and_lists_the_scheme():
    client = TestClient(make_app(api_key="k")[0])
    doc = client.get("/openapi.json").json()
    assert client.get("/docs").status_code == 200
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
