"""Tensor-parallel model workers (ranks 1..N-1) and the step messages rank 0 sends them.

A worker builds its own ``ModelRunner`` (its shard of the weights, a KV pool of its KV heads,
its graphs) and then repeats what rank 0 asks, in order. The messages travel over a ZMQ
PUSH/PULL channel per worker (``engine.distributed.StepChannel``, msgspec-encoded; rank 0
never waits for a worker to read them; a gloo broadcast per step, tried first, cost rank 0
about 1.5 ms per step on the H200s):

- ``StepMsg``: run this forward (the batch's host lists: per request its ``req_to_token`` row
  and the new token ids, which may be placeholders for the previous step's sampled ids; the
  prefix and extend lengths; the KV slots; the ``req_to_token`` writes rank 0 made since the
  last step, for cached prefixes);
- ``IdsMsg(n)``: receive rank 0's ``n`` sampled ids on the device group (they resolve the
  next step's placeholders);
- ``StopMsg``: exit.

Rank 0 sends them from ``ModelRunner.forward`` and ``ModelRunner.sample`` (see
``engine/executor/model_runner.py``), so every caller of the runner (the scheduler, the
benchmarks, ``ferry parity``) drives the workers without knowing they exist.
"""

from __future__ import annotations

import logging
import os
import sys

import msgspec
import torch

logger = logging.getLogger("ferry.engine")

#: tests: the rank named here fails at start-up (``FERRY_TEST_TP_WORKER_FAIL=1``)
FAIL_ENV = "FERRY_TEST_TP_WORKER_FAIL"


class StepMsg(msgspec.Struct, tag=True, array_like=True):
    """One forward, as rank 0 scheduled it (host lists only)."""

    mode: int
    rows: list[int]              # req_to_token row of each request
    tokens: list[list[int]]      # each request's new token ids (negative: placeholders)
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: list[int]
    num_decodes: int
    all_rows: list[bool]
    has_future: bool             # placeholders refer to the last ids broadcast
    writes: list[tuple[int, int, list[int]]]  # req_to_token writes (row, start, slots)


class IdsMsg(msgspec.Struct, tag=True, array_like=True):
    """Rank 0 broadcasts ``n`` sampled ids on the device group next."""

    n: int


class StopMsg(msgspec.Struct, tag=True, array_like=True):
    """Leave the group and exit."""


TPMessage = StepMsg | IdsMsg | StopMsg


def step_msg(batch, has_future: bool, writes) -> StepMsg:
    """The ``StepMsg`` of a ``ScheduleBatch`` about to run on rank 0."""
    return StepMsg(int(batch.mode), [r.req_pool_idx for r in batch.reqs],
                   [r.tokens(p, n) for r, p, n in zip(batch.reqs, batch.prefix_lens,
                                                        batch.extend_lens)],
                   list(batch.prefix_lens), list(batch.extend_lens), list(batch.out_cache_loc),
                   batch.num_decodes, list(batch.all_rows), has_future, writes)


class _StepReq:
    """What the runners read of a ``Req``: its row and the ids of the step's new tokens."""

    __slots__ = ("req_pool_idx", "_start", "_ids")

    def __init__(self, row: int, start: int, ids: list[int]):
        self.req_pool_idx = row
        self._start = start
        self._ids = ids

    def tokens(self, start: int, count: int) -> list[int]:
        return self._ids[start - self._start: start - self._start + count]

    def token_at(self, pos: int) -> int:
        return self._ids[pos - self._start]


def step_batch(msg: StepMsg):
    """A ``ScheduleBatch`` equivalent to rank 0's, built from ``msg``."""
    from engine.forward_batch import ForwardMode
    from engine.scheduler.schedule_batch import ScheduleBatch

    reqs = [_StepReq(r, p, ids) for r, p, ids in zip(msg.rows, msg.prefix_lens, msg.tokens)]
    return ScheduleBatch(mode=ForwardMode(msg.mode), reqs=reqs, prefix_lens=msg.prefix_lens,
                         extend_lens=msg.extend_lens, sample=[True] * len(reqs),
                         out_cache_loc=msg.out_cache_loc, all_rows=msg.all_rows,
                         num_decodes=msg.num_decodes)


def worker_loop(runner, channel) -> None:
    """Serve rank 0's messages (from ``channel``, a ``StepChannel``) until ``StopMsg``."""
    from engine import distributed as tpd

    future = None
    while True:
        msg = channel.recv()
        if isinstance(msg, StepMsg):
            for row, start, slots in msg.writes:
                runner.req_to_token_pool.write(row, start, slots)
            runner.forward(step_batch(msg), future if msg.has_future else None)
        elif isinstance(msg, IdsMsg):
            future = torch.empty(msg.n, dtype=torch.int64, device=runner.device)
            tpd.broadcast_tensor(future)
        else:
            return


def run_tp_worker(args, rank: int) -> None:
    """Entry point of a worker process: load this rank's shard, then follow rank 0.

    Exits with code 1 (logging the error) on any failure, which rank 0's watchdog turns
    into an engine exit, so a broken rank never leaves the others waiting.
    """
    import signal

    from engine import device as dev
    from engine import distributed as tpd

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tpd.die_with_parent()
    # tqdm's default lock is a multiprocessing semaphore, which a SIGKILLed worker leaks
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(message)s")
    try:
        from engine.executor.model_runner import ModelRunner

        if os.environ.get(FAIL_ENV) == str(rank):
            raise RuntimeError(f"start-up failure injected by {FAIL_ENV}={rank}")
        dev.set_cpu_threads(dev.cpu_thread_count(args.cpu_threads))
        runner = ModelRunner(args, tp_rank=rank)
        worker_loop(runner, runner.tp_channel)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    # stopped by rank 0: exit without tearing down the device group (NCCL's teardown waits
    # for every rank and can hang; the process's exit releases it)
    logging.shutdown()
    os._exit(0)
