"""/metrics reads the engine's running and waiting counts now, not the last periodic report,
and keeps the last reported values when the engine is too busy to answer (a fake engine:
``app_helpers``)."""

from __future__ import annotations

import re

from app_helpers import make_app
from starlette.testclient import TestClient

from engine import io_struct as io


def gauge(text: str, name: str) -> float:
    m = re.search(rf'^ferry:{name}{{model_name="fake"}} (\S+)$', text, re.M)
    return float(m.group(1))


def test_metrics_read_the_engines_current_counts():
    app, eng = make_app()
    client = TestClient(app)
    # the last periodic report said 3 running, 2 waiting; since then they finished
    eng.tm._dispatch(io.StatsOut(num_running=3, num_waiting=2, kv_usage=0.5))
    eng.num_running = 0
    text = client.get("/metrics").text
    assert gauge(text, "num_requests_running") == 0
    assert gauge(text, "num_requests_waiting") == 0
    eng.num_running = 2
    assert gauge(client.get("/metrics").text, "num_requests_running") == 2


def test_metrics_keep_the_last_values_when_the_engine_is_busy():
    app, eng = make_app()
    eng.mute_info = True  # the engine is inside a long step: no answer within 1 s
    eng.tm._dispatch(io.StatsOut(num_running=4, num_waiting=1, kv_usage=0.5))
    r = TestClient(app).get("/metrics")
    assert r.status_code == 200 and gauge(r.text, "num_requests_running") == 4
    assert eng.tm.router.info_waiters == {}
