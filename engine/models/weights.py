"""HF checkpoint names and the loading helpers the decoders share.

ferry fuses the q/k/v projections (``self_attn.qkv_proj``) and the gate/up projections
(``mlp.gate_up_proj``); :data:`STACKED_PARAMS` maps each fused parameter to its checkpoint
parts and shard ids (the loader, the quantization methods, LoRA and EAGLE read it).

FP8 checkpoints add ``<module>.weight_scale`` tensors (block-wise FP8:
``<module>.weight_scale_inv``), loaded like the weights onto the fused
``...qkv_proj.weight_scale`` / ``...gate_up_proj.weight_scale`` (same shard ids);
their static ``input_scale`` (and KV ``k_scale``/``v_scale``) tensors are skipped
(:data:`STATIC_SCALE_SUFFIXES`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

#: (ferry fused param, HF checkpoint part, shard id)
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# checkpoint tensors that are not weights (precomputed RoPE tables)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# FP8 checkpoints' static activation and KV scales: activations are quantized per token at
# run time, the KV cache format is --kv-cache-dtype (engine.layers.quantization)
STATIC_SCALE_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")


def load_tensor(name: str, loader, param: torch.Tensor, tensor, *shard) -> None:
    """``loader(param, tensor, *shard)``; a ValueError names the checkpoint tensor ``name``.

    Raises:
        ValueError: the loader's (a shape mismatch), prefixed with ``name``.
    """
    try:
        loader(param, tensor, *shard)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def check_fp8(name: str, param: torch.Tensor, tensor) -> None:
    """Refuse an FP8 checkpoint tensor for a parameter that is not FP8.

    Raises:
        ValueError: ``tensor`` is float8_e4m3fn and ``param`` is not (names the tensor).
    """
    fp8 = torch.float8_e4m3fn
    if getattr(tensor, "dtype", None) == fp8 and param.dtype != fp8:
        raise ValueError(f"{name} is FP8 in the checkpoint, but ferry loads it as "
                         f"{str(param.dtype).removeprefix('torch.')}: FP8 linear weights need "
                         "the checkpoint's quantization_config (their scales), and FP8 "
                         "embeddings, norms and LM heads are not supported")


class RowRange:
    """Rows ``[start, start + rows)`` of a lazy checkpoint tensor (a safetensors slice, see
    ``engine.loader.weights.LazyTensor``), read only where a weight loader narrows it: a
    fused tensor's part as the loaders see it (``shape``, ``dtype``, ``dim``, ``narrow``,
    ``materialize``)."""

    def __init__(self, tensor, start: int, rows: int):
        self._tensor, self._start = tensor, start
        self.shape = (rows, *tuple(tensor.shape)[1:])
        self.dtype = tensor.dtype

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._tensor.narrow(0, self._start + start, length)
        return self.materialize().narrow(dim, start, length)

    def materialize(self) -> torch.Tensor:
        t = self._tensor
        whole = t.materialize() if hasattr(t, "materialize") else t
        return whole.narrow(0, self._start, self.shape[0])


def split_fused(weights: Iterable[tuple[str, object]], parts: dict[str, list[tuple[str, int]]]
                ) -> Iterator[tuple[str, object]]:
    """Checkpoint tensors with fused projections (Phi-3's ``qkv_proj``, Phi-3's and GLM-4's
    ``gate_up_proj``) as their parts under the unfused HF names, so that the loaders shard
    each part as they shard an unfused checkpoint's (tensor parallelism splits q, k, v and
    gate, up each over the ranks).

    Args:
        weights: ``(hf_name, tensor)`` pairs.
        parts: fused module name -> ``[(part module name, rows), ...]`` in row order
            (``{"qkv_proj": [("q_proj", Hq*D), ("k_proj", Hkv*D), ("v_proj", Hkv*D)]}``).
    Raises:
        ValueError: a fused tensor whose rows are not the parts' sum (names the tensor).
    """
    for name, tensor in weights:
        fused = next((f for f in parts if f".{f}." in name), None)
        if fused is None:
            yield name, tensor
            continue
        total = sum(rows for _, rows in parts[fused])
        if tuple(tensor.shape)[0] != total:
            raise ValueError(f"{name}: checkpoint tensor has {tuple(tensor.shape)[0]} rows, "
                             f"expected {total} (the fused {', '.join(p for p, _ in parts[fused])})")
        start = 0
        for part, rows in parts[fused]:
            piece = _rows(tensor, start, rows)
            yield name.replace(f".{fused}.", f".{part}."), piece
            start += rows


def _rows(tensor, start: int, rows: int):
    """Rows ``[start, start + rows)`` of a checkpoint tensor: a view of a ``torch.Tensor``,
    the same block rows of a GGUF block tensor (``GgufBlocks``: a row's blocks are its own),
    a :class:`RowRange` of a lazy slice."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(0, start, rows)
    if hasattr(tensor, "ggml_type"):
        return type(tensor)(tensor.data[start:start + rows], tensor.ggml_type,
                            (rows, *tensor.shape[1:]))
    return RowRange(tensor, start, rows)


def fused_names(names: Iterable[str], parts: dict[str, list[tuple[str, int]]]) -> list[str]:
    """HF names of unfused parts -> the fused checkpoint's names (the first part's name
    becomes the fused one, the other parts' are dropped): what a checkpoint with
    ``parts``' fused projections holds."""
    first = {ps[0][0]: f for f, ps in parts.items()}
    later = {p for ps in parts.values() for p, _ in ps[1:]}
    out = []
    for name in names:
        kind = name.split(".")[-2] if name.count(".") else ""
        if kind in later:
            continue
        out.append(name.replace(f".{kind}.", f".{first[kind]}.") if kind in first else name)
    return out


def skip_mtp(weights: Iterable[tuple[str, object]], prefix: str, owner: str
             ) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors without its multi-token-prediction layer's (names starting
    with ``prefix``: DeepSeek-V3's ``model.layers.{num_hidden_layers}.``, Qwen3-Next's
    ``mtp.``), which ``--speculative-algorithm MTP`` loads into its proposer
    (``engine/speculative/mtp.py``); one log line with their count."""
    import logging

    skipped = 0
    for name, tensor in weights:
        if name.startswith(prefix):
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logging.getLogger(__name__).info(
            "%s: %d tensors of the MTP layer (%s*) are not part of the model (the MTP "
            "proposer loads them)", owner, skipped, prefix)
