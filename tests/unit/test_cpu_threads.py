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
