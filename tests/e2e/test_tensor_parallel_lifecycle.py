"""Start-up, failure and shutdown of tensor-parallel servers (CPU, gloo, a tiny dummy model).

- two "nodes" on 127.0.0.1 (``--nnodes 2``; node 1 runs only its worker) answer like one
  rank computing the whole model;
- a rank that fails at start-up makes the server exit with its error;
- a rank that dies while serving: /health answers 503, the open stream ends, the server
  exits non-zero, and no process is left;
- SIGTERM stops every rank (no orphans).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import ROOT, _pid_alive, free_port

pytestmark = pytest.mark.slow


def _model_args() -> list[str]:
    from engine.loader.loader import config_dir

    return ["--model-path", config_dir("llama-tiny"), "--load-format", "dummy",
            "--max-total-tokens", "4096"]


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return {p for p in out if _pid_alive(p)}


def _logprobs(srv, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    body = {"model": "llama-tiny", "prompt": prompt_ids, "max_tokens": 6, "temperature": 0,
            "logprobs": 3, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=srv.http_timeout)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def test_two_nodes_match_one_rank(tmp_path, make_server):
    from engine.llm import LLM
    from engine.loader.loader import config_dir
    from engine.sampling.params import SamplingParams

    prompt = [(5 * i + 1) % 4000 + 10 for i in range(40)]
    with LLM(config_dir("llama-tiny"), load_format="dummy", cpu_threads=1) as llm:
        ref = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=0,
                                                    ignore_eos=True))[0]
    addr = f"127.0.0.1:{free_port()}"
    tp = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = (tmp_path / "node1.log").open("w")
    node1 = subprocess.Popen([sys.executable, "-m", "server", *_model_args(), *tp,
                              "--node-rank", "1"], cwd=ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    srv = make_server([*_model_args(), *tp, "--node-rank", "0"], name="node0")
    try:
        srv.start()
        toks, lps = _logprobs(srv, prompt)
        assert len(toks) == 6
        want = [lp for lp, _ in ref.logprobs]
        assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-4
        srv.stop()
        assert node1.wait(timeout=30) is not None  # node 1 ends once rank 0 is gone
    finally:
        srv.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)
        log.close()


def test_rank_failing_at_start_up_stops_the_server(make_server):
    srv = make_server([*_model_args(), "--tp-size", "2"], env={"FERRY_TEST_TP_WORKER_FAIL": "1"})
    with pytest.raises(RuntimeError, match="exited with"):
        srv.start()
    assert "start-up failure injected" in srv.log()
    assert srv.proc.returncode not in (0, None)


def test_rank_death_fails_requests_and_exits(make_server):
    srv = make_server([*_model_args(), "--tp-size", "2"]).start()
    engine_pid = httpx.get(srv.url + "/server_info", timeout=30).json()["stats"]["pid"]
    workers = _descendants(engine_pid)
    assert len(workers) >= 1
    body = {"model": "llama-tiny", "prompt": [10, 11, 12], "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    ended, saw_error = False, False
    with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                      timeout=srv.http_timeout) as r:
        killed = False
        for line in r.iter_lines():
            if not killed and line.startswith("data: {"):
                for w in workers:
                    os.kill(w, signal.SIGKILL)
                killed = True
            if line.startswith("data: {") and "error" in json.loads(line[6:]):
                saw_error = True
            if line == "data: [DONE]":
                ended = True
    assert ended or saw_error, srv.log()  # the stream did not hang
    deadline = time.monotonic() + 30
    status = None
    while time.monotonic() < deadline and srv.proc.poll() is None:
        try:
            status = httpx.get(srv.url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            pass
        if status == 503:
            break
        time.sleep(0.1)
    assert status == 503 or srv.proc.poll() is not None
    assert srv.wait(30) not in (0, None)
    assert not _descendants(srv.proc.pid)


def test_sigterm_stops_every_rank(make_server):
    srv = make_server([*_model_args(), "--tp-size", "2"]).start()
    procs = _descendants(srv.proc.pid)
    assert len(procs) >= 3  # engine, detokenizer, worker (and the resource tracker)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.wait(30) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_pid_alive(p) for p in procs):
        time.sleep(0.2)
    assert not [p for p in procs if _pid_alive(p)]
