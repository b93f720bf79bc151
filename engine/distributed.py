"""Tensor parallelism over torch.distributed: process groups, collectives, the step channel.

Layout (one scheduler, dumb workers): rank 0 lives in the engine process (or the offline
``LLM``) and owns the only scheduler, KV allocator, radix cache, grammar matchers and sampler.
Ranks 1..N-1 are model workers (:mod:`engine.executor.tp_worker`): each holds 1/N of the
weights and of the KV heads, and repeats every forward that rank 0 runs. Rank 0 broadcasts
each step's host-side batch (token ids, positions, KV slots, ``req_to_token`` writes) over a
gloo group before running it; all ranks then run the same forward, whose collectives
(all-reduce after the row-parallel layers, all-gather of the vocab-parallel logits) keep them
in lockstep; rank 0 samples and broadcasts the sampled ids on the device group, which the
workers need for the next step's placeholders (overlap scheduling). Why not one scheduler per
rank (SGLang's layout): every rank would have to take the same scheduling decisions, but
ferry's scheduler reads clocks (LPM's wait limit), a thread pool (grammar compilation) and the
arrival time of aborts, so the ranks would drift; broadcasting the decisions costs one
small gloo message per step and keeps the workers free of any scheduling state.

Backends come from :func:`engine.device.dist_backend` (nccl on CUDA, xccl on XPU, gloo on the
CPU); no other module names one. With ``tp_size == 1`` nothing here initialises anything and
every collective is a no-op, so single-device runs pay nothing.

This module holds the primitives only; the worker processes (their entry point and loop,
rank 0's start-up check, start, watchdog and stop) are ``engine/executor/tp_worker.py``,
which builds the workers' model runners, and the messages are
``engine/executor/tp_messages.py``.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine import device as devmod

logger = logging.getLogger("ferry.engine")

#: the gloo group that carries step broadcasts waits this long for rank 0 (an idle server)
IDLE_TIMEOUT = datetime.timedelta(days=365)
#: collectives of a step on the device group
STEP_TIMEOUT = datetime.timedelta(minutes=10)
#: a worker connects its step channel within this time after start-up
CONNECT_TIMEOUT_MS = 120_000


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group.

    Attributes:
        size: ranks (1: no tensor parallelism).
        rank: this process's rank (0 runs the scheduler).
        backend: the device group's backend (``nccl``, ``xccl``, ``gloo``), or ``none``.
        device_group: the group of the step collectives (on the device).
        cpu_group: a gloo group for host objects (step broadcasts, memory reports).
    """

    size: int = 1
    rank: int = 0
    backend: str = "none"
    device_group: Any = None
    cpu_group: Any = None


_TP = TPGroup()


def get_tp() -> TPGroup:
    """The current tensor-parallel group (size 1 when none was initialised)."""
    return _TP


def check_tp_shape(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Refuse head counts that do not split over ``tp_size`` ranks.

    Query heads must divide; KV heads must divide, or (fewer KV heads than ranks) divide
    ``tp_size`` so that each KV head is replicated on ``tp_size / num_kv_heads`` ranks, as
    SGLang and vLLM do.

    Raises:
        ValueError: naming both numbers.
    """
    if tp_size <= 1:
        return
    if num_heads % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the model's {num_heads} "
                         "attention heads")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the model's {num_kv_heads} "
                         "KV heads")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"the model's {num_kv_heads} KV heads cannot be replicated evenly "
                         f"over --tp-size {tp_size} ranks")


def ranks_per_node(args) -> int:
    """Ranks on each node (``tp_size / nnodes``).

    Raises:
        ValueError: ``tp_size`` is not a multiple of ``nnodes``, or ``node_rank`` is out of range.
    """
    if args.tp_size % args.nnodes:
        raise ValueError(f"--tp-size {args.tp_size} is not a multiple of --nnodes {args.nnodes}")
    if args.node_rank >= args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (rank 0's address)")
    return args.tp_size // args.nnodes


def free_local_addr() -> str:
    """``127.0.0.1:port`` with a port that was free a moment ago (single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def init_tp(tp_size: int, rank: int, init_addr: str, device_type: str) -> TPGroup:
    """Join the tensor-parallel group (blocks until all ``tp_size`` ranks have joined).

    Args:
        tp_size: ranks in the group.
        rank: this process's rank.
        init_addr: ``host:port`` of the TCP rendezvous (rank 0 listens there).
        device_type: ``cuda``, ``xpu`` or ``cpu`` (picks the backend; set the device first).
    Returns:
        the group, also available from :func:`get_tp`.
    """
    global _TP
    if tp_size <= 1:
        _TP = TPGroup()
        return _TP
    backend = devmod.dist_backend(device_type)
    host, _, port = init_addr.rpartition(":")
    t0 = time.perf_counter()
    dist.init_process_group(backend=backend, init_method=f"tcp://{host}:{port}",
                            world_size=tp_size, rank=rank, timeout=STEP_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _TP = TPGroup(tp_size, rank, backend, dist.group.WORLD, cpu_group)
    # the first collective creates the communicator: do it now, not inside a graph capture
    x = torch.ones(1, device=device_type)
    all_reduce(x)
    devmod.synchronize(device_type)
    if int(x.item()) != tp_size:
        raise RuntimeError(f"tensor-parallel self-test failed: all-reduce of ones gave "
                           f"{x.item()}, expected {tp_size}")
    logger.info("tensor parallel: rank %d of %d joined (%s) in %.1f s", rank, tp_size, backend,
                time.perf_counter() - t0)
    return _TP


# ---- collectives (no-ops at size 1; graph-capturable on NCCL) -------------------------------


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``."""
    if _TP.size > 1:
        dist.all_reduce(x, group=_TP.device_group)
    return x


_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, n] on each rank -> [B, size * n], rank r's part at columns ``[r*n, (r+1)*n)``."""
    if _TP.size == 1:
        return x
    b, n = x.shape
    out = torch.empty((_TP.size * b, n), dtype=x.dtype, device=x.device)
    _gather(out, x.contiguous(), group=_TP.device_group)
    return out.view(_TP.size, b, n).permute(1, 0, 2).reshape(b, _TP.size * n)


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype), on the device group."""
    if _TP.size > 1:
        dist.broadcast(x, src=0, group=_TP.device_group)
    return x


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's picklable ``obj`` to every rank over the gloo group; returns it."""
    if _TP.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_TP.cpu_group)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if _TP.size == 1:
        return [obj]
    out: list[Any] = [None] * _TP.size
    dist.all_gather_object(out, obj, group=_TP.cpu_group)
    return out


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` over the ranks (e.g. the KV capacity every rank can hold)."""
    if _TP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP.cpu_group)
    return int(t.item())


# ---- the step channel -----------------------------------------------------------------------


class StepChannel:
    """Rank 0 -> every other rank: ordered one-way messages over ZMQ PUSH/PULL on TCP.

    Rank 0 binds one PUSH socket per worker on the host of ``--dist-init-addr`` and sends the
    ports over the gloo group once; each worker connects a PULL socket to its port. Messages
    are msgspec structs (``types``: the union a worker decodes). Sending never blocks rank
    0 (unbounded queues). A worker's ``recv`` raises ``ConnectionError`` when rank 0's
    connection closes (its process died), so a worker on another node does not wait forever.
    """

    def __init__(self, group: TPGroup, host: str, types):
        import msgspec
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(types)
        self._socks = []
        ip = socket.gethostbyname(host)
        if group.rank == 0:
            ports = [0]
            for _ in range(1, group.size):
                s = self._ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.SNDHWM, 0)
                s.setsockopt(zmq.LINGER, 2000)
                ports.append(s.bind_to_random_port(f"tcp://{ip}"))
                self._socks.append(s)
            broadcast_object(ports)
            for r, s in enumerate(self._socks, start=1):  # writable once its worker connected
                if not s.poll(CONNECT_TIMEOUT_MS, zmq.POLLOUT):
                    raise RuntimeError(f"tensor-parallel rank {r} did not connect to the step "
                                       f"channel within {CONNECT_TIMEOUT_MS / 1000:.0f} s")
            return
        ports = broadcast_object(None)
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(f"tcp://{ip}:{ports[group.rank]}")
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def close(self, linger_ms: int = 1000) -> None:
        """Close the sockets (waiting up to ``linger_ms`` for queued messages to leave) and
        the ZMQ context; an open context would block the interpreter's exit."""
        self._ctx.destroy(linger=linger_ms)

    def send(self, msg) -> None:
        """Rank 0: queue ``msg`` for every worker (never blocks).

        Raises:
            ConnectionError: a worker's connection is gone.
        """
        data = self._enc.encode(msg)
        for r, s in enumerate(self._socks, start=1):
            try:  # a PUSH socket without its peer would block forever
                s.send(data, copy=False, flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                raise ConnectionError(f"tensor-parallel rank {r} is gone (its step channel "
                                      "has no reader)") from None

    def recv(self):
        """A worker: the next message (blocks).

        Raises:
            ConnectionError: rank 0 closed the connection.
        """
        while True:
            ready = dict(self._poller.poll())
            if self._sock in ready:
                return self._dec.decode(self._sock.recv())
            if self._monitor in ready:
                self._monitor.recv_multipart()
                raise ConnectionError("rank 0 closed the step channel (its process ended)")


# ---- leaving the group ----------------------------------------------------------------------


def destroy_tp(timeout: float = 30.0) -> None:
    """Leave the group (rank 0 after the workers have exited; an XPU worker before it exits).

    gloo groups (the CPU) are destroyed, so a process can build another tensor-parallel
    engine (the tests do), and so are XCCL groups, whose leftover oneCCL state can hang the
    next start (``engine.device.teardown_group_at_exit``). NCCL groups are left to the
    process's exit: on the H200s both their orderly teardown and an abort waited for the
    exited ranks (more than 10 s, then the waiting thread ended the process at exit), so
    one CUDA engine per process. A teardown that does not end within ``timeout`` seconds is
    logged and left behind."""
    global _TP
    if _TP.size > 1 and dist.is_initialized() and devmod.teardown_group_at_exit(_TP.backend):
        t = threading.Thread(target=dist.destroy_process_group, name="ferry-tp-destroy",
                             daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            logger.warning("tensor parallel: the process group did not shut down within "
                           "%.0f s", timeout)
    _TP = TPGroup()
