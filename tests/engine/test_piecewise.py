"""Piecewise runner plumbing on the CPU: the pieces called directly (no graphs) over the
static, padded buffers must give the plain forward's logits, for a prefill and for a mixed
prefill + decode step. On a GPU the same runner replays graphs (tests/engine/test_engine_gpu.py).
"""

from __future__ import annotations

import torch

from engine.args import ServerArgs
from engine.executor.piecewise_runner import PiecewiseRunner, token_buckets
from engine.forward_batch import ForwardMode
from engine.loader.loader import config_dir
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req


def test_token_buckets_cover_every_size():
    b = token_buckets(2304)
    assert b[:3] == [16, 32, 64] and b[-1] == 2304
    assert all(x < y for x, y in zip(b, b[1:]))
    # padding: the next bucket of any T is at most 63 tokens away, and past 512 under 1/8
    for t in range(1, 2305):
        tb = next(x for x in b if x >= t)
        assert tb - t < 64 or tb - t < t / 8, t
    assert token_buckets(40) == [16, 32, 40]


def _runner_and_sched():
    from engine.executor.model_runner import ModelRunner
    from engine.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=config_dir("llama-tiny"), load_format="dummy", device="cpu",
                      dtype="float32", max_total_tokens=4096, chunked_prefill_size=64,
                      max_running_requests=8)
    runner = ModelRunner(args)
    return runner, Scheduler(args, runner)


def _compare(runner, pw, batch):
    # the same batch twice: the KV writes are the same values to the same slots
    ref = runner.forward(batch)
    got = pw.run(batch)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(ref[0], torch.zeros_like(ref[0]))
    return got


def test_piecewise_matches_forward_prefill_and_mixed():
    runner, sched = _runner_and_sched()
    pw = PiecewiseRunner(runner, max_tokens=96, use_graphs=False)
    assert pw.buckets == [16, 32, 64, 96]
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    def prompt(n):
        return torch.randint(0, runner.vocab_size, (n,), generator=g).tolist()

    # a prefill of two prompts (37 tokens: padded to 64)
    sched.add_request(Req("a", prompt(20), sp))
    sched.add_request(Req("b", prompt(17), sp))
    batch = sched.get_next_batch()
    assert batch.mode == ForwardMode.EXTEND and batch.num_tokens == 37
    _compare(runner, pw, batch)
    sched.inflight = sched._launch(batch)  # as Scheduler.step: a and b now decode
    sched._drain()
    # a new prompt mixed with the two decodes: 33 + 2 tokens, decode tail of 2
    sched.add_request(Req("c", prompt(33), sp))
    batch = sched.get_next_batch()
    assert batch.mode == ForwardMode.EXTEND and batch.num_decodes == 2
    assert batch.num_tokens == 35
    _compare(runner, pw, batch)
    # a step larger than the biggest bucket does not go through the runner
    assert not pw.can_run(97) and pw.can_run(96)
