"""Linear layers and the vocabulary embedding, split over the tensor-parallel ranks.

Each layer owns its weights as ``nn.Parameter`` (no grad) in the run dtype and exposes
``weight_loader(param, loaded, shard_id=None)``, which knows where a checkpoint tensor goes:
``QKVLinear`` packs the HF ``q_proj``/``k_proj``/``v_proj`` rows into one fused weight
(shard ids ``"q"``, ``"k"``, ``"v"``), ``MergedColumnLinear`` packs ``gate_proj``/``up_proj``
(shard ids ``0``, ``1``). The column/row split over ``tp_size`` ranks follows Megatron-LM
(Shoeybi et al. 2019): column-parallel layers split the output rows, row-parallel layers split
the input columns and all-reduce their output (a no-op at tp_size=1). The vocabulary
embedding and LM head are split by vocabulary rows (each rank looks up the ids in its range
and the partial embeddings are all-reduced; the logits are all-gathered). ``tp_size`` and
``tp_rank`` default to the process's group (:func:`engine.distributed.get_tp`).

Loaders copy with ``param.data.copy_``, which casts to the parameter's dtype and moves to its
device, so checkpoint tensors may arrive on the CPU in any float dtype. A checkpoint tensor
may also be a lazy slice (``engine.loader.loader.LazyTensor``: ``shape``, ``narrow`` and
``materialize``), so a rank reads only its shard from a safetensors file.

Quantization: a layer constructed inside ``engine.layers.quantization.quantization_scope``
delegates to that scheme's quant method (``quant_method``): it creates ``weight`` (and
``weight_scale``) in its own dtype, wraps their loaders around the layer's (so the fused
parts and the tensor-parallel shards stay as above) and computes the product
(``quant_method.apply(layer, x, bias)``). ``quant_method`` is None for a float layer.

CPU: the model runner (after loading; ``load_model`` itself returns plain weights) has
:func:`pack_cpu_weights` replace each float layer's ``weight`` with oneDNN's prepacked
(blocked) copy of it when :func:`engine.device.cpu_packed_gemm` says so, and
:func:`linear` runs those through ``torch.ops.mkldnn._linear_pointwise``. On the 2-core
AVX512-BF16 CI machine that streams SmolLM2's weights 1.3-1.9x faster than ``F.linear`` on
the plain layout at 1-64 rows (docs/benchmarks.md, issue 15).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, check_tp_shape, get_tp
from engine.layer_spec import kv_heads_per_rank
from engine.layers.quantization import current_linear_method


def _tp(tp_size: int | None, tp_rank: int | None) -> tuple[int, int]:
    g = get_tp()
    return (g.size if tp_size is None else tp_size), (g.rank if tp_rank is None else tp_rank)


def full_tensor(t) -> torch.Tensor:
    """A checkpoint tensor as a ``torch.Tensor`` (a lazy slice is read whole)."""
    return t if isinstance(t, torch.Tensor) else t.materialize()


def _check_shape(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(src.shape)}, "
                         f"expected {tuple(dst.shape)}")


def linear(x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias [N])`` -> [..., N] in x's dtype: ``F.linear``,
    or oneDNN's GEMM when ``weight`` is a prepacked CPU weight (:func:`pack_cpu_weights`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_linear_weight(weight: torch.Tensor, rows_hint: int = 1) -> nn.Parameter:
    """oneDNN's prepacked copy of a CPU ``weight [N, K]`` (float32 or bfloat16) as a
    parameter (an opaque ``is_mkldnn`` tensor; ``numel``/``element_size`` still count its
    bytes). ``rows_hint``: the GEMM row count the layout is chosen for (any row count runs)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)
    return nn.Parameter(packed, requires_grad=False)


def pack_cpu_weights(model: nn.Module) -> int:
    """Prepack the float linear layers of a loaded CPU model for oneDNN (in place).

    Every ``LinearBase`` without a quant method gets a packed ``weight``; the LM head gets a
    packed ``lm_head_packed`` attribute on ``model`` (an extra copy when it is the tied
    embedding table, which lookups still read in the plain layout; the untied head's weight
    is replaced). Loading weights into a packed layer afterwards is not supported.

    Returns:
        the number of weights packed (0 when :func:`engine.device.cpu_packed_gemm` is False
        for the model's dtype or the model is not on the CPU).
    """
    from engine import device as devmod

    first = next(model.parameters())
    if first.device.type != "cpu" or not devmod.cpu_packed_gemm(first.dtype):
        return 0
    n = 0
    for mod in model.modules():
        if isinstance(mod, LinearBase) and mod.quant_method is None and mod.packable \
                and mod.weight.dtype in (torch.float32, torch.bfloat16):
            mod.weight = pack_linear_weight(mod.weight)
            n += 1
    head = getattr(model, "lm_head", None)
    if getattr(model, "lm_head_quant", None) is not None:
        head = None  # the logits read the head's GGUF blocks
    if isinstance(head, VocabEmbedding) and head.weight.dtype in (torch.float32, torch.bfloat16):
        packed = pack_linear_weight(head.weight)
        if head is getattr(getattr(model, "model", None), "embed_tokens", None):
            model.lm_head_packed = packed.data
        else:
            head.weight = packed
        n += 1
    return n


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W [output_size, input_size]`` (this rank's part).

    ``weight`` is in ``dtype`` ([output_size, input_size]), or in the quant method's format
    (FP8: float8_e4m3fn plus ``weight_scale`` [output_size] fp32); ``bias`` is in ``dtype``.
    """

    #: whether the weight loader narrows the output rows to this rank's (column-parallel)
    shards_output = False
    #: whether :func:`pack_cpu_weights` may replace ``weight`` by oneDNN's opaque copy
    #: (False for a layer whose weight is also read as a tensor: MLA's ``kv_b_proj``)
    packable = True
    #: LoRA adapter slots (``engine.layers.lora.LoRASlots``) or None; set by
    #: ``engine.lora.LoRAManager`` when the server serves adapters
    lora = None

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 tp_size: int | None = None, tp_rank: int | None = None):
        super().__init__()
        tp_size, tp_rank = _tp(tp_size, tp_rank)
        self.input_size = input_size
        self.output_size = output_size
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.quant_method = current_linear_method()
        if self.quant_method is None:
            self.weight = _param((output_size, input_size), dtype)
            self.weight.weight_loader = self.weight_loader
        else:
            self.quant_method.create_weights(self, dtype)
        if bias:
            self.bias = _param((output_size,), dtype)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] (x's dtype)."""
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is None:
            y = linear(x, self.weight, bias)
        else:
            y = self.quant_method.apply(self, x, bias)
        if self.lora is not None:  # the step's LoRA deltas (before a row-parallel all-reduce)
            y = self.lora.apply(x, y)
        return y

    def drop_quantization(self, dtype: torch.dtype) -> None:
        """Make this layer a float layer again (uninitialised ``weight`` in ``dtype``, on
        the same device): for layers a quantized checkpoint keeps unquantized."""
        if self.quant_method is None:
            return
        device = next(p for p in self._parameters.values() if p is not None).device
        self.quant_method = None
        for name in [n for n in self._parameters if n != "bias"]:  # the quant method's own
            del self._parameters[name]
        self.weight = nn.Parameter(torch.empty(self.output_size, self.input_size, dtype=dtype,
                                               device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:  # pragma: no cover
        raise NotImplementedError


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def weight_loader(self, param, loaded, shard_id=None):
        loaded = full_tensor(loaded)
        _check_shape(type(self).__name__, param, loaded)
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: rank r holds rows ``[r*out/tp, (r+1)*out/tp)``."""

    shards_output = True

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 tp_size: int | None = None, tp_rank: int | None = None):
        tp_size, tp_rank = _tp(tp_size, tp_rank)
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tp_size {tp_size}")
        super().__init__(input_size, output_size // tp_size, bias, dtype, tp_size, tp_rank)

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        part = loaded.narrow(0, self.tp_rank * n, n)
        _check_shape(type(self).__name__, param, part)
        param.data.copy_(part)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial products are all-reduced, then the
    (replicated) bias is added once.

    At tp_size=1 there is no all-reduce and this is a plain linear layer. With
    ``reduce_results=False`` (no bias) the forward returns this rank's partial product, for a
    caller that sums it with other partial outputs and all-reduces once (the MoE block adds
    its shared expert's part to the routed experts' part).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 tp_size: int | None = None, tp_rank: int | None = None,
                 reduce_results: bool = True):
        tp_size, tp_rank = _tp(tp_size, tp_rank)
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp_size}")
        if bias and not reduce_results:
            raise ValueError("a row-parallel layer with a bias must reduce its results")
        self.reduce_results = reduce_results
        super().__init__(input_size // tp_size, output_size, bias, dtype, tp_size, tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size / tp] -> [..., output_size] (summed over the ranks unless
        ``reduce_results`` is False)."""
        if self.tp_size == 1 or not self.reduce_results:
            return self._matmul(x, self.bias)
        y = all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 2:
            n = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * n, n)
        loaded = full_tensor(loaded)
        _check_shape(type(self).__name__, param, loaded)
        param.data.copy_(loaded)


class MergedColumnLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. MLP gate and up).

    Args:
        output_sizes: full (unsplit) output size of each part; shard_id ``i`` of the loader
            is the index into this list.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 tp_size: int | None = None, tp_rank: int | None = None):
        tp_size, tp_rank = _tp(tp_size, tp_rank)
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, dtype, tp_size, tp_rank)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            raise ValueError("MergedColumnLinear needs a shard_id (index of the part)")
        tp = self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        dst = param.data.narrow(0, offset, size)
        src = loaded.narrow(0, self.tp_rank * size, size)
        _check_shape(f"{type(self).__name__}[{shard_id}]", dst, src)
        dst.copy_(src)


class PackedColumnLinear(MergedColumnLinear):
    """A column-parallel layer whose checkpoint tensor packs several parts one after
    another (Qwen3.5's ``in_proj_qkv``: ``[q | k | v]`` rows): each part is split over the
    ranks, and this rank's rows are its share of each part, in part order. The loader takes
    the whole packed tensor (``shard_id`` None) or one part (``shard_id`` its index).

    Args:
        output_sizes: each part's full (unsplit) rows, in the checkpoint's order.
    """

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        if loaded.shape[0] != sum(self.output_sizes):
            raise ValueError(f"{type(self).__name__}: checkpoint tensor has shape "
                             f"{tuple(loaded.shape)}, expected {sum(self.output_sizes)} rows")
        start = 0
        for i, size in enumerate(self.output_sizes):
            super().weight_loader(param, loaded.narrow(0, start, size), i)
            start += size


def narrow_parts(loaded, sizes: list[int], tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's share of each part of a tensor packed along dim 0 (``sizes``: the parts'
    full rows, each divisible by ``tp_size``), concatenated in part order: the rows of a
    per-channel tensor beside a :class:`PackedColumnLinear` (a depthwise conv's weight)."""
    out, start = [], 0
    for size in sizes:
        n = size // tp_size
        out.append(full_tensor(loaded.narrow(0, start + tp_rank * n, n)))
        start += size
    return torch.cat(out)


def checkpoint_shape(layer: LinearBase, leaf: str) -> tuple[int, ...]:
    """The full (unsplit) checkpoint shape of a float linear layer's ``weight`` or ``bias``
    (``leaf``): a column-parallel layer's rows and a row-parallel layer's columns times its
    ``tp_size`` (dummy weights are drawn at these shapes, the same model at every TP size;
    not for :class:`QKVLinear`, whose K/V heads may be replicated)."""
    out, inp = layer.output_size, layer.input_size
    if isinstance(layer, ColumnParallelLinear):
        out *= layer.tp_size
    elif isinstance(layer, RowParallelLinear):
        inp *= layer.tp_size
    return (out, inp) if leaf == "weight" else (out,)


class QKVLinear(ColumnParallelLinear):
    """Fused Q, K, V projection: output rows are ``[q (Hq*D) | k (Hkv*D) | v (Hkv*D)]``.

    KV heads are split over ranks (replicated when ``num_kv_heads < tp_size``).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype, tp_size: int | None = None,
                 tp_rank: int | None = None):
        tp_size, tp_rank = _tp(tp_size, tp_rank)
        check_tp_shape(num_heads, num_kv_heads, tp_size)
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp_size)
        self.kv_replicas = max(tp_size // num_kv_heads, 1)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, dtype, tp_size, tp_rank)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id == "k":
            offset, size, rank = self.q_size, self.kv_size, self.tp_rank // self.kv_replicas
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            rank = self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"QKVLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        dst = param.data.narrow(0, offset, size)
        src = loaded.narrow(0, rank * size, size)
        _check_shape(f"QKVLinear[{shard_id}]", dst, src)
        dst.copy_(src)


def embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """Gemma's embedding multiplier ``sqrt(hidden_size)`` rounded to ``dtype``, as HF
    computes it (a ``dtype`` tensor times the embeddings: in bf16, sqrt(3072) = 55.43 is
    55.5), returned as a Python float so the product rounds once, like HF's."""
    return float(torch.tensor(hidden_size ** 0.5, dtype=dtype, device="cpu"))


class VocabEmbedding(nn.Module):
    """Token embedding, split over the ranks by vocabulary rows; also serves as the LM head.

    Rank r holds rows ``[r * P, r * P + P)`` with ``P = ceil(vocab_size / tp_size)``
    (``weight [P, hidden_size]``; rows past the vocabulary are zero). The lookup zeroes the
    ids outside the rank's range and all-reduces; the LM head all-gathers the logits
    (``engine.layers.logits.compute_logits``).
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp_size: int | None = None, tp_rank: int | None = None):
        super().__init__()
        self.tp_size, self.tp_rank = _tp(tp_size, tp_rank)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.num_local = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = _param((self.rows_per_rank, hidden_size), dtype)
        self.weight.weight_loader = self.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden_size]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_local)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        return all_reduce(out * inside.unsqueeze(-1).to(out.dtype))

    def weight_loader(self, param, loaded, shard_id=None):
        if self.tp_size == 1:
            loaded = full_tensor(loaded)
            _check_shape("VocabEmbedding", param, loaded)
            param.data.copy_(loaded)
            return
        if tuple(loaded.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"VocabEmbedding: checkpoint tensor has shape "
                             f"{tuple(loaded.shape)}, expected "
                             f"{(self.vocab_size, self.hidden_size)}")
        n = self.num_local
        param.data[n:].zero_()
        if n:
            param.data[:n].copy_(full_tensor(loaded.narrow(0, self.vocab_start, n)))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into ``param`` (cast and moved), checking the shape."""
    loaded = full_tensor(loaded)
    _check_shape("weight", param, loaded)
    param.data.copy_(loaded)
