"""``ModelRunner``: the model runner of rank 0, the one the scheduler, ``LLM`` and the
benchmarks build.

It is a ``RankRunner`` (``engine/executor/rank_runner.py``: model, KV pool, attention
backend, forward and sampling on one device) that, with ``--tp-size N``, also starts the
worker processes of ranks 1..N-1 on its node before joining the group, watches them, and
stops them at shutdown (``engine/executor/tp_worker.py``). The workers build a plain
``RankRunner``, so the worker's entry point sits between the two classes and no import runs
in a circle.
"""

from __future__ import annotations

import atexit

from engine import distributed as tpd
from engine.args import ServerArgs
from engine.executor.pooling import pool_step
from engine.executor.rank_runner import RankRunner
from engine.executor.tp_messages import StopMsg
from engine.executor.tp_worker import (
    check_tensor_parallel,
    start_workers,
    stop_workers,
    watch_workers,
)


class ModelRunner(RankRunner):
    """Rank 0's runner (and the only one without tensor parallelism).

    With ``--tp-size N`` it spawns the workers of ranks 1..N-1 on its node before joining
    the group, sends them every forward and every sampled batch (as any ``RankRunner`` that
    leads a group does) and stops them at :meth:`shutdown`; a worker's runner is a plain
    ``RankRunner`` that holds its shard and never samples.
    """

    def __init__(self, args: ServerArgs, tp_rank: int = 0):
        self.tp_workers: list = []
        self._tp_watch = None
        super().__init__(args, tp_rank)

    def pool(self, batch, logits) -> list[tuple[object, list]]:
        """A pooling engine's step answers (:func:`engine.executor.pooling.pool_step`)."""
        return pool_step(self.model, batch, logits)

    # ---- the workers' processes ---------------------------------------------------------
    def _start_workers(self, args: ServerArgs, ranks: list[int]) -> None:
        # devices and head counts, before any rank starts (ferry serve checked them
        # already; the offline LLM and the benchmarks come straight here)
        check_tensor_parallel(args, self.device_type)
        self.tp_workers = start_workers(args, ranks)
        self._tp_watch = watch_workers(self.tp_workers)
        atexit.register(self.shutdown)  # before multiprocessing joins its children

    def _stop_workers(self, timeout: float) -> None:
        stop_workers(self.tp_workers, timeout=timeout)
        self.tp_workers = []

    def _abort_tp(self) -> None:
        """Rank 0 failed to build: stop the workers it spawned and leave the group."""
        if self._tp_watch is not None:
            self._tp_watch.set()
        super()._abort_tp()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (they exit on ``StopMsg``; stragglers are killed
        after 10 s) and leave the group. Idempotent; rank 0 also runs it at exit."""
        if not self.tp_leader:
            return
        self.tp_leader = False
        atexit.unregister(self.shutdown)  # the registry held the runner (and its memory)
        if self._tp_watch is not None:
            self._tp_watch.set()
        try:
            self.tp_channel.send(StopMsg())
        except ConnectionError:
            pass  # a worker already gone: the others are stopped below
        finally:
            self.tp_channel.close()
            self._stop_workers(timeout=10.0)
            tpd.destroy_tp(timeout=10.0)
