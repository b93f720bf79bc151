"""The engine process's event loop: receive -> schedule -> run -> send.

Sockets: PULL at ``ipc.engine`` (requests from the server), PUSH to ``ipc.detokenizer``
(``BatchTokenIdOut``) and PUSH to ``ipc.server`` (ready, errors, info, stats).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import zmq

from engine import io_struct as io
from engine.args import ServerArgs
from engine.ipc import ENGINE_IN, PullSocket, PushSocket
from engine.lora.adapter import LoRAError
from engine.sampling.params import SamplingParams
from engine.scheduler.output import STATS_TTFT_ZERO, StepOutput
from engine.scheduler.request import Req
from engine.scheduler.scheduler import Scheduler
from engine.validation import RequestError, pooling_mismatch, validate_request

logger = logging.getLogger("ferry.engine")

STATS_INTERVAL_S = 1.0


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [engine] %(message)s")


def warm_up(sched: Scheduler) -> None:
    """Run a prefill, a mixed prefill+decode step and decodes before serving, so Triton
    compiles its kernels now rather than inside the first users' requests (a cold first
    request on an H200 waited ~0.4 s for compilation)."""
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a = Req("warmup-a", [1] * 17, sp)
    b = Req("warmup-b", [2] * 33, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    sched.add_request(a)
    sched.step()
    sched.add_request(b)
    for _ in range(16):
        if a.finished and b.finished and not sched.has_work():
            break
        sched.step()
    sched.stats.update(prompt_tokens=0, generation_tokens=0, steps=0, prefix_cache_queries=0,
                       prefix_cache_hits=0, **STATS_TTFT_ZERO)
    if sched.spec is not None:
        sched.spec.reset_stats()
    sched.flush_cache()  # the warm-up prompts are nobody's prefix


class EngineLoop:
    def __init__(self, args: ServerArgs, ipc):
        self.args = args
        self.ipc = ipc

    def _start(self):
        from engine.scheduler.build import build_engine

        engine = build_engine(self.args)
        self.runner, self.tokenizer, self.sched = engine.runner, engine.tokenizer, engine.scheduler
        self.vocab_size = engine.vocab_size
        if self.runner.device_type != "cpu":
            warm_up(self.sched)

    def run(self) -> None:
        try:
            self._run()
        finally:
            # tensor parallelism: stop the workers now. This process ends through
            # multiprocessing, which runs no atexit hook and would SIGTERM (ignored) and join
            # its daemon children forever
            if getattr(self, "runner", None) is not None:
                self.runner.shutdown()

    def _run(self) -> None:
        _setup_logging(self.args.log_level)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
        parent = os.getppid()
        ctx = zmq.Context()
        self.to_server = PushSocket(ctx, self.ipc.server)
        self.pull = PullSocket(ctx, self.ipc.engine, ENGINE_IN, bind=True)
        self.to_detok = PushSocket(ctx, self.ipc.detokenizer)
        self._start()
        r = self.runner
        self.to_server.send(io.ReadyOut(
            rid="engine", max_total_tokens=r.max_total_tokens, max_context_len=r.max_context_len,
            swa_total_tokens=getattr(r, "swa_total_tokens", 0),
            max_running_requests=self.args.max_running_requests, vocab_size=self.vocab_size,
            device=r.device_type, dtype=str(r.dtype).replace("torch.", ""),
            kv_cache_dtype=str(r.kv_dtype).replace("torch.", ""),
            model=self.args.model_path or "SmolLM2-135M-Instruct",
            architecture=r.model_config.architecture, tp_size=r.tp.size,
            lora_enabled=r.lora is not None, lora_adapters=self.lora_adapters(),
            pooling={} if r.pooling is None else dict(r.pooling.describe(),
                                                      hidden_size=r.model_config.hidden_size)))
        last_stats = 0.0
        while True:
            msgs = self.pull.recv_nowait()
            if not msgs and not self.sched.has_work():
                m = self.pull.recv(timeout_ms=500)
                msgs = [m] if m is not None else []
                if os.getppid() != parent:
                    logger.error("server process is gone; engine exits")
                    return
            for m in msgs:
                self.handle(m)
            outs = self.sched.step()
            rejected = self.sched.grammars.take_rejected()
            if rejected:  # a constraint the engine could not compile: the client's 400
                for rid, (message, param, code) in rejected.items():
                    self.to_server.send(io.ErrorOut(rid=rid, message=message, status=400,
                                                    param=param, code=code))
                outs = [o for o in outs if o.req.rid not in rejected]
            pooled = [o for o in outs if o.pooled is not None]
            if pooled:  # pooling answers go straight to the server (no text to detokenize)
                self.to_server.send(self.pooled_out(pooled))
                outs = [o for o in outs if o.pooled is None]
            if outs:
                self.to_detok.send(self.batch_out(outs))
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                last_stats = now
                self.to_server.send(self.stats_out())

    # ---- requests -----------------------------------------------------------------------
    def handle(self, m) -> None:
        if isinstance(m, io.TokenizedGenerateReq):
            max_new = self.validate(m)
            if isinstance(max_new, io.ErrorOut):
                self.to_server.send(max_new)
                return
            lora_id = self.lora_id(m)
            if isinstance(lora_id, io.ErrorOut):
                self.to_server.send(lora_id)
                return
            req = Req(m.rid, list(m.input_ids), m.sampling_params, m.stream, max_new,
                      m.arrival_time or None, lora_id)
            req.pooling = m.pooling
            self.sched.add_request(req)
        elif isinstance(m, io.AbortReq):
            self.sched.abort_request(m.rid)
        elif isinstance(m, io.GetServerInfoReq):
            self.to_server.send(self.info_out(m.rid))
        elif isinstance(m, io.FlushCacheReq):
            self.to_server.send(self.flush_out(m.rid))
        elif isinstance(m, (io.LoadLoRAReq, io.UnloadLoRAReq)):
            self.to_server.send(self.lora_out(m))

    # ---- LoRA adapters ------------------------------------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters, name -> path (empty without LoRA)."""
        mgr = self.runner.lora
        return {} if mgr is None else {a["name"]: a["path"] for a in mgr.list()}

    def lora_id(self, m: io.TokenizedGenerateReq) -> int | None | io.ErrorOut:
        """The adapter id of a request (None: the base model), or the error for a name
        that is not loaded (404: unloaded between the server's check and now)."""
        if m.lora_name is None:
            return None
        if self.runner.lora is None:
            return io.ErrorOut(rid=m.rid, message="this server serves no LoRA adapters "
                               "(start it with --lora-paths or --enable-lora)", status=400,
                               param="model")
        try:
            return self.runner.lora.resolve(m.lora_name)
        except LoRAError as e:
            return io.ErrorOut(rid=m.rid, message=str(e), status=e.status, param=e.param,
                               code="model_not_found" if e.status == 404 else None)

    def lora_out(self, m: io.LoadLoRAReq | io.UnloadLoRAReq) -> io.LoRAOut:
        """Load or unload an adapter (reading its files blocks the loop for that long)."""
        mgr = self.runner.lora
        if mgr is None:
            return io.LoRAOut(rid=m.rid, success=False, status=400, message="this server "
                              "serves no LoRA adapters: start it with --enable-lora (or "
                              "--lora-paths)")
        try:
            if isinstance(m, io.LoadLoRAReq):
                mgr.load(m.lora_name, m.lora_path)
                msg = f"LoRA adapter {m.lora_name!r} loaded from {m.lora_path}"
            else:
                mgr.unload(m.lora_name)
                msg = f"LoRA adapter {m.lora_name!r} unloaded"
        except LoRAError as e:
            return io.LoRAOut(rid=m.rid, success=False, message=str(e), status=e.status,
                              param=e.param, adapters=self.lora_adapters())
        return io.LoRAOut(rid=m.rid, success=True, message=msg, adapters=self.lora_adapters())

    def validate(self, m: io.TokenizedGenerateReq) -> io.ErrorOut | int:
        """Check a request with ``engine.validation.validate_request`` (the server ran the
        same checks; this keeps the engine safe from any sender).

        Returns:
            the completion's token budget (``max_tokens``, or the room left in the context
            when it is None), or a 400 ``ErrorOut`` for a duplicate rid or a rejected request.
        """
        def err(msg, param=None, code=None):
            return io.ErrorOut(rid=m.rid, message=msg, status=400, param=param, code=code)

        if m.rid in self.sched.reqs:
            return err(f"duplicate request id {m.rid}")
        if error := pooling_mismatch(self.runner.pooling, m.pooling):
            return err(error)
        try:
            return validate_request(m.input_ids, m.sampling_params, self.vocab_size,
                                    self.runner.max_context_len)
        except RequestError as exc:
            return err(exc.message, exc.param, exc.code)

    # ---- outputs ------------------------------------------------------------------------
    def batch_out(self, outs: list[StepOutput]) -> io.BatchTokenIdOut:
        b = io.BatchTokenIdOut(rids=[], new_token_ids=[], finished_reasons=[], prompt_tokens=[],
                               completion_tokens=[], stop_strs=[], skip_special_tokens=[],
                               spaces_between_special_tokens=[], logprobs=[],
                               prompt_logprobs=[], cached_tokens=[], min_tokens=[],
                               queue_time_s=[], stop_regex=[])
        for o in outs:
            req, sp = o.req, o.req.sampling_params
            b.rids.append(req.rid)
            b.new_token_ids.append(o.new_token_ids)
            b.finished_reasons.append(o.finished_reason.to_dict() if o.finished_reason else None)
            b.prompt_tokens.append(len(req.origin_input_ids))
            b.cached_tokens.append(-1 if req.cached_tokens is None or not self.sched.kv.enabled
                                   else req.cached_tokens)
            b.completion_tokens.append(len(req.output_ids))
            b.queue_time_s.append(-1.0 if req.queue_time is None else req.queue_time)
            b.stop_strs.append(sp.stop)
            b.min_tokens.append(sp.min_tokens)
            b.stop_regex.append(sp.stop_regex)
            b.skip_special_tokens.append(sp.skip_special_tokens)
            b.spaces_between_special_tokens.append(sp.spaces_between_special_tokens)
            if sp.logprobs is not None:
                b.logprobs.append(req.logprobs[req.sent_logprobs:])
                req.sent_logprobs = len(req.logprobs)
            else:
                b.logprobs.append(None)
            if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and (
                    o.new_token_ids or o.finished_reason is not None):
                b.prompt_logprobs.append(req.prompt_logprobs)
                req.prompt_logprobs_sent = True
            else:
                b.prompt_logprobs.append(None)
        return b

    def pooled_out(self, outs: list[StepOutput]) -> io.PooledOut:
        """The answers of pooling requests that ended in this step."""
        cache = self.sched.kv.enabled
        return io.PooledOut(
            rids=[o.req.rid for o in outs], outputs=[o.pooled for o in outs],
            prompt_tokens=[len(o.req.origin_input_ids) for o in outs],
            cached_tokens=[o.req.cached_tokens or 0 if cache else -1 for o in outs])

    def flush_out(self, rid: str) -> io.FlushCacheOut:
        """Empty the prefix cache if no request is queued or running."""
        kv = self.sched.kv
        if not kv.enabled:
            return io.FlushCacheOut(rid=rid, success=True, message="nothing to flush: the "
                                    "prefix cache is disabled (--disable-radix-cache)")
        held = kv.tree.cached_tokens()
        if not self.sched.flush_cache():
            return io.FlushCacheOut(rid=rid, success=False, message="cannot flush the prefix "
                                    "cache while requests are queued or running")
        return io.FlushCacheOut(rid=rid, success=True,
                                message=f"flushed the prefix cache ({held} cached tokens freed)")

    def info_out(self, rid: str) -> io.ServerInfoOut:
        kv = self.runner.kv_pool
        # used: held by requests; free: allocatable, the prefix cache's evictable part included
        mgr = self.sched.kv
        return io.ServerInfoOut(rid=rid, kv_used_tokens=mgr.used_tokens(),
                                kv_free_tokens=mgr.available_tokens(),
                                kv_total_tokens=kv.capacity_tokens,
                                num_running=self.sched.num_running,
                                num_waiting=self.sched.num_waiting,
                                stats=dict(self.sched.stats, pid=os.getpid()),
                                cached_tokens=self.sched.kv.tree.cached_tokens(),
                                evictable_tokens=self.sched.kv.tree.evictable_tokens(),
                                tensor_parallel={"tp_size": self.runner.tp.size,
                                                 "backend": self.runner.tp.backend,
                                                 "ranks": self.runner.rank_memory},
                                speculative=self.sched.spec.info() if self.sched.spec else {})

    def stats_out(self) -> io.StatsOut:
        kv = self.runner.kv_pool
        st = self.sched.stats
        return io.StatsOut(num_running=self.sched.num_running, num_waiting=self.sched.num_waiting,
                           # the prefix cache's evictable pages count as free, as in vLLM
                           kv_usage=self.sched.kv.used_tokens() / max(kv.capacity_tokens, 1),
                           prompt_tokens=st["prompt_tokens"],
                           generation_tokens=st["generation_tokens"])


def run_scheduler_process(args: ServerArgs, ipc) -> None:
    """Entry point of the engine process (spawned by the server's launcher).

    Loads the model, sends ``ReadyOut(rid="engine")`` to the server, then loops: receive
    requests and aborts, run one scheduler step, send new tokens to the detokenizer.
    """
    EngineLoop(args, ipc).run()
