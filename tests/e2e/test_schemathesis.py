"""Schemathesis against ``/openapi.json`` of a real CPU server (embedded SmolLM2).

Every operation of the document is fuzzed with schemathesis' strategies, positive (bodies
and headers that fit the schema) and negative (ones that do not), seeded, with a bounded
number of examples per operation and mode. Generation stays cheap: ``max_tokens`` is capped
at ``MAX_TOKENS`` (chat's default, "up to the context", too) and a list of prompts at
``MAX_PROMPTS``, after generation, before the call. Every response must be a status the
document lists for the operation (2xx or 4xx, never 5xx), with a documented content type, a
body that fits the documented schema and the ``X-Request-Id`` header; ``/health`` is 200
after the run. Failures are collected (not shrunk) and reported together.

``FERRY_FUZZ_EXAMPLES`` overrides the examples per operation and mode (default 40).
"""

from __future__ import annotations

import collections
import os
import re
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--max-total-tokens", "8192", "--max-n", "4", "--max-queued-requests", "64",
               "--log-requests"]
SEED = 16
EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "40"))
MAX_TOKENS = 4
MAX_PROMPTS = 4
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
GENERATION_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations",
                    "/v1/messages"}


def cheap(case) -> None:
    """Cap what a generation request may cost (the schema allows up to the context)."""
    body = case.body
    if case.operation.path not in GENERATION_PATHS or not isinstance(body, dict):
        return
    capped = False
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
            body[key] = MAX_TOKENS
        capped |= isinstance(v, int)
    v = body.get("min_tokens")
    if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS
    if not capped:  # chat's and responses' default is "up to the context"
        body["max_tokens" if "messages" in body or "prompt" in body else
             "max_output_tokens"] = MAX_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        body["prompt"] = prompt[:MAX_PROMPTS]
    messages = body.get("messages")
    if case.operation.path == "/v1/chat/completions" and isinstance(messages, list):
        # a rule JSON Schema cannot state: a tool message answers an earlier assistant's
        # tool call (a 400 otherwise); drop the tool messages that answer nothing so that
        # positive cases can still reach the model
        kept, calls = [], False
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "tool" and not calls:
                continue
            calls |= isinstance(m, dict) and m.get("role") == "assistant" \
                and bool(m.get("tool_calls"))
            kept.append(m)
        body["messages"] = kept or [{"role": "user", "content": "hi"}]


def fuzz(op, mode, url: str, failures: list[str], statuses: dict):
    """The seeded hypothesis test of one operation in one generation mode."""

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        cheap(case)
        try:
            response = case.call(base_url=url, timeout=60)
        except Exception as exc:  # noqa: BLE001 - a dropped connection is a finding
            failures.append(f"{op.label} [{mode}]: {type(exc).__name__}: {exc}\n"
                            f"  {case.as_curl_command()}")
            return
        statuses[op.label][response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (FailureGroup, AssertionError) as exc:
            failures.append(f"{op.label} [{mode}] -> {response.status_code}: "
                            f"{str(exc)[:1500]}\n  {case.as_curl_command()}")

    return run


def test_schemathesis_finds_no_undocumented_status(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures: list[str] = []
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    t0 = time.monotonic()
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 25  # every route, and OPTIONS on each path
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz(op, mode, server.url, failures, statuses)()
            except Unsatisfiable:  # nothing to negate (OPTIONS has no parameters)
                assert mode == GenerationMode.NEGATIVE and op.method == "options", op.label
    elapsed = time.monotonic() - t0
    summary = "\n".join(f"{label}: {dict(c)}" for label, c in sorted(statuses.items()))
    print(f"schemathesis: {sum(map(sum, (c.values() for c in statuses.values())))} calls "
          f"in {elapsed:.0f} s\n{summary}")
    assert failures == [], "\n\n".join(failures[:20])
    assert all(code < 500 for c in statuses.values() for code in c)
    assert any(200 <= code < 300 for code in statuses["POST /v1/completions"])
    assert any(200 <= code < 300 for code in statuses["POST /v1/chat/completions"])
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_request_id_and_current_metrics_on_a_real_server(server):
    """A request named by X-Request-Id: the body's id, the response header and the request
    log's rid; right after it, /metrics shows no running request (the periodic engine report,
    every second, saw it running)."""
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "probe-16.a"},
                   json={"prompt": "Count: 1, 2, 3,", "max_tokens": 64, "ignore_eos": True,
                         "temperature": 0}, timeout=120)
    assert r.status_code == 200
    assert r.json()["id"] == "probe-16.a" == r.headers["x-request-id"]
    text = httpx.get(server.url + "/metrics", timeout=10).text
    running = re.search(r"^ferry:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    assert float(running.group(1)) == 0
    deadline = time.monotonic() + 10
    while "rid=probe-16.a " not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "rid=probe-16.a " in server.log()
