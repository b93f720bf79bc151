"""``StepRunner``: what the scheduler and the speculative worker use of a model runner.

``ModelRunner`` / ``RankRunner`` (``engine/executor/model_runner.py``, ``rank_runner.py``)
provide it; the scheduler's tests drive the scheduler with small fakes that provide it too.
Nothing outside this list is read from a runner by ``engine/scheduler/`` or
``engine/speculative/worker.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from engine.executor.schedule_batch import ScheduleBatch
    from engine.kv.pool import KVPool, ReqToTokenPool
    from engine.kv.state_pool import RecurrentStatePool
    from engine.kv.state_snapshots import StateSnapshotPool
    from engine.layer_spec import LayerSpec
    from engine.layers.pooler import PoolingSpec
    from engine.lora.manager import LoRAManager


class SampledIds(Protocol):
    """A step's sampled ids: on the device now, on the host after ``host()``."""

    #: the sampled ids, int64 ``[rows]`` on the runner's device (the next step may read
    #: them as placeholders before they reach the host)
    ids_dev: torch.Tensor

    def host(self) -> tuple[list[int], tuple | None]:
        """The ids as a list (waits for the device), and the logprobs
        ``(chosen, top ids, top logprobs)`` per row when any row asked for them, else None."""
        ...


class StepRunner(Protocol):
    """A model runner as a scheduler drives it."""

    #: the ``req_to_token`` rows (one per running request, positions -> KV slots)
    req_to_token_pool: ReqToTokenPool
    #: the paged KV pool
    kv_pool: KVPool
    #: ``"cuda"``, ``"xpu"`` or ``"cpu"``
    device_type: str
    #: V, the width of the logits
    vocab_size: int
    #: whether a step may be launched before the previous one is read back (an accelerator)
    supports_overlap: bool
    #: the LoRA adapters' manager (``acquire``/``release`` per request), or None without LoRA
    lora: LoRAManager | None
    #: tensor-parallel ranks (1 without tensor parallelism)
    tp_size: int
    #: the longest sequence (prompt + output tokens) a request may have
    max_context_len: int
    #: rows a speculative verify step may have before the linear layers leave their small-M
    #: kernel (many times slower per row past it), or None where there is no such cliff
    max_verify_rows: int | None
    #: a pooling engine's ``PoolingSpec`` (prefill only, answered by ``pool``), or None for
    #: a generation engine
    pooling: PoolingSpec | None
    #: this rank's layers (attention and cache kind of each; ``engine/layer_spec.py``)
    layer_specs: Sequence[LayerSpec]
    #: the windowed layers' KV pool and its ``req_to_token`` rows (``engine/kv/windowed.py``),
    #: or None with one pool
    swa_pool: KVPool | None
    swa_req_pool: ReqToTokenPool | None
    #: the linear-attention layers' recurrent-state pool (``engine/kv/state_pool.py``: a slot
    #: per running request), or None for a model without such layers
    state_pool: RecurrentStatePool | None
    #: the prefix cache's snapshots of those states (``engine/kv/state_snapshots.py``), or
    #: None (no such layers, or no prefix reuse for them)
    state_snapshots: StateSnapshotPool | None

    def commit_verify(self, keep: Sequence[int]) -> None:
        """After a verify step (``ScheduleBatch.verify_n``): the linear-attention layers'
        states of request i become those after its first ``keep[i]`` rows of the step
        (called only where ``state_pool`` is not None)."""
        ...

    def forward(self, batch: ScheduleBatch, future_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits ``[rows, V]`` of a step: one row per sampled request, every row of an
        ``all_rows`` request; ``future_ids`` resolves the placeholder ids of a step still
        in flight."""
        ...

    def sample(self, logits: torch.Tensor, reqs: list, eos_ids: list[int]) -> SampledIds:
        """Sample one token per row of ``logits`` (row i for ``reqs[i]``)."""
        ...

    def pool(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[tuple[object, list]]:
        """A pooling engine's step: ``(req, answer)`` of each request whose prompt ended in
        ``batch`` (``engine/executor/pooling.py``)."""
        ...

    def memory_report(self) -> dict:
        """This rank's ``weight_bytes`` and ``kv_bytes`` (and more, for /server_info)."""
        ...
