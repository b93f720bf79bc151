"""``ferry``'s command line: the bench/parity subcommands' ``--help`` lists their own flags
(with help) and the engine's, not the HTTP server's; ``serve --help`` keeps the server's
flags; a malformed ``--allowed-origins`` is refused with exit code 2 naming it; a served
``ferry serve`` leaves with its exit code, its log flushed, without the interpreter's
teardown."""

from __future__ import annotations

import re

import pytest

import server.cli
from server.cli import main


@pytest.mark.parametrize("cmd,own", [
    ("bench-latency", {"--batch-size": "requests in the static batch",
                       "--no-warmup": "time the first run"}),
    ("bench-offline", {"--num-prompts": "requests to run", "--bench-seed": "seed"}),
    ("parity", {"--devices": "two devices", "--prompt-len": "tokens per random prompt"}),
])
def test_subcommand_help_lists_its_own_flags_not_the_servers(capsys, cmd, own):
    with pytest.raises(SystemExit) as ei:
        main([cmd, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ferry {cmd}")
    for flag, words in own.items():
        assert re.search(rf"{flag}\b.*\n?.*{words}", out), (flag, out)
    assert "--model-path" in out and "--device" in out  # the engine's flags stay
    for flag in ("--port", "--host", "--api-key", "--allowed-origins", "--max-request-bytes",
                 "--header-timeout", "--log-requests"):
        assert flag not in out, flag


def test_serve_help_keeps_the_server_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--port" in out and "--allowed-origins" in out and "--api-key" in out


def test_serve_refuses_a_malformed_origin(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["serve", "--allowed-origins", "localhost:3000"])
    assert ei.value.code == 2
    assert "--allowed-origins: 'localhost:3000' is not an origin" in capsys.readouterr().err


def test_a_stopped_server_exits_with_its_code_and_flushed_logs(monkeypatch):
    """``ferry serve`` (and ``python -m server``) end through ``exit_now``: logging shut down
    (its handlers flushed) and the standard streams flushed, then ``os._exit`` with the code
    ``serve`` returned."""
    import logging
    import os

    calls: list = []
    monkeypatch.setattr(server.cli, "serve", lambda argv: calls.append(("serve", argv)) or 3)
    monkeypatch.setattr(logging, "shutdown", lambda: calls.append("logging"))

    def fake_exit(code):
        calls.append(("exit", code))
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(SystemExit):
        main(["serve", "--port", "1"])
    assert calls == [("serve", ["--port", "1"]), "logging", ("exit", 3)]


def test_docs_examples_load_local_model_paths():
    """ferry downloads nothing: every ``--model-path``/``model_path=`` in README.md and docs/
    names a local path (``/models/...``, ``engine/configs/...``), not a hub name
    ``org/name``."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    hub = re.compile(r"(?:--model-path|model_path=)[\s\"']*([A-Za-z][\w.-]*/[\w.-]+)(?![\w./-])")
    found = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            found += [f"{doc.name}:{n}: {m}" for m in hub.findall(line)]
    assert not found, found


def test_docs_forced_tool_call_examples_are_reproducible():
    """A forced tool call whose output the docs show (``# {"city": "Paris"}``) is greedy and
    makes one call: at the default temperature the embedded model makes several calls with
    random cities."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    readme = (root / "README.md").read_text()
    call = readme[readme.index('tool_choice="required"') - 200:]
    call = call[call.index("client.chat.completions.create("):call.index("print(")]
    assert "temperature=0" in call and "parallel_tool_calls=False" in call, call
    usage = (root / "docs/usage.md").read_text()
    body = usage[usage.index('"tool_choice": "required"') - 400:]
    body = body[:body.index("}'")]
    assert '"temperature": 0' in body and '"parallel_tool_calls": false' in body, body
