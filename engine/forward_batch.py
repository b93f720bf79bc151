"""``ForwardBatch``: the device-side description of one model step.

The host-side batch is a ``ScheduleBatch`` (``engine/executor/schedule_batch.py``); the model
runner turns it into this, which the model, its layers and the attention backend read.
Shapes (T = tokens in the step, B = requests):

  input_ids         [T] int64   (passed to the model separately)
  positions         [T] int64
  req_pool_indices  [B] int64   rows of req_to_token
  seq_lens          [B] int32   KV length of each request after this step
  out_cache_loc     [T] int64   pool slot that each new token's K/V is written to
  extend_seq_lens   [B] int32   new tokens per request (EXTEND only)
  extend_prefix_lens[B] int32   tokens already cached per request (EXTEND only)
  extend_start_loc  [B] int32   offset of each request's first new token in T (EXTEND only)
  logits_indices    [B] int64   rows of the hidden states whose logits are sampled
  lora_segments     LoRASegments: each request's rows and adapter slot (a model with
                    adapters), else None
  state             RecurrentStateView: the linear-attention layers' pool tensors and each
                    request's state slot (a model with ``RECURRENT_STATE`` layers), else None
  mrope_positions   [3, T] int64 multimodal-RoPE positions (a step with an image request:
                    ``engine/mm_inputs.py``), else None
  mm_segments       per image request of an EXTEND step ``(MMInputs, prefix, new tokens,
                    row of its first new token)``, else None
  key_limit         [Te] int32 per extend row: the new keys of its request its query sees
                    (``i + 1`` causal; the span's end inside a bidirectional image span,
                    Gemma 3), or None: causal (the extend kernels' ``key_limit``)

A mixed EXTEND step (chunked prefill with the running decodes) ends with ``num_decodes``
one-token requests (the last ``num_decodes`` tokens of T); attention runs the first
``num_extends`` requests with the extend kernel and that tail with the decode kernel.

``attn_backend`` (an ``engine.attention.AttentionBackend``) fills ``attn_meta`` (its
``AttentionMetadata``, or None for a step without decodes) once per step in ``init_forward``.

This module sits below the attention backends, the layers, the models and the executor, all
of which read a ``ForwardBatch``; it imports none of them (``attn_backend`` is typed ``Any``:
the backends import this module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch


class ForwardMode(IntEnum):
    EXTEND = 1   # prefill, with or without a cached prefix (also chunked prefill)
    DECODE = 2   # one new token per request


@dataclass
class AttentionMetadata:
    """Per-step state shared by every layer: what the decode path reads.

    Built by ``AttentionBackend.init_forward`` (:mod:`engine.attention.base`) for a step with
    decode requests (all of a DECODE step, the ``num_decodes`` tail of a mixed EXTEND step)
    and stored in ``ForwardBatch.attn_meta``; None for a step without decodes. Backends
    subclass it to add their own fields.

    Attributes:
        num_decodes: decode requests in the step (Bd).
        req_pool_indices: ``[Bd]`` int64 rows of ``req_to_token`` of those requests.
        seq_lens: ``[Bd]`` int32 KV lengths (tokens, the new one included).
    """

    num_decodes: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class LoRASegments:
    """One step's adapter segments, one per request: request i's rows ``[starts[i],
    starts[i] + lens[i])`` of T use adapter slot ``slots[i]`` (-1: the base model).

    Filled by ``engine.executor.forward_batch_builder.build_forward_batch`` for a model with
    adapters, which hands them to the model's ``LoRAManager`` (its shared ``LoRABatch`` is
    what the layers read).

    Attributes:
        starts, lens, slots: [B] host ints (offsets and lengths in tokens).
        tensors: the three as [B] int32 device tensors ``(start, len, slot)`` when the LoRA
            kernels read them there (Triton path, a step with an adapter row), else None.
    """

    starts: list[int]
    lens: list[int]
    slots: list[int]
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class RecurrentStateView:
    """One step's view of the recurrent-state pool (``engine/kv/state_pool.py``), for the
    linear-attention layers; filled by the step's builder.

    Attributes:
        conv_states: per linear layer (pool order), ``[slots + 1, C, W - 1]`` (in place).
        recurrent_states: per linear layer, ``[slots + 1, Hv, K, V]`` float32 (in place).
        slots: ``[B]`` int64 on the device, each request's slot, in batch order (0: padding).
        cu_seqlens: ``B + 1`` host ints, the cumulative new-token counts of the requests.
        cu_seqlens_dev: the same as an int64 device tensor ``[B + 1]`` (the GPU kernels').
        verify_n: a speculative verify step's rows per request (``ScheduleBatch.verify_n``;
            ``engine/layers/gated_deltanet.py``), 0 in every other step.
        scratch_base: the pool's first scratch slot (``RecurrentStatePool.scratch_base``),
            where a verify step writes the state after each of its rows.
        prefill_cu: an EXTEND step on an accelerator: the prefill rows' (those before the
            decode tail) cumulative counts as ``(int64 device tensor [n + 1], int64 CPU tensor
            [n + 1])``, built once so that every layer passes the same two objects (FLA caches
            its chunk indices by tensor identity, and with the CPU twin needs no host sync);
            None otherwise.
    """

    conv_states: list[torch.Tensor]
    recurrent_states: list[torch.Tensor]
    slots: torch.Tensor
    cu_seqlens: list[int]
    cu_seqlens_dev: torch.Tensor | None = None
    verify_n: int = 0
    scratch_base: int = 0
    prefill_cu: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    attn_backend: Any = None  # an engine.attention.AttentionBackend
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    max_extend_len: int = 0
    max_seq_len: int = 0
    num_decodes: int = 0
    logits_indices: torch.Tensor | None = None
    # host copies, so the CPU path and block sizing need no device sync
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    # the backend's per-step state (decode rows, KV split counts), set by its init_forward
    attn_meta: AttentionMetadata | None = None
    # the step's LoRA segments (a model with adapters; None without, and in graph replays)
    lora_segments: LoRASegments | None = None
    # the windowed layers' view of the step (engine/kv/windowed.py): the same step with the
    # windowed pool's req_to_token and out_cache_loc, its own attn_meta; None: no such pool
    swa: ForwardBatch | None = None
    # the linear-attention layers' state slots (engine/kv/state_pool.py); None: no such layers
    state: RecurrentStateView | None = None
    # image requests (engine/mm_inputs.py): the step's M-RoPE positions [3, T] int64 and,
    # per image request of an EXTEND step, (MMInputs, prefix, extend length, first row);
    # None: no request of the step has images (graph replays never do)
    mrope_positions: torch.Tensor | None = None
    mm_segments: list[tuple[Any, int, int, int]] | None = None
    # bidirectional image spans of the extend rows (see the module docstring); None: causal
    key_limit: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.mode == ForwardMode.DECODE

    @property
    def is_extend(self) -> bool:
        return self.mode == ForwardMode.EXTEND

    @property
    def num_extends(self) -> int:
        """Requests that run extend attention: all but the decode tail (0 in DECODE)."""
        return 0 if self.is_decode else self.batch_size - self.num_decodes


def resolve_placeholders(input_ids: torch.Tensor, future_ids: torch.Tensor | None) -> torch.Tensor:
    """Replace placeholder ids ``-(k + 1)`` by ``future_ids[k]`` on the device, without a sync.

    Overlap scheduling launches step N+1 before step N's sampled ids reach the host; the
    requests of step N then carry placeholders that point into step N's sampled-id tensor.
    """
    if future_ids is None:
        return input_ids
    idx = (-input_ids - 1).clamp(min=0, max=future_ids.shape[0] - 1)
    return torch.where(input_ids < 0, future_ids[idx], input_ids)
