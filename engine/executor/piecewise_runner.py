"""Piecewise graphs for prefill and mixed (prefill + decode) steps.

An EXTEND step's attention depends on the batch (how many requests, their prefix and new
lengths), so it cannot sit in a graph captured once. Everything else in the step is per
token. The model's forward is cut at its attention calls into ``L + 1`` pieces (the model
contract's ``num_pieces`` and ``piece``, ``engine/models/base.py``); for each bucket of token counts this runner captures every piece in a
device graph, and a step replays piece 0, runs layer 0's attention eagerly, replays piece 1,
and so on. The host then launches 33 graphs and 3-4 attention kernels per layer instead of
~12 kernels per layer (the idea of vLLM's and SGLang's piecewise CUDA graphs; here the cut
points are written by hand rather than found by torch.compile).

Buffers: the pieces read and write static buffers sized for the largest bucket; a step of T
tokens runs the smallest bucket Tb >= T, with the padding rows' ids, positions and KV slots
set to 0 (slot 0 is the padding sink), so the padding rows compute garbage that no real row
reads (every op in a piece is row-wise). Attention runs on the first T rows only.

Without a graph class (CPU) the same plumbing can run with the pieces called directly
(``use_graphs=False``), which is how the CI tests check it against the plain forward.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from engine import device as dev
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int, coarse: bool = False) -> list[int]:
    """16, 32, then every 64 up to 1024, every 128 up to 2048, every 256 up to ``max_tokens``.

    A step pads to the next bucket: at most 63 tokens below 1024, under 12.5% above 512.
    ``coarse`` (``engine.device.coarse_graph_buckets``: XPU, whose captures also wait for
    IGC): powers of two up to 256, every 128 up to 1024, then every 256 (16 buckets for
    2304 tokens instead of 27).
    """
    if coarse:
        out = [b for b in (16, 32, 64, 128) if b < max_tokens]
        out += list(range(256, min(max_tokens, 1024) + 1, 128))
        out += list(range(1280, max_tokens + 1, 256))
        return sorted(set(out + [max_tokens]))
    out = [b for b in (16, 32) if b < max_tokens]
    out += list(range(64, min(max_tokens, 1024) + 1, 64))
    out += list(range(1152, min(max_tokens, 2048) + 1, 128))
    out += list(range(2304, max_tokens + 1, 256))
    if not out or out[-1] != max_tokens:
        out.append(max_tokens)
    return sorted(set(out))


class PiecewiseRunner:
    """Captures the model's per-token pieces per token bucket and runs EXTEND steps.

    Args:
        runner: the ``ModelRunner`` (model, pools, attention backend, device); its model
            implements ``engine.models.base.CausalLM``.
        max_tokens: the largest step (tokens) that runs here; larger ones run eagerly.
        use_graphs: capture device graphs (False: call the pieces directly, for tests).
    """

    def __init__(self, runner, max_tokens: int, use_graphs: bool = True):
        self.runner = runner
        self.device_type = runner.device_type
        self.model = model = runner.model
        self.attn_layers = model.attention_layers()
        self.num_layers = model.num_pieces - 1
        self.buckets = token_buckets(max_tokens, dev.coarse_graph_buckets(self.device_type))
        self.max_tokens = self.buckets[-1]
        q_size, kv_size = model.q_size, model.kv_size
        hidden = model.model_config.hidden_size
        n, d, dt = self.max_tokens, runner.device, runner.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=d)
        self.positions = torch.zeros(n, dtype=torch.int64, device=d)
        # q | k | v of the current layer (a piece copies its projection here), the attention
        # output, and the residual stream
        self.qkv = torch.zeros((n, q_size + 2 * kv_size), dtype=dt, device=d)
        self.q = self.qkv[:, :q_size]
        self.k = self.qkv[:, q_size:q_size + kv_size]
        self.v = self.qkv[:, q_size + kv_size:]
        self.attn_out = torch.zeros((n, q_size), dtype=dt, device=d)
        self.residual = torch.zeros((n, hidden), dtype=dt, device=d)
        self.graphs: dict[int, list] = {}
        self.hidden_out: dict[int, torch.Tensor] = {}
        if use_graphs:
            t0 = time.perf_counter()
            self.capture()
            logger.info("captured piecewise graphs for %d token buckets (%d..%d tokens) in %.1f s",
                        len(self.buckets), self.buckets[0], self.max_tokens,
                        time.perf_counter() - t0)

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    # ---- the pieces ---------------------------------------------------------------------
    def _piece(self, i: int, tb: int):
        """Run piece i on the first ``tb`` rows of the static buffers."""
        pos = self.positions[:tb]
        if i == 0:
            out = self.model.piece(0, pos, input_ids=self.input_ids[:tb])
        else:
            out = self.model.piece(i, pos, attn_out=self.attn_out[:tb],
                                   residual=self.residual[:tb])
        if i == self.num_layers:
            return out  # final hidden states [tb, hidden]
        q, k, v, residual = out
        base = q._base
        if base is not None and k._base is base and v._base is base \
                and base.shape == self.qkv[:tb].shape and q.data_ptr() == base.data_ptr():
            self.qkv[:tb].copy_(base)  # q/k/v are still the fused projection's columns
        else:
            self.q[:tb].copy_(q)
            self.k[:tb].copy_(k)
            self.v[:tb].copy_(v)
        self.residual[:tb].copy_(residual)
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        gcls = dev.graph_class(self.device_type)
        stream = dev.stream_class(self.device_type)()
        pool = self.runner.graph_pool()
        for tb in reversed(self.buckets):  # largest first so the pool is sized once
            graphs = []
            for i in range(self.num_layers + 1):
                with dev.stream_context(self.device_type, stream):
                    self._piece(i, tb)  # warm-up: Triton compiles, the allocator settles
                dev.synchronize(self.device_type)
                g = gcls()
                with dev.graph_context(self.device_type, g, pool=pool, stream=stream):
                    out = self._piece(i, tb)
                graphs.append(g)
                if out is not None:
                    self.hidden_out[tb] = out
            self.graphs[tb] = graphs
        dev.synchronize(self.device_type)

    # ---- a step -------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduleBatch, future_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One EXTEND step; returns float32 logits like the model's ``forward``."""
        r = self.runner
        input_ids, fb = r.build_forward_batch(batch, future_ids)
        t = input_ids.shape[0]
        tb = self.buckets[bisect.bisect_left(self.buckets, t)]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(fb.positions)
        if tb > t:
            self.input_ids[t:tb].zero_()
            self.positions[t:tb].zero_()
        r.attn_backend.init_step(fb)
        graphs = self.graphs.get(tb)
        for i in range(self.num_layers + 1):
            if graphs is not None:
                graphs[i].replay()
                out = self.hidden_out[tb] if i == self.num_layers else None
            else:
                out = self._piece(i, tb)
            if i < self.num_layers:
                self._attention(self.attn_layers[i], t, fb)
        return self.model.compute_logits(out[:t], fb.logits_indices)

    def _attention(self, attn, t: int, fb: ForwardBatch) -> None:
        attn(self.q[:t], self.k[:t], self.v[:t], fb, out=self.attn_out[:t])
