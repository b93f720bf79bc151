"""Session fixtures that several test folders share: expensive builds made once per run.

Each one was built again by every module that needed it (the HF model of the embedded GGUF
took ~20-40 s per build on the 2-core CI machine); the fixtures hand out the same object, so
a test must not change it (they only read: forward passes, ``state_dict``, ``config``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path


def _share_cores_among_xdist_workers() -> None:
    """On a pytest-xdist worker (``make test``: ``-n 2`` on the 2-core CI machine), give torch
    ``cores // workers`` intra-op threads (at least one), through ``$OMP_NUM_THREADS`` so the
    engine (``cpu_thread_count``) and every process a test starts inherit it, unless it is
    set already. Left at torch's default (every core), the workers' OpenMP teams spin against
    each other: a test of test_generate.py took 178 s with two workers of two threads each
    and 8 s with one thread each (2026-12-04)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not workers.isdigit() or int(workers) < 1 or os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    threads = max(1, cores // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # a plugin imported it first: its thread pool is sized already
        sys.modules["torch"].set_num_threads(threads)


_share_cores_among_xdist_workers()

import pytest  # noqa: E402
import transformers.utils.logging as _hf_logging  # noqa: E402

# transformers binds its log handler to the sys.stderr of its first log call; under a test's
# capsys that stream is closed once the test ends, and every later transformers warning in the
# run then prints "--- Logging error ---" (which tests that check a command's stderr see).
# Configure it now, on the session's stderr.
_hf_logging.get_logger("transformers")

_ENGINE_TESTS = str(Path(__file__).resolve().parent / "engine")  # lora_helpers, moe_helpers
_E2E_TESTS = "tests/e2e/"

#: the session fixtures that cost most to build (tens of seconds each on the CI machine)
_ONCE_FIXTURES = ("hf_embedded_model", "hf_embedded_tokenizer", "embedded_llm")
#: an e2e module that asks for a server of the session's pool (tests/e2e/conftest.py): the
#: pool's fixtures by name, or a test or fixture that takes the pool's ``url`` or ``client``
_USES_POOL = re.compile(r"shared_server|SERVER_SHARED|server_pool|"
                        r"def \w+\((?:[^)]*,\s*)?(?:url|client)\s*[,)]")


#: the e2e modules with servers of their own that take longest, longest first (measured one
#: module at a time, 2026-12-03: 70-190 s each on the 2-core machine at a load of 5-15; a
#: start-up is ~15-20 s there when quiet, and these start several, fuzz or run a minute of
#: load): run after the shared servers' modules and before the others, so that the two
#: workers end together (``_e2e_order``)
_E2E_LONGEST = ("test_schemathesis.py", "test_lora_api.py", "test_tensor_parallel_lifecycle.py",
                "test_data_parallel.py", "test_pooling_api.py", "test_router.py",
                "test_lora_path_e2e.py", "test_limits_and_shutdown.py", "test_soak.py")


def pytest_collection_modifyitems(session, config, items):
    """tests/e2e in the order its xdist units are best handed out (``_e2e_order``); the
    tests of each module, and every test outside tests/e2e, keep their order."""
    rank: dict[str, tuple[int, int]] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module not in rank:
            rank[module] = _e2e_order(config.rootpath, module, len(rank))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


def _e2e_order(root: Path, module: str, seen: int) -> tuple[int, int]:
    """The sort key of ``module`` (``seen``: its place in collection order): the e2e modules
    on the shared servers first (one xdist unit, the longest), then ``_E2E_LONGEST`` in its
    order, then the other e2e modules; every module outside tests/e2e before them all, as
    collected (a run names tests/e2e alone or leaves it out)."""
    if not module.startswith(_E2E_TESTS):
        return (0, seen)
    if _work_unit(root, module) == "e2e-pool":
        return (1, seen)
    name = module.rsplit("/", 1)[-1]
    if name in _E2E_LONGEST:
        return (2, _E2E_LONGEST.index(name))
    return (3, seen)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs the tests outside tests/e2e with ``pytest -n 2 --dist loadfile``
    (pytest-xdist); this scheduler sends whole work units to a worker, in collection order:
    each test module (its module fixtures built once, its tests in order), the e2e modules
    that use the servers of ``server_pool`` as one unit (each of those servers starts once),
    and the modules that use a fixture of ``_ONCE_FIXTURES`` as one unit (each is built
    once). Other ``--dist`` modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Units(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # collection order: the long units first
            self._unit_of: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in self._unit_of:
                self._unit_of[module] = _work_unit(config.rootpath, module)
            return self._unit_of[module]

    return _Units(config, log)


def _work_unit(root: Path, module: str) -> str:
    """The xdist work unit of the test module ``module`` (a path under ``root``)."""
    try:
        text = (root / module).read_text()
    except OSError:
        return module
    if module.startswith(_E2E_TESTS):
        return "e2e-pool" if _USES_POOL.search(text) else module
    return "hf-embedded" if any(name in text for name in _ONCE_FIXTURES) else module


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The HF tokenizer of the embedded SmolLM2 GGUF (``load_tokenizer(None)``), loaded once
    for the dozen modules that read it (tokenize, decode, apply the chat template)."""
    from engine.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def hf_embedded_tokenizer():
    """HF transformers' own conversion of the embedded GGUF's tokenizer
    (``AutoTokenizer.from_pretrained(gguf_file=)``, the slow path ferry's cache avoids): the
    reference of tests/unit/engine/loader/test_loader.py and the tokenizer saved beside the
    embedded model in tests/engine/test_lora.py."""
    from transformers import AutoTokenizer

    from engine.loader.loader import resolve_model_path

    src = resolve_model_path(None)
    return AutoTokenizer.from_pretrained(src.root, gguf_file=src.gguf_file)


@pytest.fixture(scope="session")
def hf_embedded_model():
    """HF transformers' model of the embedded SmolLM2 GGUF (dequantized by transformers), fp32,
    on the CPU, in eval mode: the reference of tests/engine/test_generate.py,
    tests/engine/test_lora.py and tests/unit/engine/loader/test_loader.py."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.loader.loader import resolve_model_path

    src = resolve_model_path(None)
    model = AutoModelForCausalLM.from_pretrained(src.root, gguf_file=src.gguf_file,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory):
    """``make(case) -> (path, hf_model)``: the tiny seeded HF MoE model of ``case``
    (tests/engine/moe_helpers.py ``CASES``) saved under ``path``, written once per session
    for tests/engine/test_moe_models.py and tests/e2e/test_moe_serve.py; a test reads the
    folder and runs the model, never writes either."""
    if _ENGINE_TESTS not in sys.path:
        sys.path.insert(0, _ENGINE_TESTS)
    made: dict[str, tuple] = {}

    def make(case: str):
        if case not in made:
            from moe_helpers import save_tiny

            path = tmp_path_factory.mktemp(case)
            made[case] = (path, save_tiny(case, path))
        return made[case]

    return make
