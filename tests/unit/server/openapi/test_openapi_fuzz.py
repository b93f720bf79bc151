"""Schemathesis over the app with a fake engine (no model, seconds): every operation of
/openapi.json, positive and negative, answers a documented status (never 5xx) with a
documented content type, a body that fits its schema and the X-Request-Id header. The same
run against a real server is tests/e2e/test_schemathesis.py."""

from __future__ import annotations

import collections

import pytest
from app_helpers import make_app

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

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


def fuzz(op, mode, failures: list[str], statuses: collections.Counter):
    """The seeded hypothesis test of one operation in one generation mode."""

    @seed(16)
    @settings(max_examples=8, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call()
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (FailureGroup, AssertionError) as exc:
            failures.append(f"{op.label} [{mode}]: {str(exc)[:1000]}")

    return run


@pytest.mark.parametrize("kw", [{}, {"api_key": "k"}])
def test_fuzz_the_app_over_a_fake_engine(kw):
    app, _ = make_app(**kw)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    statuses: collections.Counter = collections.Counter()
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 25
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz(op, mode, failures, statuses)()
            except Unsatisfiable:  # nothing to negate (OPTIONS without parameters)
                assert mode == GenerationMode.NEGATIVE and op.method == "options"
    assert failures == [], "\n\n".join(failures[:10])
    assert all(code < 500 for code in statuses), statuses
    assert statuses[200] > 0 and statuses[400] > 0
