"""Build extend/decode ``ForwardBatch``es by hand from lists of token ids (tests only).

``KVState`` owns a ``ReqToTokenPool``, a ``KVPool`` and a ``torch_native`` attention
backend and remembers, per request id, its req_to_token row, its pages and how
many tokens are cached, so successive calls model prefill, chunked prefill (extend with a
cached prefix) and decode the way the model runner does.
"""

from __future__ import annotations

import torch

from engine.attention import create_attention_backend
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kv.pool import KVPool, ReqToTokenPool
from engine.models.config import ModelConfig


class KVState:
    def __init__(self, config, *, num_tokens: int = 1024, max_reqs: int = 8,
                 max_context: int = 256, page_size: int = 1, dtype=torch.float32,
                 device: str = "cpu"):
        mc = ModelConfig.from_hf(config)
        self.device = device
        self.req_pool = ReqToTokenPool(max_reqs, max_context, device)
        self.kv_pool = KVPool(num_tokens, page_size, mc.num_layers, mc.num_kv_heads,
                              mc.head_dim, dtype, device)
        self.backend = create_attention_backend("torch_native", mc.num_heads, mc.num_kv_heads,
                                                mc.head_dim, device=device)
        self.rows: dict = {}
        self.pages: dict = {}
        self.lens: dict = {}

    def _reserve(self, rid, n_new: int) -> tuple[int, list[int]]:
        """Row of ``rid`` and the slots of its next ``n_new`` positions (written to the row)."""
        if rid not in self.rows:
            row = self.req_pool.alloc()
            assert row is not None, "out of req_to_token rows"
            self.rows[rid], self.pages[rid], self.lens[rid] = row, [], 0
        row, cur = self.rows[rid], self.lens[rid]
        need = self.kv_pool.pages_needed(cur, len(self.pages[rid]), n_new)
        got = self.kv_pool.alloc_pages(need)
        assert got is not None, "out of KV pages"
        self.pages[rid].extend(got)
        slots = self.kv_pool.slots_for(self.pages[rid], cur, cur + n_new)
        self.req_pool.req_to_token[row, cur: cur + n_new] = torch.tensor(slots, dtype=torch.int32)
        self.lens[rid] = cur + n_new
        return row, slots

    def free(self, rid) -> None:
        self.kv_pool.free_pages(self.pages.pop(rid))
        self.req_pool.free(self.rows.pop(rid))
        self.lens.pop(rid)

    def _batch(self, mode, reqs, all_logits: bool):
        dev = self.device
        ids, pos, locs, rows, seq, ext, pre, start = [], [], [], [], [], [], [], []
        for rid, toks in reqs:
            prefix = self.lens.get(rid, 0)
            row, slots = self._reserve(rid, len(toks))
            start.append(len(ids))
            ids += list(toks)
            pos += range(prefix, prefix + len(toks))
            locs += slots
            rows.append(row)
            seq.append(prefix + len(toks))
            ext.append(len(toks))
            pre.append(prefix)

        def t(x, dt):
            return torch.tensor(x, dtype=dt, device=dev)

        last = [s + n - 1 for s, n in zip(start, ext)]
        fb = ForwardBatch(
            mode=mode, batch_size=len(reqs), positions=t(pos, torch.int64),
            req_pool_indices=t(rows, torch.int64), seq_lens=t(seq, torch.int32),
            out_cache_loc=t(locs, torch.int64), req_to_token=self.req_pool.req_to_token,
            k_buffers=self.kv_pool.k_buffers, v_buffers=self.kv_pool.v_buffers,
            attn_backend=self.backend, max_seq_len=max(seq), seq_lens_cpu=seq,
            logits_indices=None if all_logits else t(last, torch.int64))
        if mode == ForwardMode.EXTEND:
            fb.extend_seq_lens = t(ext, torch.int32)
            fb.extend_prefix_lens = t(pre, torch.int32)
            fb.extend_start_loc = t(start, torch.int32)
            fb.max_extend_len = max(ext)
            fb.extend_seq_lens_cpu = ext
        self.backend.init_forward(fb)
        return t(ids, torch.int64), fb.positions, fb

    def extend(self, reqs: list[tuple[object, list[int]]], all_logits: bool = True):
        """One extend step: each ``(rid, new_token_ids)`` continues after its cached tokens.

        Returns ``(input_ids [T] int64, positions [T] int64, ForwardBatch)``; logits_indices
        is None (all T rows) when ``all_logits`` else the last row of each request.
        """
        return self._batch(ForwardMode.EXTEND, reqs, all_logits)

    def decode(self, reqs: list[tuple[object, int]]):
        """One decode step: one new token per ``(rid, token_id)``; logits for each request."""
        return self._batch(ForwardMode.DECODE, [(rid, [tok]) for rid, tok in reqs], False)
