"""``RankRunner``: one rank's model runner: loads the model, sizes the KV pool, runs forward
and sampling.

Device-agnostic: the device, dtype, memory figures and graphs come from ``engine.device``.
The model's shape is ``runner.model_config`` (``engine.models.config.ModelConfig``); the
attention backend is ``--attention-backend`` (default from the device), see
``engine.attention``.

A tensor-parallel worker (rank > 0, ``engine/executor/tp_worker.py``) runs a ``RankRunner``;
rank 0 runs its subclass ``ModelRunner`` (``engine/executor/model_runner.py``), which also
starts and stops the workers' processes, so this module never needs the worker's entry point.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from engine import device as dev
from engine import distributed as tpd
from engine.args import ServerArgs, lora_enabled, num_draft_tokens, prefill_budget
from engine.attention import create_attention_backend, resolve_attention_backend
from engine.executor.forward_batch_builder import StepPools, build_forward_batch
from engine.executor.graph_replay import replay_graphs
from engine.executor.schedule_batch import ScheduleBatch
from engine.executor.tp_images import ImageSender
from engine.executor.tp_messages import IdsMsg, TPMessage, step_msg
from engine.forward_batch import ForwardBatch
from engine.kv.pool import ReqToTokenPool, kv_bytes_per_token
from engine.kv.state_pool import RecurrentStatePool, build_state_pool
from engine.kv.state_snapshots import StateSnapshotPool, default_snapshot_count
from engine.kv.windowed import build_pools, max_window, split_tokens
from engine.layer_spec import CacheKind
from engine.layers import select_ops, small_ops_kind
from engine.layers.linear import pack_cpu_weights
from engine.layers.moe_ep import expert_parallel
from engine.lora.manager import LoRAManager

logger = logging.getLogger(__name__)

# CPU default KV capacity (tokens) when --max-total-tokens is not given
_CPU_DEFAULT_TOKENS = 32768
# bytes kept free on an accelerator for activations, graphs and the sampler
_ACTIVATION_RESERVE = 2 << 30
#: parameter names of an image model's vision tower and projector (replicated under TP)
_VISION_PREFIXES = ("visual.", "vision_tower.", "multi_modal_projector.")


def _vision_note(m: dict) -> str:
    """`` (vision tower X GiB, whole on every rank)`` for a rank report with one, else ``''``."""
    vb = m.get("vision_bytes", 0)
    return f" (vision tower {vb / 2**30:.2f} GiB, whole on every rank)" if vb else ""


class RankRunner:
    """Owns the model, the KV pools and the attention backend on one device.

    With ``--tp-size N`` the runner of rank 0 (a ``ModelRunner``, in the engine process)
    sends the workers of ranks 1..N-1 every forward and every sampled batch
    (:mod:`engine.executor.tp_messages`); a worker's runner (``tp_rank > 0``, a
    ``RankRunner``) holds its shard and never samples.
    """

    def __init__(self, args: ServerArgs, tp_rank: int = 0):
        self.device_type = dev.resolve_device(args.device)
        self.tp_leader = False
        #: a hybrid model's verify step: (each request's state slot, rows per request),
        #: which :meth:`commit_verify` consumes (None outside one)
        self._verify_slots: tuple[list[int], int] | None = None
        #: rank 0 under tensor parallelism: the commits the workers make before their next
        #: step, as (slots, sources)
        self._pending_commits: list[tuple[list[int], list[int]]] = []
        try:
            self._build(self._init_tp(args, tp_rank))
        except BaseException:
            self._abort_tp()
            raise

    def _build(self, args: ServerArgs) -> None:
        """Load the weights, size the KV pool, build the attention backend and graphs."""
        self.args = args
        self.dtype = dev.resolve_dtype(args.dtype, self.device_type)
        self.kv_dtype = dev.resolve_kv_dtype(args.kv_cache_dtype, self.dtype)
        # checked before the weights load: a bad --attention-backend fails in seconds
        self.attention_backend_name = resolve_attention_backend(args.attention_backend,
                                                                self.device_type)
        self._load_weights(args)
        # LoRA adapters: device slots in every projection, before the KV pool takes the rest
        self.lora = LoRAManager.for_args(args, self.model, self.dtype, self.device,
                                         dev.is_accelerator(self.device_type)) \
            if lora_enabled(args) else None
        self.model_config = mc = self.model.model_config
        self.vocab_size = mc.vocab_size
        self.num_layers, self.head_dim = mc.num_layers, mc.head_dim
        # this rank's heads (the model's with tp_size 1)
        self.num_heads = self.model.q_size // mc.head_dim
        self.num_kv_heads = self.model.kv_size // mc.head_dim
        model_ctx = mc.context_length
        self.model_max_context = min(model_ctx, args.context_length or model_ctx)
        # each layer's attention and cache (this rank's heads): the pool and backend read it
        self.layer_specs = [s.per_rank(self.tp.size) for s in self.model.layer_specs()]
        # the layers with a K/V cache (a linear-attention layer keeps a recurrent state in
        # the state pool instead; the attention layers index their K/V among these)
        self.kv_layer_specs = [s for s in self.layer_specs
                               if s.cache != CacheKind.RECURRENT_STATE]
        self._build_state_pool(args)
        self._build_pools(args)
        self.attn_backend = create_attention_backend(
            self.attention_backend_name, self.num_heads, self.num_kv_heads, self.head_dim,
            device_type=self.device_type, device=self.device,
            num_sms=dev.multiprocessor_count(self.device_type), waves=args.decode_attention_waves,
            fused_ops=not args.disable_fused_ops, layer_specs=self.kv_layer_specs,
            kv_dtype=self.kv_dtype)
        self.supports_overlap = dev.is_accelerator(self.device_type)
        self._build_graphs(args)
        logger.info("KV cache: %d tokens (%d layers x %d kv heads x %d dim, %s), page size %d; "
                    "attention backend %s", self.max_total_tokens, len(self.kv_layer_specs),
                    self.num_kv_heads, self.head_dim, str(self.kv_dtype).replace("torch.", ""),
                    args.page_size, self.attention_backend_name)
        if self.state_pool is not None:
            logger.info("%s (--max-running-requests); %d KV tokens for the %d attention "
                        "layers", self.state_pool.memory_line(), self.max_total_tokens,
                        len(self.kv_layer_specs))
            if self.state_snapshots is not None:
                logger.info("%s", self.state_snapshots.memory_line())
        if self.swa_pool is not None:
            logger.info("windowed KV pool: %d tokens for %d sliding-window layers (window %d); "
                        "the %d tokens above hold the other %d layers "
                        "(--swa-full-tokens-ratio %g)", self.swa_total_tokens,
                        self.swa_pool.num_layers, self.swa_pool.window, self.max_total_tokens,
                        self.num_layers - self.swa_pool.num_layers,
                        args.swa_full_tokens_ratio)
        self.rank_memory = tpd.gather_objects(self.memory_report())
        if self.tp.size > 1 and self.tp.rank == 0:
            logger.info("tensor parallel: %d ranks over %s; per rank: %s", self.tp.size,
                        self.tp.backend, "; ".join(
                            f"rank {m['rank']} weights {m['weight_bytes'] / 2**30:.2f} GiB"
                            + _vision_note(m) + f", KV {m['kv_bytes'] / 2**30:.2f} GiB"
                            for m in self.rank_memory))

    def _load_weights(self, args: ServerArgs) -> None:
        """Seed, load the model (``self.model``, ``self.config``, ``self.load_time``) and
        pick its kernels (on the CPU, prepack its linear weights first)."""
        from engine.loader.loader import load_model, pooling_for_args

        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        # pooling (embeddings, scores; engine/layers/pooler.py): None for a generation model
        self.pooling = pooling_for_args(args)
        with expert_parallel(args.ep_size):   # MoE layers partition their experts (--ep-size)
            self.model, self.config = load_model(
                model_path=args.model_path, load_format=args.load_format, dtype=self.dtype,
                device=self.device, seed=args.seed, quantization=args.quantization,
                gguf_dequantize=args.gguf_dequantize, pooling=self.pooling)
        self.load_time = time.perf_counter() - t0
        if (args.speculative_algorithm not in (None, "", "NGRAM")
                and getattr(self.model, "mrope", False)
                and getattr(self.model, "accepts_images", False)):
            # a draft model or head runs without the images' M-RoPE positions: text only
            # (NGRAM's verify step takes them from ``VerifyReq.mm``)
            self.model.accepts_images = False
            self.model.images_off_reason = (
                f"image input is off with --speculative-algorithm {args.speculative_algorithm} "
                "on this model (its draft runs without M-RoPE positions; NGRAM runs with "
                "images); send text only")
            logger.info("%s: image input off (speculative decoding with a draft: no M-RoPE "
                        "positions there; NGRAM runs with images): text only",
                        type(self.model).__name__)
        if self.device_type == "cpu":
            if how := dev.tune_cpu_malloc():
                logger.info("CPU: %s", how)
            # oneDNN's blocked weight layout (execution only: load_model returns plain weights)
            packed = pack_cpu_weights(self.model)
            if packed:
                logger.info("CPU: %d linear weights prepacked for oneDNN "
                            "(FERRY_CPU_PACKED_GEMM=0 turns it off)", packed)
        ops_kind = small_ops_kind(self.device_type, args.disable_fused_ops)
        select_ops(self.model, ops_kind)
        if self.device_type == "cpu":
            logger.info("CPU kernels: %s", {
                "cpu": "ferry's C++ kernels (decode attention, RMSNorm, rotary, SiLU-and-mul; "
                       "FERRY_CPU_KERNELS=0 or --disable-fused-ops: the torch references)",
                "reference": "the torch references (FERRY_CPU_KERNELS=0, "
                             "--disable-fused-ops, or no C++ compiler)"}.get(ops_kind, ops_kind))

    def _build_state_pool(self, args: ServerArgs) -> None:
        """The linear-attention layers' recurrent-state pool (``self.state_pool``, None
        without such layers): one slot per running request (``--max-running-requests``),
        allocated before the KV pool is sized from what memory is left; with speculative
        decoding, a scratch slot per row of the largest verify step (each row's state after
        it, ``engine/kv/state_pool.py``)."""
        most = min(args.speculative_max_batch_size, args.max_running_requests)
        scratch = most * (1 + num_draft_tokens(args)) if args.speculative_algorithm else 0
        self.state_pool, self.state_index = build_state_pool(
            self.layer_specs, args.max_running_requests, self.dtype, self.device, scratch)
        #: the prefix cache's snapshots of those states (engine/kv/state_snapshots.py), or None
        self.state_snapshots = None
        if self.state_pool is None or args.disable_radix_cache:
            return
        n = args.max_state_snapshots
        if n is None:  # a share of what the KV cache would get (it is sized after them)
            per = RecurrentStatePool.bytes_per_slot(self.state_pool.shapes, self.dtype)
            kv = self._kv_capacity() * kv_bytes_per_token(self.kv_layer_specs, self.kv_dtype)
            # every rank holds the same count: rank 0 picks the snapshots, each rank copies
            n = tpd.min_over_ranks(default_snapshot_count(kv, per, args.max_running_requests))
        if n:
            self.state_snapshots = StateSnapshotPool(self.state_pool, n)
            if self.tp_leader:  # its copies go to the workers with the next step
                self.state_snapshots.pending = []

    def _build_pools(self, args: ServerArgs) -> None:
        """The KV pool (sized by :meth:`_kv_capacity`, the smallest over the ranks), the
        ``req_to_token`` rows, and the context they leave a request."""
        self.max_total_tokens = tpd.min_over_ranks(self._kv_capacity())
        # at least what one request needs: its window and a chunk, beside the window a
        # cached prefix it matched keeps locked in the tree
        specs = self.kv_layer_specs
        ratio = self._swa_ratio(args)
        split = split_tokens(specs, self.max_total_tokens, ratio,
                             self.kv_dtype, 2 * max_window(specs)
                             + prefill_budget(args, self.device_type) + 4 * args.page_size)
        if ratio and max_window(specs) and not split.swa_tokens:
            logger.info("windowed KV pool off: %d tokens are too few to split (the windowed "
                        "layers need a window and a chunk)", self.max_total_tokens)
        self.kv_pool, self.swa_pool = build_pools(specs, split, args.page_size,
                                                  self.kv_dtype, self.device)
        self.max_total_tokens = self.kv_pool.capacity_tokens
        #: the windowed layers' slots (0: no windowed pool) and their req_to_token table
        self.swa_total_tokens = self.swa_pool.capacity_tokens if self.swa_pool else 0
        # a request can never outgrow the pool, so the usable context is the smaller of the two
        self.max_context_len = min(self.model_max_context, self.max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests, self.max_context_len,
                                                self.device)
        # rank 0 forwards its req_to_token writes (cached prefixes) with the next step
        self.req_to_token_pool.record_writes = self.tp.size > 1 and self.tp.rank == 0
        self.swa_req_pool = ReqToTokenPool(args.max_running_requests, self.max_context_len,
                                           self.device) if self.swa_pool else None
        #: what :func:`build_forward_batch` writes the step into
        self.pools = StepPools(self.req_to_token_pool, self.kv_pool, self.device,
                               self.swa_pool, self.swa_req_pool, self.state_pool)

    def _swa_ratio(self, args: ServerArgs) -> float:
        """``--swa-full-tokens-ratio``, or 0 (one pool) where the windowed pool is not
        wired yet: tensor parallelism and speculative decoding."""
        ratio = args.swa_full_tokens_ratio
        if ratio and (self.tp.size > 1 or args.speculative_algorithm):
            if self.tp.rank == 0 and max_window(self.layer_specs):
                logger.info("windowed KV pool off: not wired yet with %s",
                            "tensor parallelism" if self.tp.size > 1
                            else "speculative decoding")
            return 0.0
        return ratio

    def _build_graphs(self, args: ServerArgs) -> None:
        """Capture the decode and piecewise graphs where the device has them (see
        ``engine/executor/graph_setup.py``); else every step runs eagerly."""
        self.graph_runner = None
        self.piecewise_runner = None
        self._graph_pool = None
        graphs, why = dev.graphs_enabled(self.device_type, disable=args.disable_cuda_graph,
                                         enable_xpu=args.enable_xpu_graph)
        if graphs and self.tp.size > 1 and not dev.graphs_capture_collectives(self.device_type):
            graphs = False
            if self.tp.rank == 0:
                logger.warning("tensor parallelism on %s: the collectives cannot be captured "
                               "in graphs here, so every step runs eagerly", self.device_type)
        elif not graphs and self.tp.rank == 0 and dev.is_accelerator(self.device_type):
            logger.info("graphs off, every step runs eagerly: %s", why)
        if graphs and args.speculative_algorithm in ("EAGLE", "EAGLE3", "MTP"):
            # the head reads the target's hidden states: the decode graphs capture them too
            # (a model without the hook: the EAGLE proposer names the error at its start)
            with contextlib.suppress(NotImplementedError, ValueError):
                self.model.set_capture_hidden(
                    "aux" if args.speculative_algorithm == "EAGLE3" else "last")
        if self.pooling is not None:  # pooling: prefill only, reading the eager hidden_out
            graphs = False
            self.model.set_capture_hidden("last")
        if graphs:
            from engine.executor.graph_setup import build_graphs

            self.graph_runner, self.piecewise_runner = build_graphs(self)

    # ---- tensor parallelism -------------------------------------------------------------
    def _init_tp(self, args: ServerArgs, tp_rank: int) -> ServerArgs:
        """Pick this rank's device, start the node's workers (rank 0: :meth:`_start_workers`,
        which ``ModelRunner`` provides) and join the group.

        Returns ``args`` with ``dist_init_addr`` filled in (a free local port when unset).
        """
        self.tp_rank = tp_rank
        local_rank = 0
        if args.tp_size > 1:
            per_node = tpd.ranks_per_node(args)
            local_rank = tp_rank % per_node
            if not args.dist_init_addr:
                args = args.replace(dist_init_addr=tpd.free_local_addr())
            if tp_rank == 0:
                self._start_workers(args, list(range(1, per_node)))
        dev.set_device(self.device_type, local_rank)
        self.device = torch.device(self.device_type, local_rank) \
            if dev.is_accelerator(self.device_type) else torch.device("cpu")
        self.tp = tpd.init_tp(args.tp_size, tp_rank, args.dist_init_addr or "",
                              self.device_type)
        #: rank 0 of a group: sends every forward and sampled batch to the other ranks
        self.tp_leader = self.tp.size > 1 and self.tp.rank == 0
        #: rank 0: the image fields of each step message (engine/executor/tp_images.py)
        self.tp_images = ImageSender() if self.tp_leader else None
        self.tp_channel = None
        if self.tp.size > 1:
            self.tp_channel = tpd.StepChannel(self.tp, args.dist_init_addr.rpartition(":")[0],
                                              TPMessage)
        return args

    def _start_workers(self, args: ServerArgs, ranks: list[int]) -> None:
        """Rank 0: start the workers of ``ranks`` on this node, before joining the group."""
        raise RuntimeError("rank 0 of a tensor-parallel group starts the other ranks: build "
                           "it as a ModelRunner (engine.executor.model_runner)")

    def memory_report(self) -> dict:
        """This rank's weight and KV bytes (``/server_info`` shows every rank's); of the
        weights, ``vision_bytes`` are an image model's vision tower and projector, which
        every tensor-parallel rank holds whole (``engine/executor/tp_images.py``)."""
        return {"rank": self.tp.rank,
                "weight_bytes": sum(p.numel() * p.element_size()
                                    for p in self.model.parameters()),
                "vision_bytes": sum(p.numel() * p.element_size()
                                    for n, p in self.model.named_parameters()
                                    if n.startswith(_VISION_PREFIXES)),
                "kv_bytes": self.kv_pool.nbytes,
                "state_bytes": self.state_pool.nbytes if self.state_pool is not None else 0,
                "snapshot_bytes": self.state_snapshots.nbytes
                if self.state_snapshots is not None else 0}

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks (1 without tensor parallelism)."""
        return self.tp.size

    @property
    def max_verify_rows(self) -> int | None:
        """Rows a speculative verify step may have before the linear layers leave their
        small-M kernel (the CPU's packed-weight kernels), or None where there is no such cliff."""
        from engine.layers.quantization.wq import small_m_max_rows

        return small_m_max_rows(self.device_type)

    def _stop_workers(self, timeout: float) -> None:
        """Stop the worker processes this runner started (none; see ``ModelRunner``)."""

    def _abort_tp(self) -> None:
        """The build failed: stop the workers this runner started and leave the group."""
        self.tp_leader = False
        if getattr(self, "tp_channel", None) is not None:
            self.tp_channel.close(0)
        self._stop_workers(timeout=0.0)
        tpd.destroy_tp(timeout=5.0)

    def graph_pool(self):
        """The device graph memory pool shared by the decode and piecewise graphs (they
        never replay concurrently)."""
        if self._graph_pool is None:
            self._graph_pool = dev.graph_pool_handle(self.device_type)
        return self._graph_pool

    def piecewise_max_tokens(self) -> int:
        """Largest EXTEND step for the piecewise graphs: --piecewise-graph-max-tokens, else a
        full prefill chunk plus 256 mixed-in decodes."""
        a = self.args
        n = a.piecewise_graph_max_tokens or (
            prefill_budget(a, self.device_type) + min(a.max_running_requests, 256))
        return max(16, n)

    # ---- sizing -------------------------------------------------------------------------
    def _kv_capacity(self) -> int:
        """KV pool size in tokens: --max-total-tokens, else from free memory after the weights."""
        per_token = kv_bytes_per_token(self.kv_layer_specs, self.kv_dtype)
        if self.args.max_total_tokens:
            return int(self.args.max_total_tokens)
        if not dev.is_accelerator(self.device_type):
            return _CPU_DEFAULT_TOKENS
        mem = dev.memory_info(self.device_type)
        budget = mem.total * self.args.mem_fraction_static - (mem.total - mem.free)
        budget = min(budget, mem.free - _ACTIVATION_RESERVE)
        if budget < per_token * 256:
            raise RuntimeError(
                f"not enough device memory for the KV cache: {budget / 2**30:.2f} GiB left after "
                f"the weights; raise --mem-fraction-static or set --max-total-tokens")
        return int(budget // per_token)

    # ---- forward ------------------------------------------------------------------------
    def build_forward_batch(self, batch: ScheduleBatch, future_ids: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, ForwardBatch]:
        """The step over this runner's pools, backend and adapters: see
        :func:`engine.executor.forward_batch_builder.build_forward_batch`."""
        return build_forward_batch(self.pools, self.attn_backend, batch, self.lora, future_ids)

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch, future_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits ``[batch_size, vocab]`` (last token of each).

        ``future_ids``: the in-flight step's sampled ids [B'] int64 on the device, which
        placeholder input ids refer to (overlap scheduling), or None.
        """
        if self.lora is not None:
            self._prepare_lora(batch)
        if self.tp_leader:
            pool = self.req_to_token_pool
            writes, pool.pending_writes = pool.pending_writes, []
            snaps = self.state_snapshots
            commits, self._pending_commits = self._pending_commits, []
            self.tp_channel.send(step_msg(batch, future_ids is not None, writes,
                                          snaps.take_pending() if snaps is not None else [],
                                          self.tp_images.fields(batch), commits))
        logits = replay_graphs(self, batch, future_ids)  # None: no graph fits, or it raised
        if logits is None:
            input_ids, fb = self.build_forward_batch(batch, future_ids)
            self.attn_backend.init_step(fb)
            logits = self.model(input_ids, fb.positions, fb)
        if batch.verify_n:  # a hybrid model's verify step: commit_verify finishes it
            self._verify_slots = ([r.state_slot for r in batch.reqs[::batch.verify_n]],
                                  batch.verify_n)
        if batch.snap_takes:  # the prefill rows' states after this forward (stream order)
            slots, snaps = zip(*batch.snap_takes)
            self.state_snapshots.save_many(list(slots), list(snaps), record=False)
        return logits

    @torch.inference_mode()
    def commit_verify(self, keep: list[int]) -> None:
        """After a speculative verify step (``ScheduleBatch.verify_n`` = n): request i's
        recurrent states become those after its first ``keep[i]`` rows of the step (its last
        token and the accepted drafts), which the step left in scratch slot
        ``scratch_base + i n + keep[i] - 1`` (``RecurrentStatePool.commit``); the
        tensor-parallel workers make the same copies before their next step. Nothing to do
        without linear-attention layers."""
        verify, self._verify_slots = self._verify_slots, None
        if verify is None:
            return
        slots, n = verify
        base = self.state_pool.scratch_base
        sources = [base + i * n + k - 1 for i, k in enumerate(keep)]
        self.state_pool.commit(slots, sources)
        if self.tp_leader:
            self._pending_commits.append((slots, sources))

    def _prepare_lora(self, batch: ScheduleBatch) -> None:
        """Rank 0: give the batch's requests their adapter slots (``req.lora_id``, None for
        the base model), copying adapters in; a worker: repeat rank 0's copies."""
        if self.tp.rank == 0:
            ids = [getattr(r, "lora_id", None) for r in batch.reqs]
            batch.lora_slots, batch.lora_copies = (
                self.lora.slots_for(ids) if any(i is not None for i in ids) else ([], []))
        else:
            for copy in batch.lora_copies:
                self.lora.load_slot(*copy)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list, eos_ids: list[int]) -> SampleResult:
        """Sample one token per request (rows of ``logits`` [B, vocab] fp32, in ``reqs`` order).

        The ids stay on the device (``ids_dev``) and are copied back asynchronously; call
        ``host()`` on the result to wait for them.
        """
        from engine.sampling.grammar import fill_vocab_mask
        from engine.sampling.sampler import SamplingBatchInfo, sample

        params = [r.sampling_params for r in reqs]
        info = SamplingBatchInfo.from_params(
            params, self.vocab_size, self.device,
            output_ids=[r.output_ids for r in reqs],
            prompt_ids=[r.origin_input_ids for r in reqs],
            steps=[len(r.output_ids) for r in reqs], eos_ids=eos_ids)
        # constrained rows: the grammar's allowed tokens (filled while the forward runs)
        # (a request that finished in the step just read back has a spent matcher: free row)
        info.vocab_mask = fill_vocab_mask(
            [None if r.finished else getattr(r, "grammar", None) for r in reqs],
            self.vocab_size)
        want = [p.logprobs for p in params if p.logprobs is not None]
        out = sample(logits, info, return_logprobs=max(want) if want else None)
        if self.tp_leader:  # the workers resolve the next step's placeholders with these
            self.tp_channel.send(IdsMsg(out.next_token_ids.numel()))
            tpd.broadcast_tensor(out.next_token_ids)
        return SampleResult(out, bool(want), self.device_type)


class SampleResult:
    """Sampled ids on the device plus an asynchronous copy to the host."""

    def __init__(self, out, with_logprobs: bool, device_type: str):
        self.out = out
        self.ids_dev = out.next_token_ids
        self.with_logprobs = with_logprobs
        self._event = None
        if dev.is_accelerator(device_type):
            self._host = torch.empty(self.ids_dev.shape, dtype=self.ids_dev.dtype, pin_memory=True)
            self._host.copy_(self.ids_dev, non_blocking=True)
            self._event = dev.event_class(device_type)()
            self._event.record()
        else:
            self._host = self.ids_dev

    def host(self) -> tuple[list[int], tuple | None]:
        """(token ids, logprobs) where logprobs is (chosen [B], top ids [B][k], top lps [B][k])."""
        if self._event is not None:
            self._event.synchronize()
        ids = self._host.tolist()
        lp = None
        if self.with_logprobs:
            o = self.out
            lp = (o.logprobs.tolist(),
                  o.top_logprobs_ids.tolist() if o.top_logprobs_ids is not None else None,
                  o.top_logprobs.tolist() if o.top_logprobs is not None else None)
        return ids, lp
