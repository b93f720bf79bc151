"""CORS (--allowed-origins/-headers/-methods) and OPTIONS: an allowed origin's preflight is a
204 with the Access-Control-Allow-* headers (without the API key), any other origin gets no
CORS header, OPTIONS on an existing route is never a 405. Over a fake engine."""

from __future__ import annotations

import re

import pytest
from app_helpers import make_app
from starlette.testclient import TestClient

from server.http.cors import parse_origins


def cors_headers(r) -> dict:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


def preflight(client, path, origin, method="POST", headers="authorization, content-type"):
    h = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        h["Access-Control-Request-Headers"] = headers
    return client.options(path, headers=h)


@pytest.fixture
def client():
    return TestClient(make_app(api_key="sekrit")[0])  # preflights must not need the key


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:8080",
                                    "http://localhost"])
def test_default_origins_preflight(client, origin):
    r = preflight(client, "/v1/chat/completions", origin)
    assert r.status_code == 204, r.text
    h = cors_headers(r)
    assert h["access-control-allow-origin"] == origin
    assert h["access-control-allow-methods"] == "GET, POST, OPTIONS"
    assert h["access-control-allow-headers"] == "authorization, content-type"  # mirrored


@pytest.mark.parametrize("origin", ["http://evil.example", "https://localhost:5173",
                                    "http://localhost.evil.example", "http://localhost:80.evil",
                                    "http://127.0.0.1.nip.io:80", "null"])
def test_other_origins_get_no_cors_headers(client, origin):
    r = preflight(client, "/v1/chat/completions", origin)
    assert r.status_code == 204 and cors_headers(r) == {}
    assert r.headers["allow"] == "POST, OPTIONS"
    r = client.get("/v1/models", headers={"Origin": origin,
                                          "Authorization": "Bearer sekrit"})
    assert r.status_code == 200 and cors_headers(r) == {}


def test_actual_request_from_allowed_origin(client):
    r = client.get("/v1/models", headers={"Origin": "http://localhost:3000",
                                          "Authorization": "Bearer sekrit"})
    assert r.status_code == 200
    assert cors_headers(r) == {"access-control-allow-origin": "http://localhost:3000",
                               "access-control-expose-headers": "X-Request-Id"}
    # a 401 is readable by the page too (it can tell the user the key is wrong)
    r = client.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_refused_method_is_a_shaped_400(client):
    r = preflight(client, "/v1/models", "http://localhost:3000", method="DELETE")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "cors_preflight_refused"


@pytest.mark.parametrize("path,allow", [
    ("/v1/completions", "POST, OPTIONS"), ("/v1/models", "GET, HEAD, OPTIONS"),
    ("/v1/models/x/y", "GET, HEAD, OPTIONS"), ("/health", "GET, HEAD, OPTIONS"),
    ("/flush_cache", "POST, OPTIONS"), ("/openapi.json", "GET, HEAD, OPTIONS"),
])
def test_options_without_origin_is_204_with_allow(client, path, allow):
    r = client.options(path)  # no key either
    assert r.status_code == 204 and r.headers["allow"] == allow and r.content == b""


def test_options_on_unknown_route_is_a_shaped_404(client):
    assert client.options("/v1/nothing").status_code == 401  # the key is checked first
    r = TestClient(make_app()[0]).options("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_405_lists_options(client):
    r = client.put("/v1/completions", headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 405 and r.headers["allow"] == "POST, OPTIONS"


def test_any_origin_and_explicit_lists():
    c = TestClient(make_app(allowed_origins="*", allowed_methods="POST",
                            allowed_headers="Content-Type")[0])
    r = c.get("/v1/models", headers={"Origin": "https://anything.example"})
    assert r.headers["access-control-allow-origin"] == "*"
    r = preflight(c, "/v1/completions", "https://x.example", headers="content-type")
    assert r.status_code == 204 and r.headers["access-control-allow-methods"] == "POST"
    r = preflight(c, "/v1/completions", "https://x.example", headers="authorization")
    assert r.status_code == 400  # the header is not allowed


def test_no_origins_means_no_cors():
    c = TestClient(make_app(allowed_origins="")[0])
    r = preflight(c, "/v1/completions", "http://localhost:3000")
    assert r.status_code == 204 and cors_headers(r) == {}


def test_parse_origins():
    exact, regex = parse_origins("https://App.example.com/, http://a:*, http://[::1]:8000")
    assert exact == ["https://app.example.com", "http://[::1]:8000"]
    assert regex == r"(?:http://a(?::[0-9]+)?)"
    assert re.fullmatch(regex, "http://a:1") and re.fullmatch(regex, "http://a")
    assert not re.fullmatch(regex, "http://ab:1")
    assert parse_origins("http://x, *") == (["*"], None)
    assert parse_origins(" , ") == ([], None)
    for bad in ("localhost:3000", "http://*.example.com", "http://a:b", "http://a/path"):
        with pytest.raises(ValueError, match="--allowed-origins"):
            parse_origins(bad)
