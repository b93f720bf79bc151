"""Helpers for the end-to-end tests: a real ``python -m server`` subprocess on 127.0.0.1.

Each server runs the embedded SmolLM2 on the CPU in its own session (so a stop kills the
whole process group), with ``TMPDIR`` pointing into the test's temp dir so the tests can
check that the private IPC dir is removed at exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: model + tokenizer load on 2 CPU cores that another e2e worker's start-ups share (``make
#: test`` runs tests/e2e on two pytest-xdist workers): ~15 s alone, several times that under
#: load; the server's own --startup-timeout is 900 s
START_TIMEOUT_S = 600.0
#: start-ups retried on a new port when the free port picked was taken before the server
#: bound it (another worker's server or client got it in between)
PORT_RETRIES = 3
STOP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 120.0    # any single request in the e2e tests


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int | None) -> bool:
    """True if ``pid`` exists and is not a zombie (Linux /proc; no psutil)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class _PortTaken(Exception):
    """The server could not bind the port picked for it."""


class FerryServer:
    """One ferry server subprocess.

    Args:
        tmp: a private directory (log file, TMPDIR of the server).
        extra_args: flags after ``python -m server --host 127.0.0.1 --port P``.
        env: extra environment variables of the server.
    """

    def __init__(self, tmp: Path, extra_args: list[str], env: dict[str, str] | None = None):
        self.tmp = tmp
        self.tmpdir = tmp / "t"
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "server.log"
        self.extra_args = list(extra_args)
        self._pick_port()
        self.proc: subprocess.Popen | None = None
        self.env = dict(env or {})

    def _pick_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def start(self) -> FerryServer:
        for attempt in range(PORT_RETRIES):
            try:
                return self._start()
            except _PortTaken:
                if attempt == PORT_RETRIES - 1:
                    raise RuntimeError(f"no free port after {PORT_RETRIES} tries:\n"
                                       f"{self.log()}") from None
                self._log.close()
                self._pick_port()
        raise AssertionError("unreachable")

    def _start(self) -> FerryServer:
        # one intra-op thread: on a busy 2-core CI box, OpenMP threads waiting on each
        # other make every decode step several times slower
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONUNBUFFERED="1", TMPDIR=str(self.tmpdir), OMP_NUM_THREADS="1",
                   **self.env)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "server", *self.args], cwd=ROOT,
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                if f"cannot listen on 127.0.0.1:{self.port}" in self.log():
                    raise _PortTaken
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:"
                                   f"\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"/health not 200 after {START_TIMEOUT_S} s:\n{self.log()}")
            time.sleep(0.1)

    pid_alive = staticmethod(_pid_alive)
    http_timeout = HTTP_TIMEOUT_S

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-8000:]

    def ipc_dirs(self) -> list[str]:
        return [p.name for p in self.tmpdir.iterdir() if p.name.startswith("ferry-")]

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM the server (it drains and stops its children), then SIGKILL the group."""
        if self.proc is None or self._log.closed:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(STOP_TIMEOUT_S) is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # children are in the server's session; kill any straggler so no test leaks processes
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


#: the servers of ``server_pool`` by argument list
_POOL: dict[tuple[str, ...], FerryServer] = {}


def pytest_runtest_teardown(item, nextitem):
    """Stop the pool's servers once the run leaves tests/e2e for good (the engine, kernel and
    unit tests after it need none of them: their memory goes back before those start)."""
    here = Path(__file__).parent
    if not _POOL or (nextitem is not None and here in Path(nextitem.path).parents):
        return
    items = item.session.items
    rest = items[items.index(nextitem):] if nextitem is not None else []
    if not any(here in Path(i.path).parents for i in rest):
        for srv in _POOL.values():
            srv.stop()
        _POOL.clear()  # a later module of this worker (pytest-xdist) starts them anew


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory):
    """Servers kept for the e2e part of the session, one per distinct argument list:
    ``pool(args)`` starts the server of ``args`` on its first call and hands the same one out
    afterwards. For modules that only send requests and leave the server as they found it
    (the stats they check are deltas, or cannot move under their flags); all stop when the
    run leaves tests/e2e (``pytest_runtest_teardown``) or at the session's end."""
    running = _POOL

    def pool(args) -> FerryServer:
        key = tuple(args)
        if key not in running:
            srv = FerryServer(tmp_path_factory.mktemp("ferry-pool"), list(key))
            running[key] = srv.start()
        return running[key]

    try:
        yield pool
    finally:
        for srv in running.values():
            srv.stop()
        running.clear()


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, server_pool):
    """The module's running ``FerryServer``, started with its ``SERVER_ARGS`` (and
    ``SERVER_ENV``). A module that sets ``SERVER_SHARED = True`` (only requests, no state it
    depends on, no env) gets the session's server of the same args (``server_pool``): modules
    with equal ``SERVER_ARGS`` share one start-up. Any other module gets a server of its own,
    stopped at the module's end (a test that kills, limits or counts on a fresh server)."""
    args = list(getattr(request.module, "SERVER_ARGS", []))
    if getattr(request.module, "SERVER_SHARED", False):
        assert getattr(request.module, "SERVER_ENV", None) is None, "a shared server has no env"
        yield server_pool(args)
        return
    srv = FerryServer(tmp_path_factory.mktemp("ferry"), args,
                      getattr(request.module, "SERVER_ENV", None))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def make_server(tmp_path):
    """A factory of ``FerryServer`` objects (not started) that the test stops at teardown:
    ``make_server(args, env=None, name="srv")``."""
    made: list[FerryServer] = []

    def make(args: list[str], env: dict[str, str] | None = None, name: str = "srv"):
        srv = FerryServer(tmp_path / f"{name}{len(made)}", list(args), env)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


@pytest.fixture(scope="session")
def shared_server(server_pool):
    """One server for the whole session (``SHARED_SERVER_ARGS``), for modules that only send
    requests and leave the server as they found it; saves a start-up per module. A module
    whose ``SERVER_ARGS`` equal these and that sets ``SERVER_SHARED`` gets it as ``server``."""
    return server_pool(SHARED_SERVER_ARGS)


#: the session's shared server; --max-request-bytes (1 MiB) for the 413 tests of
#: test_openai_api.py, above the largest body another module sends (test_logprobs_api.py's
#: 131,073-token detokenize, ~393 kB)
SHARED_SERVER_ARGS = ("--max-total-tokens", "16384", "--max-request-bytes", "1048576")


@pytest.fixture(scope="module")
def url(shared_server):
    """The shared server's base URL (a module with a server of its own defines its own)."""
    return shared_server.url


@pytest.fixture(scope="module")
def client(url):
    """The official ``openai`` client on ``url`` (no retries, the e2e request timeout)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=HTTP_TIMEOUT_S,
                         max_retries=0)


@pytest.fixture(scope="session")
def lora_checkpoints(tmp_path_factory):
    """``(root, models)``: the tiny seeded Llama under ``root/base`` and its peft adapters
    ``root/a1``, ``root/a2`` (tests/engine/lora_helpers.py), written once per session for
    test_lora_api.py and test_lora_path_e2e.py; ``models`` are the transformers + peft models
    of the references (``lora_helpers.references``)."""
    if str(ROOT / "tests" / "engine") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from lora_helpers import save_base_and_two_adapters

    root = tmp_path_factory.mktemp("lora")
    return root, save_base_and_two_adapters(root)


@pytest.fixture(scope="session")
def ref_tokenizer(embedded_tokenizer):
    """The reference HF tokenizer of the embedded model (loaded in the test process, once per
    session: tests/conftest.py)."""
    return embedded_tokenizer
