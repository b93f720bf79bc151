"""Weight iterators: safetensors (whole tensors, or lazy slices for tensor parallelism) and
seeded dummy weights.

Both yield ``(hf_name, tensor)`` pairs for a model's ``load_weights``; the model's weight
loaders keep each rank's shard (see ``engine/layers/linear.py``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

DUMMY_STD = 0.02


#: safetensors dtype names -> torch dtypes (the float ones a checkpoint holds)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


class LazyTensor:
    """A safetensors tensor that is read only where it is used: ``narrow`` reads one slice
    (a tensor-parallel rank's shard), ``materialize`` the whole tensor; ``shape`` and
    ``dtype`` (None for non-float dtypes) come from the header. Valid while the iterator
    that yielded it has not moved on."""

    def __init__(self, handle, name: str):
        self._handle = handle
        self.name = name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(self._slice.get_dtype())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * dim + [slice(start, start + length)]
        return self._slice[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)


def iter_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` from each file, one tensor at a time; with ``lazy``,
    ``(hf_name, LazyTensor)`` so that each rank reads only its shard."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, (LazyTensor(f, name) if lazy else f.get_tensor(name))


def _count_safetensors(files: list[str]) -> int:
    from safetensors import safe_open

    n = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            n += len(list(f.keys()))
    return n


def _dummy_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & ((1 << 63) - 1)


def hash_uniform(numel: int, key: int, device: torch.device, chunk: int = 1 << 24) -> torch.Tensor:
    """``numel`` float32 values uniform in [-1, 1) from a counter-based hash of (key, index).

    Integer ops only, so every device computes the same bits, and the GPU draws an 8B-model's
    weights in seconds (a CPU generator takes minutes). The hash is the sampler's lowbias32
    (engine/sampling.py), keyed like its seeds; indices must stay below 2**32.
    """
    from engine.sampling.noise import _mix32, seed_keys

    if numel >= 1 << 32:
        raise ValueError("hash_uniform supports up to 2**32 values per tensor")
    k1, k2 = seed_keys(key, 0)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for s in range(0, numel, chunk):
        idx = torch.arange(s, min(numel, s + chunk), dtype=torch.int64, device=device)
        bits = _mix32(_mix32(idx ^ k1) ^ k2)
        out[s: s + idx.numel()] = (bits >> 8).to(torch.float32) * (2.0 ** -23) - 1.0
    return out


def iter_dummy_weights(model, seed: int, device: torch.device
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random HF-named tensors at their full shapes (``model.hf_weight_shapes()``):
    uniform with std DUMMY_STD (0.02) for matrices and biases, ones for norm weights.

    Each tensor's values are a hash of (seed, HF name, element index) computed on ``device``
    (``hash_uniform``), so every device and every tensor-parallel size sees the same model
    (each rank keeps its shard through the model's weight loaders).
    """
    scale = DUMMY_STD * 3.0 ** 0.5  # uniform on [-a, a) has std a / sqrt(3)
    for name, shape in model.hf_weight_shapes().items():
        numel = 1
        for n in shape:
            numel *= n
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=torch.float32, device=device)
            continue
        yield name, hash_uniform(numel, _dummy_seed(seed, name), device).mul_(scale).view(shape)


def init_dummy_weights(model: torch.nn.Module, seed: int, progress: bool = True) -> None:
    """Load :func:`iter_dummy_weights` into ``model`` (on its parameters' device)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    shapes = model.hf_weight_shapes()
    it = tqdm(iter_dummy_weights(model, seed, device), total=len(shapes), desc="dummy weights",
              disable=not progress or None)
    with torch.no_grad():
        model.load_weights(it)
