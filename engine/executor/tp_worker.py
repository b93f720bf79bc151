"""Tensor-parallel model workers (ranks 1..N-1): their processes, start-up check and loop.

A worker process (:func:`run_tp_worker`) builds its own ``RankRunner`` (its shard of the
weights, a KV pool of its KV heads, its graphs) and then repeats what rank 0 asks, in order
(:func:`worker_loop`; the messages are in ``engine/executor/tp_messages.py``).

Rank 0's ``ModelRunner`` (``engine/executor/model_runner.py``) checks the group against the
devices and the model (:func:`check_tensor_parallel`), starts the workers of its node
(:func:`start_workers`), watches them (:func:`watch_workers`) and stops them
(:func:`stop_workers`); ``ferry serve --node-rank K`` starts node K's workers the same way.

Failure handling: workers die with their parent (``PR_SET_PDEATHSIG``), and rank 0's
watchdog thread ends its process when a worker exits, so a dead rank never leaves rank 0
blocked inside a collective (the server then answers 503 and exits, see ``server/launch.py``).
"""

from __future__ import annotations

import _thread
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

import torch

from engine import device as dev
from engine import distributed as tpd
from engine.executor.rank_runner import RankRunner
from engine.executor.tp_images import ImageReceiver
from engine.executor.tp_messages import IdsMsg, StepMsg, step_batch
from engine.layers.moe_ep import check_ep

logger = logging.getLogger("ferry.engine")

#: tests: the rank named here fails at start-up (``FERRY_TEST_TP_WORKER_FAIL=1``)
FAIL_ENV = "FERRY_TEST_TP_WORKER_FAIL"
#: after a worker dies, rank 0's main thread gets this long to stop before the process ends
DEATH_GRACE_S = 10.0


def check_tensor_parallel(args, device_type: str) -> None:
    """``--tp-size``/``--nnodes``/``--node-rank`` against each other, this node's devices
    and the model's head counts (and a family's own, its class's ``check_tensor_parallel``:
    Qwen3-Next's linear-attention heads); ``--ep-size`` against the model's experts (a model without
    MoE layers ignores it, with a log line).

    Raises:
        ValueError: naming the flags and numbers that do not fit.
    """
    from engine.loader.loader import load_config
    from engine.models.config import ModelConfig

    per_node = tpd.ranks_per_node(args)
    if dev.is_accelerator(device_type) and dev.visible_device_count(device_type) < per_node:
        raise ValueError(f"--tp-size {args.tp_size} over {args.nnodes} node(s) needs "
                         f"{per_node} {device_type} devices here; "
                         f"{dev.visible_device_count(device_type)} are visible")
    config = load_config(args.model_path)
    mc = ModelConfig.from_hf(config)
    tpd.check_tp_shape(mc.num_heads, mc.num_kv_heads, args.tp_size)
    # a family's own head counts (the Gated DeltaNet layers'): refused before any worker
    check_family = getattr(_model_class(config), "check_tensor_parallel", None)
    if check_family is not None:
        check_family(config, args.tp_size)
    if args.ep_size > 1:
        if mc.num_experts > 0:
            check_ep(mc.num_experts, args.ep_size, args.tp_size)
        else:
            logger.info("--ep-size %d ignored: %s has no MoE layers", args.ep_size,
                        mc.architecture or "the model")


def _model_class(config):
    """The registry's class of ``config``, or None (an unsupported one fails at load)."""
    from engine.models import get_model_class

    try:
        return get_model_class(config)
    except ValueError:
        return None


# ---- a worker process -----------------------------------------------------------------------


def worker_loop(runner, channel) -> None:
    """Serve rank 0's messages (from ``channel``, a ``StepChannel``) until ``StopMsg``."""
    future = None
    images = ImageReceiver()   # the image requests' MMInputs, per req_to_token row
    while True:
        msg = channel.recv()
        if isinstance(msg, StepMsg):
            for row, start, slots in msg.writes:
                runner.req_to_token_pool.write(row, start, slots)
            for slots, sources in msg.commits:  # rank 0 made them right after its verify
                runner.state_pool.commit(slots, sources)
            if msg.snap_copies:  # rank 0's order: before the slots it zeroed since
                runner.state_snapshots.apply(msg.snap_copies)
            if msg.state_resets:
                zero_state_slots(runner.state_pool, msg.state_resets)
            batch = step_batch(msg)
            if msg.mm_reqs:
                images.attach(msg, batch)
            runner.forward(batch, future if msg.has_future else None)
            if msg.pixels:
                images.release(msg)
        elif isinstance(msg, IdsMsg):
            future = torch.empty(msg.n, dtype=torch.int64, device=runner.device)
            tpd.broadcast_tensor(future)
        else:
            return


def zero_state_slots(pool, slots: list[int]) -> None:
    """Zero the recurrent-state ``slots`` of a worker's pool (the ones rank 0 handed to
    requests that start from token 0: its own pool zeroed them when it took them)."""
    idx = torch.tensor(slots, dtype=torch.int64, device=pool.conv_states[0].device)
    for t in (*pool.conv_states, *pool.recurrent_states):
        t.index_fill_(0, idx, 0)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no orphan ranks)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the workers notice the lost peer instead
        pass


def run_tp_worker(args, rank: int) -> None:
    """Entry point of a worker process: load this rank's shard, then follow rank 0.

    Exits with code 1 (logging the error) on any failure, which rank 0's watchdog turns
    into an engine exit, so a broken rank never leaves the others waiting.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    # tqdm's default lock is a multiprocessing semaphore, which a SIGKILLed worker leaks
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(message)s")
    try:
        if os.environ.get(FAIL_ENV) == str(rank):
            raise RuntimeError(f"start-up failure injected by {FAIL_ENV}={rank}")
        dev.set_cpu_threads(dev.cpu_thread_count(args.cpu_threads))
        runner = RankRunner(args, tp_rank=rank)
        worker_loop(runner, runner.tp_channel)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    # stopped by rank 0: exit without tearing down the device group (NCCL's teardown waits
    # for every rank and can hang; the process's exit releases it), except on XPU, whose
    # oneCCL/Level Zero state is released first (engine.device.worker_teardown_at_exit)
    if dev.worker_teardown_at_exit(runner.device_type):
        tpd.destroy_tp(timeout=5.0)
        dev.release_memory(runner.device_type)
    logging.shutdown()
    os._exit(0)


# ---- rank 0 (or a --node-rank K launcher): start, watch and stop the workers ----------------


def start_workers(args, ranks: list[int]) -> list[multiprocessing.Process]:
    """Spawn one model-worker process per rank in ``ranks`` (``spawn`` start method).

    ``args.dist_init_addr`` must be set (every rank meets there).
    """
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for r in ranks:
        p = ctx.Process(target=run_tp_worker, args=(args, r), name=f"ferry-tp{r}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def watch_workers(procs: list[multiprocessing.Process], on_death=None) -> threading.Event:
    """Watch ``procs`` from a daemon thread; when one exits, log it and end this process
    (exit code 1), since rank 0 may be blocked in a collective with the dead rank.

    Returns the event that stands the watchdog down (set it before stopping the workers).
    ``on_death(name, exitcode)`` replaces the default (tests)."""
    stand_down = threading.Event()

    def loop():
        while not stand_down.is_set():
            for p in procs:
                if not p.is_alive() and not stand_down.is_set():
                    if on_death is not None:
                        on_death(p.name, p.exitcode)
                        return
                    logger.error("tensor-parallel worker %s exited with code %s; the engine "
                                 "stops", p.name, p.exitcode)
                    _thread.interrupt_main()  # a main thread inside a collective may not see
                    if not stand_down.wait(DEATH_GRACE_S):  # it: then end the process
                        logging.shutdown()
                        os._exit(1)
                    return
            stand_down.wait(0.2)

    threading.Thread(target=loop, name="ferry-tp-watch", daemon=True).start()
    return stand_down


def stop_workers(procs: list[multiprocessing.Process], timeout: float = 5.0) -> None:
    """Wait up to ``timeout`` seconds for the workers to exit, then SIGKILL the rest."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
