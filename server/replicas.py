"""Engine replicas behind the one front end (``--dp-size N``) and how a request picks one.

Each replica is an engine process (with its tensor-parallel ranks) and its own detokenizer,
on IPC paths of its own; the ``TokenizerManager`` keeps one PUSH and one PULL socket per
replica and remembers which replica each rid went to (its outputs come back on that
replica's socket; its abort goes there). Its member ``ReplicaRouter`` does that bookkeeping
and sends the control requests (server info, flush cache, LoRA load/unload) to one replica
or to every live one.

``Dispatcher`` picks the replica of a generation request from its token ids
(``--load-balance-method``):

- ``prefix_affinity`` (default): the prompt is cut into blocks of ``BLOCK`` tokens, each
  keyed by a hash of the whole prefix up to its end (so one key names one prefix). Each
  replica keeps the keys of the prompts recently sent to it (LRU, ``MAX_BLOCKS`` each): an
  approximate index of what its radix cache holds. The request goes to the replica with the
  longest run of leading keys, unless that replica is much busier than the least loaded one
  (more than ``--dp-balance-abs-threshold`` requests in flight beyond it *and* more than
  ``--dp-balance-rel-threshold`` times as many, sglang-router's rule for its cache-aware
  policy), or no replica holds its first block; then it goes to the least loaded one (ties:
  the lowest index). Either way its keys are recorded for the chosen replica.
- ``round_robin``: the next live replica in turn.
- ``shortest_queue``: the fewest requests in flight (ties: the lowest index).

A dead replica is skipped and its index dropped.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from engine import io_struct as io
from server.http.errors import unavailable

#: tokens per prefix block (a prompt shorter than one block has no affinity)
BLOCK = 16
#: prefix blocks remembered per replica (LRU), about 1M tokens of prompts
MAX_BLOCKS = 65536
#: seconds an engine may take to answer a control request (server info, flush cache)
SERVER_INFO_TIMEOUT_S = 5.0
#: seconds an engine may take to read a LoRA adapter's files and answer
LORA_TIMEOUT_S = 120.0


def prefix_keys(ids: list[int], block: int = BLOCK) -> list[int]:
    """One key per whole block of ``ids``, each a hash of the prefix up to the block's end."""
    keys, h = [], 0
    for end in range(block, len(ids) + 1, block):
        h = hash((h, tuple(ids[end - block:end])))
        keys.append(h)
    return keys


@dataclass
class Replica:
    """One engine replica as the front end sees it."""

    index: int
    push: object                      # PushSocket to its engine
    pull: object = None               # AsyncPullSocket its engine and detokenizer push to
    ready: dict = field(default_factory=dict)   # child name -> ReadyOut
    dead: str | None = None           # why it is gone
    inflight: int = 0                 # its engine requests the server waits on
    info: object = None               # its last ServerInfoOut or StatsOut (the gauges)
    figures: object = None            # its last ServerInfoOut (/server_info's replicas list)

    @property
    def alive(self) -> bool:
        return self.dead is None


class Dispatcher:
    """Chooses a replica per request (see the module docstring).

    Args:
        n: the number of replicas.
        method: ``prefix_affinity``, ``round_robin`` or ``shortest_queue``.
        abs_threshold, rel_threshold: the imbalance that overrides prefix affinity.
        max_blocks: prefix keys remembered per replica.
    """

    def __init__(self, n: int, method: str = "prefix_affinity", abs_threshold: int = 8,
                 rel_threshold: float = 1.5, max_blocks: int = MAX_BLOCKS,
                 block: int = BLOCK):
        self.method = method
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        self.max_blocks, self.block = max_blocks, block
        self.index: list[OrderedDict] = [OrderedDict() for _ in range(n)]
        self._next = 0

    def choose(self, ids: list[int], loads: list[int | None]) -> int:
        """The replica for a prompt of ``ids``; ``loads[i]``: replica i's requests in flight,
        None when it is dead. Records the prompt's prefix for the chosen one.

        Raises:
            LookupError: every replica is dead.
        """
        live = [i for i, x in enumerate(loads) if x is not None]
        if not live:
            raise LookupError("no live replica")
        least = min(live, key=lambda i: (loads[i], i))
        if self.method == "round_robin":
            n = len(loads)
            pick = next(i % n for i in range(self._next, self._next + n)
                        if loads[i % n] is not None)
            self._next = pick + 1
            return pick
        if self.method == "shortest_queue":
            return least
        keys = prefix_keys(ids, self.block)
        pick = least
        best = max(live, key=lambda i: (self.matched(i, keys), -loads[i], -i))
        if self.matched(best, keys) > 0 and not self._imbalanced(loads[best], loads[least]):
            pick = best
        self.record(pick, keys)
        return pick

    def _imbalanced(self, load: int, least: int) -> bool:
        return load - least > self.abs_threshold and load > least * self.rel_threshold

    def matched(self, i: int, keys: list[int]) -> int:
        """Leading blocks of ``keys`` in replica ``i``'s index."""
        idx, n = self.index[i], 0
        for k in keys:
            if k not in idx:
                break
            n += 1
        return n

    def record(self, i: int, keys: list[int]) -> None:
        idx = self.index[i]
        for k in keys:
            idx[k] = None
            idx.move_to_end(k)
        while len(idx) > self.max_blocks:
            idx.popitem(last=False)

    def forget(self, i: int) -> None:
        """Drop replica ``i``'s index (it died)."""
        self.index[i].clear()


def summed_info(infos: list) -> io.ServerInfoOut:
    """The replicas' ``ServerInfoOut``s added up (the speculative and TP details of the
    first; ``stats`` counters summed where numeric)."""
    first = infos[0]
    total = {f: sum(getattr(x, f) for x in infos) for f in _INFO_SUMS}
    stats: dict = {}
    for x in infos:
        for k, v in x.stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                stats[k] = stats.get(k, 0) + v
    return io.ServerInfoOut(rid=first.rid, stats=stats, tensor_parallel=first.tensor_parallel,
                            speculative=first.speculative, **total)


_INFO_SUMS = ("kv_used_tokens", "kv_free_tokens", "kv_total_tokens", "num_running",
              "num_waiting", "cached_tokens", "evictable_tokens")


def summed_stats(replicas: list[Replica]) -> io.StatsOut:
    """The live replicas' last figures as one ``StatsOut`` for the server's gauges (KV usage
    weighted by each replica's pool size)."""
    running = waiting = 0
    used = total = 0.0
    for r in replicas:
        x = r.info
        if x is None or not r.alive:
            continue
        running, waiting = running + x.num_running, waiting + x.num_waiting
        ready = r.ready.get("engine")
        size = float(ready.max_total_tokens if ready else 1) or 1.0
        usage = getattr(x, "kv_usage", None)
        if usage is None:
            usage = x.kv_used_tokens / x.kv_total_tokens if x.kv_total_tokens else 0.0
        used, total = used + usage * size, total + size
    return io.StatsOut(num_running=running, num_waiting=waiting,
                       kv_usage=used / total if total else 0.0)


class ReplicaRouter:
    """The replica side of ``TokenizerManager`` (one of its members): which replica an engine
    request goes to and its load, a replica's death, and the control requests to one
    replica or to every replica (server info, flush cache, LoRA load/unload).

    Args:
        replicas: the engine replicas (replica 0 first).
        dispatcher: picks the replica of a generation request.
        dead: why the whole engine side is gone (None while it runs), asked before each
            control request.
    """

    def __init__(self, replicas: list[Replica], dispatcher: Dispatcher,
                 dead: Callable[[], str | None] = lambda: None):
        self.replicas = replicas
        self.dispatcher = dispatcher
        self.owner: dict[str, int] = {}  # rid -> its replica
        self.info_waiters: dict[str, asyncio.Future] = {}  # control rid -> its answer
        self._dead = dead

    def gauge_stats(self, msg, replica: int):
        """The figures the server's gauges show after replica ``replica`` reported ``msg``
        (a ``StatsOut`` or ``ServerInfoOut``): ``msg`` itself, or with several replicas
        the live ones' sum."""
        if len(self.replicas) > 1:
            self.replicas[replica].info = msg
            msg = summed_stats(self.replicas)
        return msg

    def release(self, rid: str) -> None:
        """The engine request ``rid`` no longer counts toward its replica's load."""
        i = self.owner.pop(rid, None)
        if i is not None:
            self.replicas[i].inflight -= 1

    def push_for(self, rid: str, ids: list[int]):
        """The socket of the replica the dispatcher picks for ``ids`` (now ``rid``'s)."""
        if len(self.replicas) == 1:
            return self.replicas[0].push
        i = self.dispatcher.choose(ids, [r.inflight if r.alive else None
                                         for r in self.replicas])
        self.owner[rid] = i
        self.replicas[i].inflight += 1
        return self.replicas[i].push

    def abort_socket(self, rid: str):
        """Where the abort of ``rid`` goes: its replica's socket, None if that one is dead
        (``rid`` is released)."""
        r = self.replicas[self.owner.get(rid, 0)]
        self.release(rid)
        return r.push if r.alive else None

    def take_down(self, index: int, name: str, exitcode: int | None) -> list[str] | None:
        """Take replica ``index`` out of dispatch (its ``name`` process exited).

        Returns:
            the rids it ran, or None when no replica is left alive."""
        r = self.replicas[index]
        r.dead = f"the {name} process of replica {index} exited with code {exitcode}"
        self.dispatcher.forget(index)
        if not any(x.alive for x in self.replicas):
            return None
        return [rid for rid, i in self.owner.items() if i == index]

    # ---- control requests ---------------------------------------------------------------
    def resolve(self, msg) -> None:
        """Hand a control answer (``ServerInfoOut``, ``FlushCacheOut``, ``LoRAOut``) to the
        request waiting on its rid, if any."""
        fut = self.info_waiters.pop(msg.rid, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def fail_waiters(self, err: Exception) -> None:
        """Fail every waiting control request with ``err``."""
        for fut in self.info_waiters.values():
            if not fut.done():
                fut.set_exception(err)
        self.info_waiters.clear()

    async def server_info(self) -> io.ServerInfoOut:
        """Ask the engine for its KV pool and queue figures.

        Raises:
            APIError: 503 if the engine is dead or does not answer within 5 s.
        """
        if len(self.replicas) == 1:
            return await self.ask(io.GetServerInfoReq, "info")
        outs = await self.ask_all(io.GetServerInfoReq, "info")
        return summed_info([o for o in outs if o is not None])

    async def server_infos(self) -> list[tuple[int, io.ServerInfoOut]]:
        """``(replica index, its ServerInfoOut)`` of every replica that answered (one
        replica: its own answer), replica order.

        Raises:
            APIError: 503 if none answered (or the one replica did not).
        """
        if len(self.replicas) == 1:
            return [(self.replicas[0].index, await self.ask(io.GetServerInfoReq, "info"))]
        live = [r for r in self.replicas if r.alive]
        outs = await self.ask_all(io.GetServerInfoReq, "info")
        return [(r.index, o) for r, o in zip(live, outs, strict=True) if o is not None]

    async def flush_cache(self) -> io.FlushCacheOut:
        """Ask the engine to empty its prefix cache (it refuses while requests run).

        Raises:
            APIError: 503 if the engine is dead or does not answer within 5 s.
        """
        if len(self.replicas) == 1:
            return await self.ask(io.FlushCacheReq, "flush")
        outs = [o for o in await self.ask_all(io.FlushCacheReq, "flush") if o]
        return io.FlushCacheOut(rid="flush", success=all(o.success for o in outs),
                                message="; ".join(sorted({o.message for o in outs})))

    async def change_lora(self, name: str, path: str | None,
                          adapters: dict[str, str]) -> tuple[io.LoRAOut, dict[str, str]]:
        """Load adapter ``name`` from ``path`` (or unload it when ``path`` is None) in every
        live replica's engine; a load that fails in one replica is undone in the others.

        Args:
            adapters: the loaded adapters (name -> path) before the change.
        Returns:
            the engines' answer (the first failure, if any) and the loaded adapters after.
        Raises:
            APIError: 503 if an engine is dead or does not answer in time.
        """
        make = (partial(io.UnloadLoRAReq, lora_name=name) if path is None
                else partial(io.LoadLoRAReq, lora_name=name, lora_path=path))
        live = [r for r in self.replicas if r.alive]
        outs = await asyncio.gather(*(self.ask(make, "lora", r, LORA_TIMEOUT_S)
                                      for r in live), return_exceptions=True)
        failed = [o for o in outs if isinstance(o, BaseException) or not o.success]
        if path is not None and failed:  # keep the replicas alike
            done = [r for r, o in zip(live, outs)
                    if not isinstance(o, BaseException) and o.success]
            await asyncio.gather(*(self.ask(partial(io.UnloadLoRAReq, lora_name=name),
                                            "lora", r, LORA_TIMEOUT_S) for r in done),
                                 return_exceptions=True)
        for o in failed:
            if isinstance(o, BaseException):
                raise o
        good = [o for o in outs if o.success]
        if good:
            adapters = dict(good[0].adapters)
        if failed and path is not None and good:  # undone above (none loaded it: unchanged,
            adapters.pop(name, None)  # e.g. a name already loaded stays)
        return (failed[0] if failed else outs[0]), adapters

    async def ask(self, msg_type, prefix: str, replica: Replica | None = None,
                  timeout: float = SERVER_INFO_TIMEOUT_S):
        """Send a control request to ``replica`` (default: replica 0) and wait for the
        engine's answer with the same rid (``msg_type(rid=...)`` builds the request).

        Raises:
            APIError: 503 if the engine is dead or does not answer within ``timeout``."""
        dead = self._dead()
        if dead is not None:
            raise unavailable(f"the engine is not running ({dead})")
        rid = f"{prefix}-{uuid.uuid4().hex}"
        fut = asyncio.get_running_loop().create_future()
        self.info_waiters[rid] = fut
        (self.replicas[0] if replica is None else replica).push.send(msg_type(rid=rid))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise unavailable("the engine did not answer in time") from None
        finally:
            self.info_waiters.pop(rid, None)

    async def ask_all(self, msg_type, prefix: str) -> list:
        """``ask`` of every live replica at once; None for those that did not answer
        (each answer also lands in its ``Replica.figures``).

        Raises:
            APIError: 503 if none answered.
        """
        live = [r for r in self.replicas if r.alive]
        outs = await asyncio.gather(*(self.ask(msg_type, prefix, r) for r in live),
                                    return_exceptions=True)
        outs = [None if isinstance(o, BaseException) else o for o in outs]
        if not any(outs):
            raise unavailable("no engine replica answered in time")
        return outs


def replica_status(replicas: list[Replica], children: list[dict]) -> list[dict]:
    """``/server_info``'s and ``/health``'s ``replicas``: per replica its state, pids, the
    requests the server waits on and its engine's last figures."""
    out = []
    for r, own in zip(replicas, children or [{}] * len(replicas)):
        d = {"index": r.index, "alive": r.alive, "error": r.dead, "num_inflight": r.inflight,
             "engine_pid": getattr(own.get("engine"), "pid", None),
             "detokenizer_pid": getattr(own.get("detokenizer"), "pid", None)}
        # the answer to the server-info request, not a later StatsOut: a step's stats can
        # land between that answer and this list (they carry no KV token figures)
        if isinstance(r.figures, io.ServerInfoOut) and r.alive:
            d.update({f: getattr(r.figures, f) for f in _INFO_SUMS}, stats=r.figures.stats,
                     tensor_parallel=r.figures.tensor_parallel)
        out.append(d)
    return out


def replica_pids(children: list[dict]) -> dict[str, list[int | None]]:
    """``/server_info``'s top-level ``engine_pid`` and ``detokenizer_pid`` under
    ``--dp-size``: one entry per replica, in replica order (``children``: per replica
    ``{"engine": Process, "detokenizer": Process}``; None where a process is unknown)."""
    return {f"{kind}_pid": [getattr(own.get(kind), "pid", None) for own in children]
            for kind in ("engine", "detokenizer")}


def replica_metrics(replicas: list[Replica], model: str) -> bytes:
    """Per-replica gauges appended to ``/metrics`` with ``--dp-size`` (Prometheus text)."""
    rows = [("dp_replica_up", "1 while the replica's processes live", lambda r: int(r.alive)),
            ("dp_replica_inflight_requests", "engine requests the server waits on",
             lambda r: r.inflight),
            ("dp_replica_num_requests_running", "requests its engine runs",
             lambda r: r.info.num_running if r.info is not None and r.alive else 0),
            ("dp_replica_num_requests_waiting", "requests its engine queues",
             lambda r: r.info.num_waiting if r.info is not None and r.alive else 0)]
    lines = []
    for name, doc, value in rows:
        lines += [f"# HELP ferry:{name} {doc}", f"# TYPE ferry:{name} gauge"]
        lines += [f'ferry:{name}{{model_name="{model}",replica="{r.index}"}} {value(r)}'
                  for r in replicas]
    return ("\n".join(lines) + "\n").encode()
