"""Process launch and teardown of ``ferry serve``.

1. Bind the HTTP socket (fail fast if the port is taken) and the server's PULL socket in a
   private 0700 IPC dir.
2. Spawn the engine and the detokenizer (multiprocessing "spawn"); load the tokenizer in a
   thread meanwhile. Wait for both ``ReadyOut`` messages (a child that dies or a timeout is a
   clear start-up error), then log one line and run uvicorn in the same event loop (with
   the connection limits and timeouts of ``server/http/limits.py``).
3. Watch the children: if one dies, /health answers 503, every waiting request gets a 503
   (a stream a final error event and ``[DONE]``) and the server exits non-zero.
4. With ``--tp-size N`` the engine process spawns the model workers of ranks 1..N-1 (see
   ``engine/executor/tp_worker.py``) and ends itself when one dies, which step 3 then handles; a
   node started with ``--node-rank > 0`` runs only its workers (:func:`run_worker_node`).
5. With ``--dp-size N``, N replicas each spawn an engine and a detokenizer on IPC paths of
   their own (``server/replicas.py``; on GPUs replica i sees devices ``i*tp .. i*tp+tp-1``
   through ``CUDA_VISIBLE_DEVICES``/``ZE_AFFINITY_MASK``, on the CPU each gets ``1/N`` of the
   engine threads unless ``--cpu-threads`` is given). A replica whose engine or
   detokenizer dies loses the other one too, is taken out of dispatch and its requests get a
   503; the server goes on while one replica lives (step 3 when none does).
6. SIGINT/SIGTERM (to the server alone or to the whole process group: the children ignore
   both): new requests get 503, in-flight ones may finish for ``--shutdown-timeout``
   seconds, the rest end with ``finish_reason`` "abort"; then the children are killed and
   the IPC dir removed. A second signal stops at once (the same signal again within 0.5 s
   is the same one: make and shells forward a process-group SIGTERM to their child).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from engine.args import ignored_flag_notes, prefill_budget
from engine.ipc import IpcPaths
from server.app import build_app, model_name_of
from server.http.limits import raise_fd_limit, uvicorn_limits
from server.media.process import load_image_processor
from server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("ferry.server")

WATCH_INTERVAL_S = 0.25
#: after a child dies, keep answering (503) this long so clients see why, then exit
DEAD_EXIT_DELAY_S = 3.0
CHILD_STOP_TIMEOUT_S = 5.0
#: the same signal again within this many seconds is the same request to stop
SAME_SIGNAL_S = 0.5


class StartupError(RuntimeError):
    pass


def _child_main(name: str, server_args, ipc: IpcPaths) -> None:
    """Target of the spawned children: run until the server stops us.

    SIGINT and SIGTERM are ignored: Ctrl-C in a terminal, ``timeout``, ``kill -- -PGID`` and
    systemd's default stop send them to the whole process group, and the server must drain
    its in-flight requests through the engine and the detokenizer before they go. The server
    then stops them with SIGKILL (they hold nothing that needs a clean exit: the server
    removes the IPC directory); both also exit by themselves when the server is gone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # tqdm's default lock is a multiprocessing semaphore; a child stopped by SIGKILL cannot
    # release it, and the resource tracker then warns about a leak at shutdown
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    if name != "engine":
        _one_thread()  # the detokenizer does string work: torch threads would only compete
    if name == "engine":
        from engine.scheduler.engine_loop import run_scheduler_process

        run_scheduler_process(server_args, ipc)
    else:
        from engine.tokenizer.detokenizer import run_detokenizer_process

        run_detokenizer_process(server_args, ipc)


def _one_thread() -> None:
    """One intra-op torch thread in this process (the server and the detokenizer leave the
    cores to the engine)."""
    import torch

    torch.set_num_threads(1)


def passive_openmp_env() -> None:
    """Children inherit ``OMP_WAIT_POLICY=PASSIVE`` (unless the user set a policy): idle
    OpenMP threads sleep instead of spinning, so an engine that shares its cores with
    another busy process slows down in proportion instead of collapsing."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class _StderrHandler(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is at each record (not the stream
    that was current when logging was set up: one replaced and closed since, as pytest's
    capture does, would make every later record a "Logging error")."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), handlers=[_StderrHandler()], force=True,
                        format="%(asctime)s %(levelname)s [server] %(message)s")
    # one start-up line is ours; uvicorn's chatter only at debug
    quiet = logging.DEBUG if level == "debug" else logging.WARNING
    logging.getLogger("uvicorn.error").setLevel(quiet)
    logging.getLogger("uvicorn.access").setLevel(quiet)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _load_tokenizer(args):
    try:
        from engine.tokenizer.tokenizer import load_tokenizer

        return load_tokenizer(args.tokenizer_path or args.model_path)
    except Exception as exc:  # noqa: BLE001 - dummy weights without a tokenizer: ids only
        logger.warning("no tokenizer (%s); only token-id prompts will work", exc)
        return None


class _Server(uvicorn.Server):
    """uvicorn.Server whose SIGINT/SIGTERM start ferry's drain instead of a hard stop."""

    def __init__(self, config: uvicorn.Config, on_signal):
        super().__init__(config)
        self.on_signal = on_signal
        self.exit_code = 0

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()

        def handler(sig, frame):
            loop.call_soon_threadsafe(self.on_signal, sig)

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


class Launcher:
    """Owns the children, the TokenizerManager and uvicorn for one ``ferry serve``."""

    def __init__(self, args):
        self.args = args
        self.ipc = IpcPaths.create()
        self.replica_ipcs = [IpcPaths.create() for _ in range(args.dp_size - 1)]
        self.procs: dict[str, multiprocessing.Process] = {}
        # per replica: {"engine": Process, "detokenizer": Process}
        self.replica_procs: list[dict[str, multiprocessing.Process]] = []
        self.tm: TokenizerManager | None = None
        self.server: _Server | None = None
        self._draining = False
        self._first_signal: int | None = None
        self._first_signal_at = 0.0

    # ---- children -----------------------------------------------------------------------
    def _spawn(self) -> None:
        passive_openmp_env()
        _one_thread()  # this process tokenizes and serves HTTP; the engine gets the cores
        ctx = multiprocessing.get_context("spawn")
        for i, ipc in enumerate([self.ipc, *self.replica_ipcs]):
            args, env = _replica_args(self.args, i)
            own: dict[str, multiprocessing.Process] = {}
            for name in ("engine", "detokenizer"):
                suffix = f"-{i}" if i else ""
                p = ctx.Process(target=_child_main, args=(name, args, ipc),
                                name=f"ferry-{name}{suffix}", daemon=False)
                with _environ(env):
                    p.start()
                self.procs[name + suffix] = own[name] = p
            self.replica_procs.append(own)

    def _dead_child(self) -> tuple[str, int | None] | None:
        for name, p in self.procs.items():
            if not p.is_alive():
                return name, p.exitcode
        return None

    def stop_children(self) -> None:
        """SIGKILL the children (they ignore SIGTERM, see _child_main) and wait for them.

        (A SIGUSR1 handler calling os._exit, tried first, left the engine running for 5 s on
        an H200; the cause was not found.)"""
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                logger.warning("%s did not exit %.0f s after SIGKILL", p.name,
                               CHILD_STOP_TIMEOUT_S)

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.args.startup_timeout
        while not all(n in r.ready for r, own in zip(self.tm.replicas, self.replica_procs)
                      for n in own):
            dead = self._dead_child()
            if dead is not None:
                raise StartupError(f"the {dead[0]} process exited with code {dead[1]} during "
                                   "start-up (see its log above)")
            if time.monotonic() > deadline:
                raise StartupError(f"the engine was not ready after "
                                   f"{self.args.startup_timeout:.0f} s (raise "
                                   f"--startup-timeout to wait longer)")
            await asyncio.sleep(0.1)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            self._watch_replicas()
            dead = self._dead_child() if self.tm.dead is not None or \
                len(self.replica_procs) == 1 else None
            if dead is None:
                continue
            logger.error("the %s process died (exit code %s); failing all requests and "
                         "exiting", *dead)
            self.tm.on_child_died(*dead)
            self.server.exit_code = 1
            await asyncio.sleep(DEAD_EXIT_DELAY_S)
            self.server.should_exit = True
            return

    def _watch_replicas(self) -> None:
        """--dp-size: take a replica whose engine or detokenizer died out (its other
        child is killed); the last one to go ends the server through ``_watch``."""
        if len(self.replica_procs) == 1:
            return
        for r, own in zip(self.tm.replicas, self.replica_procs):
            dead = next(((n, p.exitcode) for n, p in own.items() if not p.is_alive()), None)
            if r.alive and dead is not None:
                for p in own.values():
                    if p.is_alive():
                        p.kill()
                logger.error("replica %d: the %s process died (exit code %s); its requests "
                             "fail, the other replicas go on", r.index, *dead)
                self.tm.on_replica_died(r.index, *dead)

    # ---- shutdown -----------------------------------------------------------------------
    def on_signal(self, sig: int) -> None:
        now = time.monotonic()
        if self._draining and sig == self._first_signal and \
                now - self._first_signal_at < SAME_SIGNAL_S:
            # the same signal twice at once: a process-group kill that a parent (make,
            # a shell) also forwards; one request to stop, not two
            return
        if self._draining:
            logger.warning("second signal: stopping now")
            self.tm.abort_all("server shutting down")
            self.server.force_exit = True
            self.server.should_exit = True
            return
        self._draining = True
        self._first_signal, self._first_signal_at = sig, now
        asyncio.get_running_loop().create_task(self._drain(signal.Signals(sig).name))

    async def _drain(self, why: str) -> None:
        tm = self.tm
        tm.shutting_down = True
        timeout = self.args.shutdown_timeout
        if tm.num_inflight:
            n = tm.num_inflight
            logger.info("%s: letting %d request%s finish (up to %.0f s)", why, n,
                        "" if n == 1 else "s", timeout)
        else:
            logger.info("%s: shutting down", why)
        deadline = time.monotonic() + timeout
        while tm.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if tm.num_inflight:
            n = tm.num_inflight
            logger.warning("aborting %d request%s still running", n, "" if n == 1 else "s")
            tm.abort_all("server shutting down")
            await asyncio.sleep(0.2)  # let the streams send their last chunk
        self.server.should_exit = True

    # ---- main ---------------------------------------------------------------------------
    async def serve(self) -> int:
        args = self.args
        sock = _bind(args.host, args.port)
        if args.dp_size > 1 and args.nnodes > 1:
            raise StartupError("--dp-size > 1 runs on one host: it does not combine with "
                               "--nnodes > 1 (put a router in front of several servers)")
        if args.dp_size > 1 and args.tp_size > 1 and args.dist_init_addr:
            raise StartupError("--dp-size > 1 with --tp-size > 1: leave --dist-init-addr "
                               "unset (each replica picks a free rendezvous port)")
        for note in ignored_flag_notes(args):
            logger.info("%s", note)
        self.tm = TokenizerManager(args, self.ipc, self.replica_ipcs)
        try:
            self.tm.start()
            self._spawn()
            tok = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, args))
            await self._wait_ready()
            self.tm.set_tokenizer(await tok)  # probes the chat template (tools)
            self.tm.images = await asyncio.to_thread(load_image_processor, args.model_path)
            ready = self.tm.engine_ready
            host = f"[{args.host}]" if ":" in args.host else args.host
            logger.info("ferry ready: model=%s device=%s dtype=%s tp_size=%d dp_size=%d "
                        "kv_capacity=%d tokens prefill_chunk=%d tokens max_context_len=%d "
                        "url=http://%s:%d", model_name_of(args), ready.device, ready.dtype,
                        ready.tp_size, args.dp_size, ready.max_total_tokens,
                        prefill_budget(args, ready.device), ready.max_context_len, host,
                        args.port)
            app = build_app(self.tm, args, self.procs)
            # log_level=None: keep the levels setup_logging chose for uvicorn's loggers
            limits = uvicorn_limits(args, ready.max_running_requests, raise_fd_limit())
            config = uvicorn.Config(app, log_level=None, access_log=False,
                                    log_config=None, timeout_graceful_shutdown=3,
                                    lifespan="off", **limits)
            self.server = _Server(config, self.on_signal)
            watcher = asyncio.ensure_future(self._watch())
            try:
                await self.server.serve(sockets=[sock])
            finally:
                watcher.cancel()
            return self.server.exit_code
        finally:
            sock.close()
            await self.tm.aclose()

    def run(self) -> int:
        """Run until shut down; returns the process exit code."""
        def on_term(sig, frame):  # during start-up only; uvicorn's handler replaces it
            raise KeyboardInterrupt

        old_term = signal.signal(signal.SIGTERM, on_term)
        try:
            return asyncio.run(self.serve())
        except StartupError as exc:
            logger.error("%s", exc)
            return 1
        except KeyboardInterrupt:
            logger.info("interrupted during start-up")
            return 130
        finally:
            signal.signal(signal.SIGTERM, old_term)
            self.stop_children()
            for ipc in (self.ipc, *self.replica_ipcs):
                ipc.cleanup()
            logger.info("ferry stopped")


_DEVICE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK"}


def _replica_args(args, i: int):
    """``(args, environment overrides)`` of replica ``i`` (see step 5 above)."""
    if args.dp_size == 1:
        return args, {}
    from engine import device as dev

    kind = dev.resolve_device(args.device)
    if kind == "cpu":
        share = max(1, dev.cpu_thread_count(None) // args.dp_size)
        return args.replace(cpu_threads=args.cpu_threads or share), {}
    var = _DEVICE_ENV[kind]
    seen = os.environ.get(var)
    ids = seen.split(",") if seen else [str(d) for d in range(dev.visible_device_count(kind))]
    need = args.dp_size * args.tp_size
    if len(ids) < need:
        raise StartupError(f"--dp-size {args.dp_size} x --tp-size {args.tp_size} needs {need} "
                           f"{kind} devices, {len(ids)} visible")
    return args, {var: ",".join(ids[i * args.tp_size:(i + 1) * args.tp_size])}


@contextlib.contextmanager
def _environ(env: dict):
    """``os.environ`` with ``env`` set (a spawned child copies it at start)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_worker_node(args) -> int:
    """``--node-rank > 0``: run this node's tensor-parallel ranks (no HTTP server, no
    scheduler) until one of them exits or a signal arrives; returns the exit code.

    The workers meet rank 0 at ``--dist-init-addr``; they die with this process."""
    from engine.distributed import ranks_per_node
    from engine.executor.tp_worker import start_workers, stop_workers

    per_node = ranks_per_node(args)
    first = args.node_rank * per_node
    passive_openmp_env()
    procs = start_workers(args, list(range(first, first + per_node)))
    logger.info("node %d of %d: started tensor-parallel ranks %d..%d; rank 0 is at %s",
                args.node_rank, args.nnodes, first, first + per_node - 1, args.dist_init_addr)
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    code = 0
    while not stop.is_set():
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            code = dead[0].exitcode or 0
            logger.log(logging.ERROR if code else logging.INFO, "%s exited with code %s; "
                       "stopping this node", dead[0].name, dead[0].exitcode)
            break
        stop.wait(WATCH_INTERVAL_S)
    stop_workers(procs)
    return 1 if code else 0


def launch_server(server_args) -> int:
    """Start the server (node 0) or this node's model workers (``--node-rank > 0``) and
    block until it stops; returns the exit code."""
    setup_logging(server_args.log_level)
    logger.info("starting ferry: model=%s device=%s (the engine logs as it loads)",
                model_name_of(server_args), server_args.device)
    if server_args.node_rank > 0:
        return run_worker_node(server_args)
    return Launcher(server_args).run()
