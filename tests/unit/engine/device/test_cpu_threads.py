"""--cpu-threads: the engine's intra-op thread count and where its default comes from."""

import os

import pytest
import torch

from engine import device as dev
from engine.args import ServerArgs


def test_thread_count_rule(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert dev.cpu_thread_count(3) == 3                       # the flag wins
    assert dev.cpu_thread_count(None) == len(os.sched_getaffinity(0))  # the usable cores
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert dev.cpu_thread_count(None) == 1                    # an explicit env var next
    assert dev.cpu_thread_count(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert dev.cpu_thread_count(None) == len(os.sched_getaffinity(0))


def test_flag_bounds_and_effect():
    with pytest.raises(ValueError, match="--cpu-threads"):
        ServerArgs(cpu_threads=0)
    before = torch.get_num_threads()
    try:
        dev.set_cpu_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_children_get_a_passive_openmp_policy(monkeypatch):
    from server.launch import passive_openmp_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    passive_openmp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a user's choice is kept
    passive_openmp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


_MMAPPED_BLOCKS = """
import ctypes, os, sys
from engine import device as dev

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
print("tuned" if dev.tune_cpu_malloc() else "untouched")
before = libc.mallinfo2().hblks
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(4 << 20)   # 4 MiB: above glibc's initial 128 KiB mmap threshold
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6")
                    and not os.path.exists("/lib/aarch64-linux-gnu/libc.so.6"),
                    reason="glibc only")
@pytest.mark.parametrize("env,expect", [({}, ("tuned", "0")),
                                        ({"FERRY_CPU_MALLOC": "default"}, ("untouched", "1"))])
def test_cpu_malloc_keeps_activation_blocks_in_the_heap(env, expect):
    """In a fresh process, a 4 MiB block is mmapped by glibc's defaults (and unmapped, then
    page-faulted again, every step); after ``tune_cpu_malloc`` it comes from the heap."""
    import subprocess
    import sys

    full = {k: v for k, v in os.environ.items() if k != "FERRY_CPU_MALLOC"} | env
    out = subprocess.run([sys.executable, "-c", _MMAPPED_BLOCKS], capture_output=True,
                         text=True, env=full, check=True, timeout=120).stdout.split()
    assert tuple(out[-2:]) == expect
