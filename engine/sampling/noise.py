"""Counter-based sampling noise: a hash of (seed, step, token id), no generator state.

The counter-based RNG idea of Philox (Salmon et al. 2011, "Parallel random numbers: as easy
as 1, 2, 3") with a cheaper 32-bit integer finaliser (Chris Wellons' ``lowbias32``) in place
of Philox rounds, computed with int64 tensor ops on the device, so that a seeded row's noise
is the same alone or in any batch, on every device (``engine/sampling/sampler.py`` uses it
for the race of seeded rows; the dummy-weight loader for its reproducible weights).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for 0 <= x < 2**32, exact in int64 (no signed overflow).

    Works on Python ints and on int64 tensors. For c >= 2**31 the product could pass 2**63, so
    c is split as c' + 2**31 and ``x * 2**31 mod 2**32 == (x & 1) << 31``.
    """
    if c < (1 << 31):
        return (x * c) & _M32
    return (x * (c - (1 << 31)) + ((x & 1) << 31)) & _M32


def _mix32(x):
    """Chris Wellons' ``lowbias32`` integer hash (a bijection on 32-bit values).

    Source: "Prospecting for Hash Functions" (nullprogram.com, 2018):
    ``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16``.
    ``x``: Python int or int64 tensor with values in [0, 2**32); same type out.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_keys(seed: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys of one (seed, step): the seed's 64 bits and the step absorbed in turn.

    ``seed``: any Python int (taken mod 2**64). ``step``: tokens generated so far, >= 0.
    """
    s = seed & 0xFFFFFFFFFFFFFFFF
    k1 = _mix32(_mix32(_mix32((s >> 32) ^ 0x9E3779B9) ^ (s & _M32)) ^ (step & _M32))
    k2 = _mix32(k1 ^ 0x85EBCA6B)
    return k1, k2


def seeded_gumbel(k1: torch.Tensor, k2: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from the hash of (row keys, token id); no generator state.

    ``bits = mix32(mix32(token ^ k1) ^ k2)``; the top 23 bits give ``U = (h + 0.5) / 2**23``
    in (0, 1) exactly in float32, and ``G = -log(-log(U))`` is finite.

    Args:
        k1, k2: [S, 1] int64, the row keys from ``seed_keys``.
        token_ids: [V] or [S, V] int64 token ids in [0, 2**32).
    Returns:
        [S, V] float32 on the keys' device.
    """
    bits = _mix32(_mix32(token_ids ^ k1) ^ k2)
    u = ((bits >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)
    return -torch.log(-torch.log(u))
