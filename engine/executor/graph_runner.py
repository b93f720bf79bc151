"""Decode graphs: capture the decode step once per batch-size bucket, then replay.

Works with the CUDA graph and XPU graph classes (torch >= 2.11) through
``engine.device``. Graph inputs live in static buffers sized for the largest bucket; a batch
of size ``bs`` runs the smallest captured bucket >= bs, with the padding rows pointing at
``req_to_token`` row 0 and pool slot 0 (the padding sink), so they read and write nothing
that a real request uses. Nothing inside the step syncs with the host.

A model with linear-attention layers (a recurrent-state pool, ``engine/kv/state_pool.py``)
reads each row's state slot from the static ``state_slots`` buffer (the step's
``RecurrentStateView.slots``); a padding row points at the pool's slot 0, its padding slot,
so the padded rows' conv and recurrent updates never touch a real request's state. The
per-bucket ``cu_seqlens`` (``0..bs``, one token a row) are host constants of the capture.
With speculative decoding such a model also gets verify graphs: a verify step is a DECODE
batch of n = 1 + drafts rows a request (``ScheduleBatch.verify_n``; the worker pads a
request's rows to n), captured per bucket of requests (``verify_buckets``, rows = requests x
n) with the linear layers in their verify mode (each request's rows from its slot, the
state after each row into the pool's scratch slots; ``engine/layers/gated_deltanet.py``).

The attention metadata (decode split counts, workspaces) lives in the backend's static
buffers (``attn_backend.init_capture``); ``init_forward_graph`` is captured with the step, so
each replay recomputes the split counts on the device from the static ``seq_lens``.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import replace

import torch

from engine import device as dev
from engine.args import num_draft_tokens
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import (
    ForwardBatch,
    ForwardMode,
    RecurrentStateView,
    resolve_placeholders,
)

logger = logging.getLogger(__name__)


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16 up to ``max_bs``."""
    out = [b for b in (1, 2, 4) if b <= max_bs]
    out += list(range(8, min(max_bs, 64) + 1, 8))
    out += list(range(80, max_bs + 1, 16))
    if max_bs not in out:
        out.append(max_bs)
    return sorted(set(out))


class GraphRunner:
    """Captures and replays decode graphs for a ``ModelRunner``."""

    def __init__(self, runner):
        self.runner = runner
        self.device_type = runner.device_type
        a = runner.args
        # a speculative verify step of small batches runs as decode rows (k + 1 per request)
        rows = max(a.max_running_requests, a.speculative_max_batch_size * (1 + num_draft_tokens(a)))
        self.max_bs = min(a.cuda_graph_max_bs, rows)
        self.buckets = batch_size_buckets(self.max_bs)
        # a hybrid model's verify steps: n rows a request, graphs per bucket of requests
        self.verify_n = 1 + num_draft_tokens(a) \
            if a.speculative_algorithm and runner.state_pool is not None else 0
        most = min(a.speculative_max_batch_size, a.max_running_requests,
                   self.max_bs // self.verify_n) if self.verify_n else 0
        self.verify_buckets = batch_size_buckets(most) if most else []
        self.verify_graphs: dict[int, object] = {}
        self.verify_outputs: dict[int, torch.Tensor] = {}
        self.verify_hidden: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # the model's kept hidden states (an EAGLE head's input, CausalLM.set_capture_hidden)
        # as each graph wrote them: static like the logits, handed out as copies
        self.hidden: dict[int, torch.Tensor] = {}
        # LoRA: each bucket again without the LoRA kernels, replayed for steps without an
        # adapter row (the kernels cost ~1.5 us a launch even when every row skips them)
        self.base_graphs: dict[int, object] = {}
        self.base_outputs: dict[int, torch.Tensor] = {}
        self.base_hidden: dict[int, torch.Tensor] = {}
        self._lora_off = False
        d = runner.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=d)
        self.positions = torch.zeros(n, dtype=torch.int64, device=d)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=d)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=d)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=d)
        self.swa_loc = torch.zeros(n, dtype=torch.int64, device=d)  # the windowed pool's
        # LoRA: one segment per row; replay writes each row's adapter slot (-1: base)
        self.lora_seg_start = torch.arange(n, dtype=torch.int32, device=d)
        self.lora_seg_len = torch.ones(n, dtype=torch.int32, device=d)
        self.lora_seg_slot = torch.full((n,), -1, dtype=torch.int32, device=d)
        # linear-attention layers: each row's recurrent-state slot (0: the padding slot)
        self.state_slots = torch.zeros(n, dtype=torch.int64, device=d)
        self.pool = runner.graph_pool()
        runner.attn_backend.init_capture(self.max_bs)
        t0 = time.perf_counter()
        self.capture()
        verify = (f" and {len(self.verify_graphs)} verify graphs ({self.verify_n} rows a "
                  f"request, requests {self.verify_buckets})" if self.verify_graphs else "")
        logger.info("captured %d decode graphs (bs %s)%s in %.1f s", len(self.graphs),
                    self.buckets, verify, time.perf_counter() - t0)

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs and bool(self.graphs)

    def can_verify(self, batch: ScheduleBatch) -> bool:
        """Whether a verify graph fits ``batch`` (``verify_n`` rows a request)."""
        return bool(self.verify_graphs) and batch.verify_n == self.verify_n and \
            batch.batch_size <= self.verify_buckets[-1] * self.verify_n

    def _fb(self, bs: int, verify_n: int = 0) -> ForwardBatch:
        r = self.runner
        fb = ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_to_token=r.req_to_token_pool.req_to_token,
            k_buffers=r.kv_pool.k_buffers, v_buffers=r.kv_pool.v_buffers,
            attn_backend=r.attn_backend)
        if getattr(r, "swa_pool", None) is not None:  # the windowed layers' view
            fb.swa = replace(fb, out_cache_loc=self.swa_loc[:bs],
                             req_to_token=r.swa_req_pool.req_to_token)
        sp = getattr(r, "state_pool", None)
        if sp is not None:  # the linear layers' slots, from the static buffer
            fb.state = RecurrentStateView(sp.conv_states, sp.recurrent_states,
                                          self.state_slots[:bs], list(range(bs + 1)),
                                          verify_n=verify_n, scratch_base=sp.scratch_base)
        return fb

    def _run(self, bs: int, verify_n: int = 0) -> torch.Tensor:
        fb = self._fb(bs, verify_n)
        if self.runner.lora is not None and self._lora_off:
            self.runner.lora.batch.active = False  # the layers skip LoRA: nothing recorded
        elif self.runner.lora is not None:  # the LoRA kernels read the static segments
            self.runner.lora.batch.set_static(self.lora_seg_start[:bs], self.lora_seg_len[:bs],
                                              self.lora_seg_slot[:bs], 1)
        self.runner.attn_backend.init_forward_graph(fb)
        if fb.swa is not None:
            self.runner.attn_backend.init_forward_graph(fb.swa)
        return self.runner.model(self.input_ids[:bs], fb.positions, fb)

    @torch.inference_mode()
    def capture(self) -> None:
        gcls = dev.graph_class(self.device_type)
        stream = dev.stream_class(self.device_type)()
        # (rows, key, LoRA off, rows a request, where the graph goes)
        todo = [(bs, bs, False, 0, (self.graphs, self.outputs, self.hidden))
                for bs in self.buckets]
        if self.runner.lora is not None:
            todo += [(bs, bs, True, 0, (self.base_graphs, self.base_outputs, self.base_hidden))
                     for bs in self.buckets]
        n = self.verify_n
        todo += [(r * n, r, False, n, (self.verify_graphs, self.verify_outputs,
                                       self.verify_hidden)) for r in self.verify_buckets]
        todo.sort(key=lambda x: -x[0])  # largest first so the pool is sized once
        for rows, key, off, n, (graphs, outputs, hidden) in todo:
            self._lora_off = off
            with dev.stream_context(self.device_type, stream):
                for _ in range(2):  # warm up: Triton compiles, autotune, allocator settles
                    self._run(rows, n)
            dev.synchronize(self.device_type)
            g = gcls()
            with dev.graph_context(self.device_type, g, pool=self.pool, stream=stream):
                out = self._run(rows, n)
            graphs[key] = g
            outputs[key] = out
            model = self.runner.model
            if getattr(model, "capture_hidden", None) is not None:
                hidden[key] = model.hidden_out
        self._lora_off = False
        dev.synchronize(self.device_type)

    def replay(self, batch: ScheduleBatch, future_ids: torch.Tensor | None = None,
               with_lora: bool = False) -> torch.Tensor:
        """Copy the batch into the static buffers, replay, return logits ``[bs, vocab]``.

        Placeholder input ids (overlap scheduling) are resolved from ``future_ids``. A batch
        without adapter rows replays the graph without the LoRA kernels, unless
        ``with_lora`` (the start-up check of both kinds).
        """
        bs = batch.batch_size
        if batch.verify_n:  # a verify step: its bucket of requests, n rows each
            key = self.verify_buckets[bisect.bisect_left(self.verify_buckets,
                                                         bs // batch.verify_n)]
            gbs = key * batch.verify_n
        else:
            gbs = key = self.buckets[bisect.bisect_left(self.buckets, bs)]
        r = self.runner
        ids = [req.token_at(p) for req, p in zip(batch.reqs, batch.prefix_lens)]
        pad = gbs - bs
        host = torch.tensor(
            [ids + [0] * pad,
             list(batch.prefix_lens) + [0] * pad,
             [req.req_pool_idx for req in batch.reqs] + [0] * pad,
             [p + 1 for p in batch.prefix_lens] + [1] * pad,
             list(batch.out_cache_loc) + [0] * pad,
             (list(batch.lora_slots) or [-1] * bs) + [-1] * pad,
             [getattr(req, "state_slot", None) or 0 for req in batch.reqs] + [0] * pad],
            dtype=torch.int64)
        host = dev.host_to_device(host, r.device)  # pinned, non-blocking: no wait on the stream
        self.input_ids[:gbs].copy_(resolve_placeholders(host[0], future_ids))
        self.positions[:gbs].copy_(host[1])
        self.req_pool_indices[:gbs].copy_(host[2])
        self.seq_lens[:gbs].copy_(host[3])
        self.out_cache_loc[:gbs].copy_(host[4])
        self.lora_seg_slot[:gbs].copy_(host[5])
        self.state_slots[:gbs].copy_(host[6])
        r.req_to_token_pool.req_to_token[host[2, :bs], host[1, :bs]] = host[4, :bs].to(torch.int32)
        if getattr(r, "swa_pool", None) is not None:
            loc = dev.host_to_device(torch.tensor(
                r.swa_pool.translate(batch.out_cache_loc) + [0] * pad, dtype=torch.int64),
                r.device)
            self.swa_loc[:gbs].copy_(loc)
            r.swa_req_pool.req_to_token[host[2, :bs], host[1, :bs]] = loc[:bs].to(torch.int32)
        base = bool(self.base_graphs) and not with_lora \
            and not any(s >= 0 for s in batch.lora_slots)
        graphs, outputs, hidden = (self.base_graphs, self.base_outputs, self.base_hidden) \
            if base else (self.graphs, self.outputs, self.hidden)
        if batch.verify_n:
            graphs, outputs, hidden = self.verify_graphs, self.verify_outputs, self.verify_hidden
        graphs[key].replay()
        if hidden:  # a copy: the next replay overwrites the static buffer
            r.model.hidden_out = hidden[key][:bs].clone()
        return outputs[key][:bs]
