"""EAGLE draft heads (``--speculative-algorithm EAGLE`` and ``EAGLE3``) and their proposer.

An EAGLE head is one small decoder over the target's own features: at position j it reads
the target's hidden state of position j with the embedding of token j + 1 and predicts the
feature, and through an LM head the token, of position j + 1 (Li et al. 2024, EAGLE; Li et
al. 2025, EAGLE-3). The target exposes those hidden states from the forwards it runs
anyway (``CausalLM.set_capture_hidden``): no second target pass.

- EAGLE-1/2 (SGLang's ``LlamaForCausalLMEagle``): ``fc`` ``[hidden, 2 * hidden]`` (with
  bias) over ``concat(embed(token), target's final normed hidden)``, then Llama decoder
  layers ``layers.i.*`` (layer 0 without its input norm), no final norm; the output
  ``hidden + residual`` feeds the target's LM head, and the next draft step.
- EAGLE-3 (SGLang's and vLLM's ``LlamaForCausalLMEagle3``): ``fc`` ``[hidden, 3 *
  target_hidden]`` fuses the target's low/mid/high states (the inputs of layers 2, L/2 and
  L-3); ``midlayer.*`` is one decoder layer whose attention reads ``concat(
  input_layernorm(embed(token)), hidden_norm(h))`` (q/k/v of width ``2 * hidden``); ``norm``
  then its own ``lm_head`` ``[draft_vocab_size, hidden]``; draft id ``i`` is target id ``i +
  d2t[i]``. The pre-norm output feeds the next step (``fc`` is skipped there). Without
  ``embed_tokens.weight`` the target's embedding is used, without ``lm_head.weight`` its LM
  head (then ``draft_vocab_size`` is the vocabulary).

Checkpoint names may carry a ``model.`` prefix; ``t2d`` (its inverse map) is not needed.
The head's KV (its own small pool, one layer) and the chain are ``ModelProposer``'s
(``engine/speculative/draft.py``); drafts are greedy, a chain (topk 1). On an accelerator
with graphs a round replays the head's own graphs (``engine/speculative/head_graphs.py``).
"""

from __future__ import annotations

import glob
import logging
import os

import torch
from torch import nn

from engine.args import ServerArgs, num_draft_tokens, prefill_budget
from engine.executor.forward_batch_builder import StepPools, build_forward_batch
from engine.speculative.draft import DraftSeq, ModelProposer, draft_pool_tokens

logger = logging.getLogger(__name__)

#: target hidden-state rows a request may hold for its head before the oldest are dropped
#: (a request that keeps decoding in batches too large to speculate)
MAX_PENDING_ROWS = 2048


class EagleHead(nn.Module):
    """The draft head's modules and forward (see the module docstring).

    Args:
        config: the head's HF config (Llama fields; EAGLE-3's ``draft_vocab_size`` and
            ``target_hidden_size``).
        eagle3: EAGLE-3's layout, else EAGLE-1/2's.
        target: the target's model (``CausalLM``): its embedding and LM head when the
            checkpoint has none.
        dtype: the run dtype.
    """

    def __init__(self, config, eagle3: bool, target, dtype: torch.dtype):
        super().__init__()
        from engine.layers.linear import QKVLinear, ReplicatedLinear, VocabEmbedding
        from engine.layers.norm import RMSNorm
        from engine.layers.rotary import RotaryEmbedding
        from engine.models.base import full_attention_specs
        from engine.models.blocks import AttentionOptions, DecoderLayer
        from engine.models.config import ModelConfig

        self.mc = mc = ModelConfig.from_hf(config)
        self.eagle3 = eagle3
        self.__dict__["target"] = target  # not a submodule: its weights are not the head's
        h = mc.hidden_size
        self.hidden_size = h
        opts = AttentionOptions(qkv_bias=mc.attention_bias, o_bias=mc.attention_bias)
        specs = full_attention_specs(mc)
        if eagle3:
            th = getattr(config, "target_hidden_size", None) or h
            self.fc = ReplicatedLinear(3 * th, h, bool(getattr(config, "bias", False)), dtype)
            self.midlayer = DecoderLayer(mc, specs[0], 0, dtype, opts)
            attn = self.midlayer.self_attn
            attn.qkv_proj = QKVLinear(2 * h, mc.head_dim, mc.num_heads, mc.num_kv_heads,
                                      False, dtype)
            self.midlayer.hidden_norm = RMSNorm(h, mc.rms_norm_eps, dtype)
            self.norm = RMSNorm(h, mc.rms_norm_eps, dtype)
            self.draft_vocab = getattr(config, "draft_vocab_size", None) or mc.vocab_size
            self.lm_head = VocabEmbedding(self.draft_vocab, h, dtype)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64))
        else:
            self.fc = ReplicatedLinear(2 * h, h, True, dtype)
            self.layers = nn.ModuleList(DecoderLayer(mc, specs[i], i, dtype, opts)
                                        for i in range(mc.num_layers))
            self.layers[0].input_layernorm = nn.Identity()
            self.lm_head = None
        self.dtype = dtype
        self.embed_tokens = None  # the checkpoint's own embedding, if it has one
        self.own_lm_head = False
        # the head runs at the target's positions (published heads say 2048, their targets
        # run longer)
        max_pos = max(mc.max_position_embeddings, target.model_config.max_position_embeddings)
        self.rotary_emb = RotaryEmbedding(mc.head_dim, max_pos, mc.rope_theta,
                                          mc.rope_parameters)

    @property
    def num_layers(self) -> int:
        """Decoder layers, each with its own KV in the head's pool."""
        return 1 if self.eagle3 else len(self.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else \
            self.target.model.embed_tokens
        return table(ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                fb) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over T rows.

        Args:
            input_ids: [T] int64 (token j + 1 for row j); positions: [T] int64 (j).
            hidden: [T, 3 * target hidden] (EAGLE-3, the target's), [T, hidden] (EAGLE-1/2's
                target state, or the head's own output of the previous draft step).
        Returns:
            ``(for_logits, next_hidden)``, both [T, hidden]: what the LM head reads, and
            what the next draft step takes as ``hidden``.
        """
        emb = self.embed(input_ids)
        if not self.eagle3:
            x = self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, self.rotary_emb, positions, fb)
            out = x + residual
            return out, out
        h = hidden.to(emb.dtype)
        if h.shape[-1] != self.hidden_size:
            h = self.fc(h)
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], dim=-1)
        q, k, v = layer.self_attn.project_qkv(x, self.rotary_emb, positions)
        x, residual = layer.post_attn(layer.self_attn.attn(q, k, v, fb), h)
        return self.norm(x, residual)

    def greedy(self, for_logits: torch.Tensor) -> torch.Tensor:
        """Rows [B, hidden] -> the greedy next token of each, as target ids [B] int64."""
        if self.own_lm_head:
            w = self.lm_head.weight[:self.draft_vocab]
            ids = torch.argmax(torch.nn.functional.linear(for_logits, w).float(), dim=-1)
            return ids + self.d2t[ids] if self.eagle3 else ids
        return torch.argmax(self.target.compute_logits(for_logits, None), dim=-1)

    # ---- weights ------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Load the checkpoint's tensors (names as in the module docstring).

        Raises:
            ValueError: a tensor of the wrong shape, an unknown tensor, or a missing one.
        """
        from engine.layers.linear import VocabEmbedding, default_weight_loader
        from engine.models.weights import STACKED_PARAMS

        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "d2t":
                if not self.eagle3 or tensor.shape != self.d2t.shape:
                    raise ValueError(f"d2t of shape {tuple(tensor.shape)} does not fit the "
                                     f"head (draft vocabulary {getattr(self, 'draft_vocab', 0)})")
                self.d2t.copy_(tensor.to(torch.int64))
                continue
            if name == "layers.0.input_layernorm.weight" and not self.eagle3:
                continue  # EAGLE-1 skips layer 0's input norm
            if name == "lm_head.weight" and not self.eagle3:
                continue  # EAGLE-1/2 read the target's LM head
            if name == "embed_tokens.weight" and self.embed_tokens is None:
                with torch.device(self.fc.weight.device):
                    self.embed_tokens = VocabEmbedding(self.mc.vocab_size, self.hidden_size,
                                                       self.dtype)
                params = dict(self.named_parameters())
            shard = None
            for fused, part, sid in STACKED_PARAMS:
                if f".{part}." in name:
                    name, shard = name.replace(f".{part}.", f".{fused}."), sid
                    break
            p = params.get(name)
            if p is None:
                raise ValueError(f"unknown tensor {name!r} in the EAGLE checkpoint")
            loader = getattr(p, "weight_loader", default_weight_loader)
            loader(p, tensor, shard) if shard is not None else loader(p, tensor)
            loaded.add(name if shard is None else f"{name}:{shard}")
        self.own_lm_head = "lm_head.weight" in loaded
        if self.eagle3 and not self.own_lm_head and self.draft_vocab != self.mc.vocab_size:
            raise ValueError("the EAGLE-3 checkpoint has no lm_head.weight but a draft "
                             f"vocabulary of {self.draft_vocab}")
        need = set()
        for name, _ in self.named_parameters():
            if name.startswith(("embed_tokens.", "lm_head.")):
                continue
            fused = [sid for f, _, sid in STACKED_PARAMS if f".{f}." in name]
            need.update({f"{name}:{s}" for s in fused} if fused else {name})
        missing = sorted(need - loaded)
        if missing:
            raise ValueError(f"the EAGLE checkpoint lacks {', '.join(missing[:6])}")


def load_eagle_head(path: str, eagle3: bool, target, dtype: torch.dtype,
                    device: torch.device, ops_kind: str = "reference",
                    dummy: bool = False, seed: int = 0) -> EagleHead:
    """Build the head from ``path`` (``config.json`` + ``*.safetensors``) on ``device``;
    with ``dummy`` (``--load-format dummy``) a directory with only ``config.json``, or a
    config ``.json`` file, gets seeded random weights (benchmarks of the step cost: such a head's drafts are rarely
    accepted).

    Raises:
        FileNotFoundError: no config or no safetensors file; ValueError: as
            :meth:`EagleHead.load_weights`, or a hidden size that does not fit the target.
    """
    from transformers import AutoConfig

    from engine.layers import select_ops
    from engine.loader.weights import iter_safetensors

    flag = "--speculative-draft-model-path"
    is_json = path.endswith(".json") and os.path.isfile(path)  # a bare config (dummy only)
    if not is_json and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{flag} {path}: no config.json")
    files = [] if is_json else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files and not dummy:
        raise FileNotFoundError(f"{flag} {path}: no *.safetensors file (or pass "
                                "--load-format dummy for a random head)")
    config = AutoConfig.from_pretrained(path)
    tmc = target.model_config
    th = getattr(config, "target_hidden_size", None) or config.hidden_size
    if th != tmc.hidden_size or (not eagle3 and config.hidden_size != tmc.hidden_size):
        raise ValueError(f"{flag} {path}: the head reads hidden states of width {th}, the "
                         f"target's are {tmc.hidden_size}")
    if config.vocab_size != tmc.vocab_size:
        raise ValueError(f"{flag} {path}: the head's vocabulary has {config.vocab_size} ids, "
                         f"the target's {tmc.vocab_size}")
    with torch.device(device):
        head = EagleHead(config, eagle3, target, dtype)
    try:
        head.load_weights(iter_safetensors(files) if files else _random_weights(head, seed))
    except ValueError as e:
        raise ValueError(f"{flag} {path}: {e}") from None
    select_ops(head, ops_kind)
    return head.eval()


def _random_weights(head: EagleHead, seed: int):
    """Checkpoint-named random tensors for ``head`` (norms 1, the rest N(0, 0.02))."""
    from engine.models.weights import STACKED_PARAMS

    g = torch.Generator().manual_seed(seed)
    parts = {f: [(p, sid) for ff, p, sid in STACKED_PARAMS if ff == f]
             for f, _, _ in STACKED_PARAMS}
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens."):
            continue
        fused = next((f for f in parts if f".{f}." in name), None)
        if fused is None:
            shape, outs = tuple(p.shape), [(name, None)]
        else:  # the unfused checkpoint parts of a fused parameter
            mod = head.get_submodule(name.rsplit(".", 2)[0] + "." + fused)
            sizes = ([mod.q_size, mod.kv_size, mod.kv_size] if fused == "qkv_proj"
                     else [p.shape[0] // 2] * 2)
            outs = [(name.replace(f".{fused}.", f".{part}."), n)
                    for (part, _), n in zip(parts[fused], sizes)]
        for out, rows in outs:
            shape = tuple(p.shape) if rows is None else (rows, p.shape[1])
            t = torch.ones(shape) if "norm" in out else torch.randn(shape, generator=g) * 0.02
            yield out, t


class EagleProposer(ModelProposer):
    """Greedy chains from an EAGLE or EAGLE-3 head fed by the target's hidden states.

    Per request the proposer keeps the target's hidden states of the positions its head has
    not taken in yet (``DraftSeq.hidden``): every target forward leaves them
    (:meth:`observe`, from the scheduler's steps and the verify step), the next proposal
    feeds them in (:meth:`catch_up`). A radix-cache prefix or a preemption leaves positions
    without hidden states: the head then starts at the first position it has, and a gap
    restarts it; the drafts get worse there, never the output.

    Args:
        args: the server arguments (algorithm, head path, prefill budget).
        target: the target's runner; its model keeps hidden states from now on (its decode
            graphs keep them too, ``GraphRunner``; piecewise graphs do not and are off).
    """

    def __init__(self, args: ServerArgs, target):
        from engine.kv.pool import ReqToTokenPool

        self.target = target
        eagle3 = args.speculative_algorithm == "EAGLE3"
        model = target.model
        try:
            model.set_capture_hidden("aux" if eagle3 else "last")
        except (NotImplementedError, ValueError) as e:
            raise ValueError(f"--speculative-algorithm {args.speculative_algorithm}: {e}") \
                from None
        # graphs captured without the hidden states would hand the head none: off (the
        # runner sets the capture before its graphs, so its decode graphs keep them)
        if target.graph_runner is not None and not getattr(target.graph_runner, "hidden", None):
            logger.warning("%s: the target's decode graphs run eagerly (captured without the "
                           "hidden states the head reads)", args.speculative_algorithm)
            target.graph_runner = None
        if target.piecewise_runner is not None:
            logger.warning("%s: prefill and mixed steps run eagerly (piecewise graphs do not "
                           "keep the hidden states)", args.speculative_algorithm)
            target.piecewise_runner = None
        self.device = target.device
        self.head = self._load_head(args, target)
        self.kv_pool, self.attn_backend = self._head_kv(args, target)
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests,
                                                target.max_context_len, target.device)
        self.pools = StepPools(self.req_to_token_pool, self.kv_pool, self.device)
        super().__init__(self.kv_pool, self.req_to_token_pool,
                         prefill_budget(args, target.device_type))
        #: the head's draft rounds (catch-up + chain) as device graphs, where the target's
        #: decode steps have theirs (``engine/speculative/head_graphs.py``); None: eager
        self.head_graphs = None
        if target.graph_runner is not None and self.attn_backend.supports_graphs:
            from engine import device as dev
            from engine.speculative.head_graphs import HeadGraphRunner, check_head_graphs

            bs = args.speculative_max_batch_size  # catch-ups: k + 1 rows each, or back-offs
            self.head_graphs = dev.capture_or_eager(
                target.device_type, "EAGLE head graphs",
                lambda: HeadGraphRunner(self, bs, max(64, bs * (1 + num_draft_tokens(args))),
                                        target.graph_pool(),
                                        steps=max(0, num_draft_tokens(args) - 1)))
            if self.head_graphs is not None and not dev.graph_check_skipped():
                ok, detail = check_head_graphs(self, self.head_graphs)
                log = logger.info if ok else logger.warning
                log("EAGLE head graphs: a replay %s the eager step (%s)%s",
                    "matches" if ok else "differs from", detail,
                    "" if ok else "; the head's draft steps run eagerly")
                self.head_graphs = self.head_graphs if ok else None
        self._log_head(args)

    # ---- what MTP (engine/speculative/mtp.py) replaces --------------------------------------
    def _load_head(self, args: ServerArgs, target):
        """The draft head (:class:`EagleHead` from ``--speculative-draft-model-path``)."""
        from engine.layers import small_ops_kind

        return load_eagle_head(args.speculative_draft_model_path,
                               args.speculative_algorithm == "EAGLE3", target.model,
                               target.dtype, target.device,
                               small_ops_kind(target.device_type, args.disable_fused_ops),
                               dummy=args.load_format == "dummy", seed=args.seed)

    def _head_kv(self, args: ServerArgs, target):
        """``(kv_pool, attention backend)`` of the head's layers (a paged K/V pool)."""
        from engine.attention import create_attention_backend
        from engine.kv.pool import KVPool

        mc = self.head.mc
        pool = KVPool(draft_pool_tokens(args, target), args.page_size, self.head.num_layers,
                      mc.num_kv_heads, mc.head_dim, target.kv_dtype, target.device)
        backend = create_attention_backend(
            target.attention_backend_name, mc.num_heads, mc.num_kv_heads, mc.head_dim,
            device_type=target.device_type, device=target.device,
            fused_ops=not args.disable_fused_ops)
        return pool, backend

    def _log_head(self, args: ServerArgs) -> None:
        logger.info("%s head %s: %d layer(s), hidden %d%s", args.speculative_algorithm,
                    args.speculative_draft_model_path, self.head.num_layers,
                    self.head.mc.hidden_size, f", draft vocabulary {self.head.draft_vocab}"
                    if self.head.eagle3 else "")

    # ---- the target's hidden states -----------------------------------------------------
    def observe(self, batch) -> None:
        super().observe(batch)
        h = self.target.model.hidden_out
        if h is None:
            return
        self.target.model.hidden_out = None
        row = 0
        for r, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            req = getattr(r, "req", r)  # a verify step's VerifyReq wraps the request
            self._take(req, p, h[row:row + n])
            row += n

    def _take(self, req, p: int, rows: torch.Tensor) -> None:
        """Keep the target's hidden states of positions ``p .. p + len(rows) - 1``."""
        seq = self.seqs.get(req.rid)
        if seq is None:
            seq = self.seqs[req.rid] = DraftSeq(req, base=p)
        end = seq.hidden_start + seq.hidden_rows
        if p > end or p < seq.base:
            self.reset(seq, p)  # a gap (or a restart before the head's first position)
        elif p < end:  # recomputed positions (after rejected drafts, or a cut run)
            if p >= seq.hidden_start:
                keep = p - seq.hidden_start
                seq.hidden = [torch.cat(seq.hidden)[:keep]] if keep else []
                seq.hidden_rows = keep
            else:
                self.truncate(seq, p - seq.base)
                seq.hidden, seq.hidden_rows, seq.hidden_start = [], 0, p
        seq.hidden.append(rows)
        seq.hidden_rows += rows.shape[0]
        if len(seq.hidden) > 16:  # a copy of its own rows: the steps' tensors can go
            seq.hidden = [torch.cat(seq.hidden)]
        if seq.hidden_rows > MAX_PENDING_ROWS:
            keep = torch.cat(seq.hidden)[-(MAX_PENDING_ROWS // 2):]
            self.reset(seq, seq.hidden_start + seq.hidden_rows - keep.shape[0])
            seq.hidden, seq.hidden_rows = [keep], keep.shape[0]

    # ---- the chain ----------------------------------------------------------------------
    def catch_up(self, seq: DraftSeq, req):
        """The pairs (hidden of position j, token j + 1) from the head's next position up
        to the request's last token; None without the target's states up to there."""
        L = req.seq_len
        e = seq.base + seq.kv_len
        if seq.hidden_start != e:
            self.reset(seq, L - 1)  # out of step (a failed allocation): start afresh
            return None
        n = L - 1 - e
        if n <= 0 or seq.hidden_start + seq.hidden_rows < L - 1:
            return None
        rows = torch.cat(seq.hidden)
        rest = rows[n:]
        seq.hidden, seq.hidden_rows = ([rest] if rest.shape[0] else []), rest.shape[0]
        seq.hidden_start += n
        return req.tokens(e + 1, n), rows[:n]

    def after_propose(self, seq: DraftSeq) -> None:
        # entries fed by the head's own states are not the target's: drop them
        self.truncate(seq, seq.hidden_start - seq.base)

    def draft_round(self, work, out, ks) -> bool:
        from engine.speculative.head_graphs import draft_round

        return self.head_graphs is not None and draft_round(self, self.head_graphs, work,
                                                            out, ks)

    def decode_chain(self, live, out, ks) -> bool:
        from engine.speculative.head_graphs import draft_chain

        return self.head_graphs is not None and draft_chain(self, self.head_graphs, live,
                                                            out, ks)

    def forward(self, batch, seqs, hidden):
        # the head's own pools and backend; no LoRA in the head
        input_ids, fb = build_forward_batch(self.pools, self.attn_backend, batch)
        self.attn_backend.init_forward(fb)
        base = [s.base for s, n in zip(seqs, batch.extend_lens) for _ in range(n)]
        positions = fb.positions + torch.tensor(base, dtype=torch.int64).to(self.device)
        for_logits, nxt = self.head(input_ids, positions, hidden, fb)
        rows = fb.logits_indices
        if rows is not None:
            for_logits, nxt = for_logits.index_select(0, rows), nxt.index_select(0, rows)
        return self.head.greedy(for_logits), nxt
