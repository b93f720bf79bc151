"""``LoRAManager``: the adapters a model serves, their device slots, and each step's rows.

- Registry: ``name -> id`` of every loaded adapter (host memory, at most
  ``--max-loaded-loras`` adapters, counting unloaded ones that running requests still
  hold); an id never changes meaning, so a request that started on an
  adapter finishes on it after an unload or a reload under the same name (``acquire`` /
  ``release`` count the requests that hold it; an unloaded adapter leaves when the last one
  ends).
- Device slots: ``--max-loras-per-batch`` slots in every target layer
  (``engine.layers.lora.LoRASlots``). :meth:`slots_for` gives a step's requests their slots,
  copying an adapter in when it is not resident; the least recently used slot that the step
  does not use is overwritten (its adapter stays in host memory).
- Segments: :meth:`set_batch` fills the model's shared ``LoRABatch`` (the step's builder,
  ``engine.executor.forward_batch_builder``, calls it with the step's ``LoRASegments``).

Tensor parallelism: each rank has a manager over its own shards. Rank 0 decides the slots
(:meth:`slots_for` returns the copies it made as ``(slot, id, name, path)``) and the workers
repeat them (:meth:`load_slot`), reading the adapter files themselves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from engine.args import DEFAULT_MAX_LORA_RANK, adapter_name_error, lora_path_items
from engine.layers.linear import LinearBase, MergedColumnLinear, QKVLinear, RowParallelLinear
from engine.layers.lora import LoRABatch, LoRASlots
from engine.lora.adapter import (
    LORA_MODULES,
    LoRAAdapter,
    LoRAError,
    adapter_rank,
    read_adapter,
)

logger = logging.getLogger(__name__)


def _layer_targets(model: nn.Module) -> dict[str, tuple[LinearBase, int, int, int]]:
    """HF module name -> ``(ferry layer, part index, full in_features, full out_features of
    the part)`` for every LoRA-capable projection of the model."""
    stacked: dict[str, tuple[str, object]] = {part: (fused, shard)
                                              for fused, part, shard in model.stacked_params}
    fused_parts: dict[str, list] = {}
    for fused, _part, shard in model.stacked_params:
        fused_parts.setdefault(fused, []).append(shard)
    mods = dict(model.named_modules())
    out = {}
    for name, mod in mods.items():
        if not isinstance(mod, LinearBase) or ".layers." not in name:
            continue
        prefix, _, leaf = name.rpartition(".")
        for hf in LORA_MODULES:
            if stacked.get(hf, (hf,))[0] != leaf:
                continue
            if hf in stacked:
                fused, shard = stacked[hf]
                part = fused_parts[fused].index(shard)
            else:
                part = 0
            out[f"{prefix}.{hf}"] = (mod, part, *_full_shape(mod, part))
    return out


def _full_shape(mod: LinearBase, part: int) -> tuple[int, int]:
    tp = mod.tp_size
    if isinstance(mod, QKVLinear):
        heads = (mod.num_heads * tp if part == 0
                 else mod.num_kv_heads * tp // mod.kv_replicas)
        return mod.input_size, heads * mod.head_dim
    if isinstance(mod, MergedColumnLinear):
        return mod.input_size, mod.output_sizes[part]
    if isinstance(mod, RowParallelLinear):
        return mod.input_size * tp, mod.output_size
    return mod.input_size, mod.output_size * (tp if mod.shards_output else 1)


def _slot_parts(mod: LinearBase) -> list[tuple[int, int, int | None]]:
    """``(column offset, rows on this rank, rank of B's rows)`` per part of ``mod``."""
    r = mod.tp_rank
    if isinstance(mod, QKVLinear):
        kv_rank = r // mod.kv_replicas
        return [(0, mod.q_size, r), (mod.q_size, mod.kv_size, kv_rank),
                (mod.q_size + mod.kv_size, mod.kv_size, kv_rank)]
    if isinstance(mod, MergedColumnLinear):
        sizes = [s // mod.tp_size for s in mod.output_sizes]
        return [(sum(sizes[:i]), n, r) for i, n in enumerate(sizes)]
    if isinstance(mod, RowParallelLinear):
        return [(0, mod.output_size, None)]
    return [(0, mod.output_size, r if mod.shards_output else None)]


class LoRAManager:
    """Adapters of one model (this rank's shards).

    Args:
        model: a loaded ``CausalLM`` of the Llama family (its ``stacked_params``).
        num_slots: ``--max-loras-per-batch``; max_rank: ``--max-lora-rank``;
        max_loaded: ``--max-loaded-loras`` (None: no limit).
        dtype, device: of the slot buffers (the model's).
        use_triton: the Triton kernels (accelerators) or the torch path.
    """

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int,
                 max_loaded: int | None, dtype: torch.dtype, device: torch.device,
                 use_triton: bool):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.device = device
        refusal = getattr(type(model), "lora_refusal", None)
        if refusal:  # (ferry serve refuses it before start-up: engine/executor/preflight.py)
            raise ValueError(f"{type(model).__name__}: {refusal}")
        self.batch = LoRABatch(use_triton, num_slots, dtype)
        self.targets = _layer_targets(model)
        if not self.targets:
            raise ValueError(f"{type(model).__name__}: LoRA adapters are not supported for "
                             "this model (no q/k/v/o/gate/up/down projections found)")
        for mod in {id(m): m for m, *_ in self.targets.values()}.values():
            in_shard = ((mod.tp_rank, mod.input_size)
                        if isinstance(mod, RowParallelLinear) and mod.tp_size > 1 else None)
            mod.lora = LoRASlots(_slot_parts(mod), mod.input_size, in_shard, num_slots,
                                 max_rank, dtype, device, self.batch)
        self.adapters: dict[int, LoRAAdapter] = {}
        self.names: dict[str, int] = {}
        self.refs: dict[int, int] = {}
        self._next_id = 1
        self.slot_owner: list[int | None] = [None] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        for s in range(num_slots):
            self._lru[s] = None

    @classmethod
    def for_args(cls, args, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 use_triton: bool) -> LoRAManager:
        """The manager of ``--lora-paths`` / ``--enable-lora`` with the adapters of
        ``--lora-paths`` loaded; ``--max-lora-rank`` defaults to their largest rank.

        Raises:
            ValueError: (``LoRAError``) an adapter of --lora-paths that cannot be served.
        """
        items = lora_path_items(args.lora_paths)
        rank = args.max_lora_rank
        if rank is None:
            rank = max((adapter_rank(p) for _, p in items), default=0) or DEFAULT_MAX_LORA_RANK
        mgr = cls(model, args.max_loras_per_batch, rank, args.max_loaded_loras, dtype, device,
                  use_triton)
        for name, path in items:
            try:
                mgr.load(name, path)
            except LoRAError as e:
                raise LoRAError(f"--lora-paths {name}={path}: {e}", e.param) from None
        logger.info("LoRA: %d slots of rank %d in %d projections (%.1f MB on the device), "
                    "%s path", args.max_loras_per_batch, rank, len(mgr.targets),
                    mgr.slot_bytes() / 1e6, "Triton" if use_triton else "torch")
        return mgr

    def slot_bytes(self) -> int:
        """Device bytes of the slot buffers (all layers)."""
        return sum(m.lora.nbytes() for m in {id(m): m for m, *_ in
                                              self.targets.values()}.values())

    # ---- registry -----------------------------------------------------------------------
    def load(self, name: str, path: str) -> int:
        """Read and register an adapter; returns its id.

        Raises:
            LoRAError: the name is taken (400), the adapter is malformed or does not fit the
                model (400), or ``--max-loaded-loras`` adapters are loaded already (400).
        """
        if (bad := adapter_name_error(name)) is not None:
            raise LoRAError(bad, "lora_name")
        self._check_name(name)
        return self.register(read_adapter(name, path, self.max_rank))

    def _check_name(self, name: str) -> None:
        if name in self.names:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        # an unloaded adapter that running requests still use stays in memory until the
        # last of them ends: it counts against the limit until then
        held = len(self.adapters)
        if self.max_loaded is not None and held >= self.max_loaded:
            gone = held - len(self.names)
            why = (f" ({gone} of them unloaded but still used by running requests; they "
                   f"leave when those end)" if gone else "; unload one first")
            raise LoRAError(f"{held} LoRA adapters are in memory, the most --max-loaded-loras "
                            f"allows{why}", "lora_name")

    def register(self, adapter: LoRAAdapter) -> int:
        """Register an adapter already in host memory (:meth:`load` reads one from disk;
        the benchmarks make random ones); returns its id. Raises LoRAError as ``load``."""
        self._check_name(adapter.name)
        if adapter.rank > self.max_rank:
            raise LoRAError(f"{adapter.name}: rank {adapter.rank} is above --max-lora-rank "
                            f"{self.max_rank}", "r")
        self._check_fits(adapter)
        aid = self._next_id
        self._next_id += 1
        self.adapters[aid] = adapter
        self.names[adapter.name] = aid
        self.refs[aid] = 0
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d modules, %.1f MB)",
                    adapter.name, adapter.path, adapter.rank, len(adapter.weights),
                    adapter.nbytes() / 1e6)
        return aid

    def _check_fits(self, adapter: LoRAAdapter) -> None:
        for module, (a, b) in adapter.weights.items():
            t = self.targets.get(module)
            if t is None:
                raise LoRAError(f"{adapter.path}: module {module} is not in the model")
            _, _, k, n = t
            if a.shape[1] != k or b.shape[0] != n:
                raise LoRAError(f"{adapter.path}: {module}: lora_A {tuple(a.shape)} and "
                                f"lora_B {tuple(b.shape)} do not fit the model's "
                                f"[{n}, {k}] projection")

    def unload(self, name: str) -> None:
        """Forget ``name``; requests already holding it finish on it.

        Raises:
            LoRAError: no adapter of that name (404).
        """
        aid = self.names.pop(name, None)
        if aid is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded", "lora_name", 404)
        if self.refs.get(aid, 0) == 0:
            self._drop(aid)
        logger.info("LoRA adapter %r unloaded", name)

    def _drop(self, aid: int) -> None:
        self.adapters.pop(aid, None)
        self.refs.pop(aid, None)
        for s, owner in enumerate(self.slot_owner):
            if owner == aid:
                self.slot_owner[s] = None
                self._lru.move_to_end(s, last=False)

    def resolve(self, name: str) -> int:
        """The id of a loaded adapter. Raises LoRAError (404) for an unknown name."""
        aid = self.names.get(name)
        if aid is None:
            raise LoRAError(f"The model '{name}' does not exist: no such LoRA adapter is "
                            f"loaded", "model", 404)
        return aid

    def acquire(self, aid: int) -> None:
        self.refs[aid] = self.refs.get(aid, 0) + 1

    def release(self, aid: int) -> None:
        n = self.refs.get(aid, 0) - 1
        self.refs[aid] = max(n, 0)
        if n <= 0 and aid not in self.names.values():
            self._drop(aid)

    def list(self) -> list[dict]:
        """``[{"name", "path", "rank"}]`` of the loaded adapters."""
        return [{"name": n, "path": self.adapters[i].path, "rank": self.adapters[i].rank}
                for n, i in self.names.items()]

    # ---- device slots -------------------------------------------------------------------
    def slots_for(self, ids: list[int | None]) -> tuple[list[int], list[tuple]]:
        """Each request's slot (-1 for the base model), copying adapters in as needed.

        Returns:
            ``(slots, copies)``: copies are ``(slot, id, name, path)`` of the adapters
            copied in now (tensor-parallel workers repeat them).
        Raises:
            RuntimeError: more distinct adapters than slots (the scheduler prevents it).
        """
        want = list(dict.fromkeys(i for i in ids if i is not None))
        if len(want) > self.num_slots:
            raise RuntimeError(f"{len(want)} LoRA adapters in one step, "
                               f"--max-loras-per-batch is {self.num_slots}")
        where = {aid: s for s, aid in enumerate(self.slot_owner) if aid is not None}
        used = {where[a] for a in want if a in where}
        copies = []
        for aid in want:
            if aid in where:
                continue
            slot = next(s for s in self._lru if s not in used)
            self._copy_in(slot, self.adapters[aid])
            self.slot_owner[slot] = aid
            where[aid] = slot
            used.add(slot)
            a = self.adapters[aid]
            copies.append((slot, aid, a.name, a.path))
        for s in used:
            self._lru.move_to_end(s)
        return [-1 if i is None else where[i] for i in ids], copies

    def _copy_in(self, slot: int, adapter: LoRAAdapter) -> None:
        for module, (mod, part, _, _) in self.targets.items():
            ab = adapter.weights.get(module)
            if ab is None:
                mod.lora.clear_part(slot, part)  # the adapter leaves this projection alone
            else:
                mod.lora.load(slot, part, *ab)

    def load_slot(self, slot: int, aid: int, name: str, path: str) -> None:
        """A tensor-parallel worker: copy adapter ``aid`` (read from ``path`` when new) into
        ``slot``, as rank 0 did."""
        if aid not in self.adapters:
            self.adapters[aid] = read_adapter(name, path, self.max_rank)
        self._copy_in(slot, self.adapters[aid])
        old = self.slot_owner[slot]
        self.slot_owner[slot] = aid
        if old is not None and old != aid and old not in self.slot_owner:
            self.adapters.pop(old, None)  # rank 0 re-sends it if it comes back

    # ---- the step -----------------------------------------------------------------------
    def set_batch(self, starts: list[int], lens: list[int], slots: list[int],
                  seg_tensors=None) -> None:
        """Fill the shared ``LoRABatch``: request i's rows ``[starts[i], starts[i] +
        lens[i])`` use ``slots[i]``."""
        self.batch.set_segments(starts, lens, slots, self.device, seg_tensors)


__all__ = ["LoRAError", "LoRAManager"]
