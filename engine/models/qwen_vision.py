"""Qwen2.5-VL's vision tower: patch embedding, ViT blocks with window attention (full
attention in the blocks of ``fullatt_block_indexes``), 2D rotary, RMSNorm, and the patch
merger that turns each ``merge x merge`` patches into one language-model token.

One image at a time (:meth:`Qwen25VisionTower.forward`): its patches ``[t*h*w, C*tp*p*p]``
(the image processor's order: merge blocks of ``merge x merge`` patches, row-major) ->
``[t*h*w / merge^2, out_hidden]`` embeddings in the order of the image's tokens. The patch
embedding (a Conv3d whose stride equals its kernel) is a linear layer over the flattened
patch; the attention is plain torch SDPA, non-causal, within each window or image, one
batched call per window size (:func:`segment_attention`; no paged KV, no ferry kernel yet).
Weights are replicated on every rank: under tensor parallelism each rank runs the whole
tower on the images rank 0 sends it (``engine/executor/tp_images.py``; the tower is ~0.7 B
parameters beside a 7-72 B language model, and sharding it would cost two all-reduces per
block per image).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import ReplicatedLinear
from engine.layers.norm import RMSNorm

VISION_EPS = 1e-6


def window_order(grid: tuple[int, int, int], merge: int, window: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """The windows of one image, over its merged tokens.

    Args:
        grid: the patch grid ``(t, h, w)``.
        merge: the spatial merge factor.
        window: tokens per window side (``window_size // merge // patch_size``).
    Returns:
        ``(order, lens)``: the merged-token indices [t*h*w/merge^2] int64 grouped window by
        window (row-major windows, row-major inside each), and each window's token count.
    """
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    idx = torch.arange(t * h * w).reshape(t, h, w)
    order, lens = [], []
    for ti in range(t):
        for r0 in range(0, h, window):
            for c0 in range(0, w, window):
                block = idx[ti, r0:r0 + window, c0:c0 + window].reshape(-1)
                order.append(block)
                lens.append(block.numel())
    return torch.cat(order), lens


def patch_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(row, col) of each patch [t*h*w, 2] int64, in the processor's merge-block order."""
    t, h, w = grid
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).reshape(-1)
    cols = cols.reshape(shape).transpose(1, 2).reshape(-1)
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


class VisionMLP(nn.Module):
    """The blocks' gated MLP with biases: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, dim: int, inter: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = ReplicatedLinear(dim, inter, True, dtype)
        self.up_proj = ReplicatedLinear(dim, inter, True, dtype)
        self.down_proj = ReplicatedLinear(inter, dim, True, dtype)
        self.act = {"silu": F.silu, "gelu": F.gelu,
                    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SegmentPlan:
    """How :func:`segment_attention` batches the groups ``lens`` of a packed sequence:
    groups of one length run as one batched SDPA call, so an image's ~100 windows (Qwen2.5-VL
    at 1024 x 1024: 8 x 8-patch windows, at most four sizes: inner, right edge, bottom edge,
    corner) cost at most four attention calls a block, not one each (2,800 calls an image
    before; the tower took ~0.5 s an image on an H200 then, not re-measured since).

    Args:
        lens: the groups' sizes in tokens, in their packed order.
        device: where the gather indices live.
    Attributes:
        sizes: ``[(length, count)]`` of the length-sorted groups.
        perm, inv: int64 [N] gather indices that sort the tokens by group length (stable)
            and put them back; None when the groups are already in that order.
    """

    def __init__(self, lens: list[int], device: torch.device | str):
        self.lens = list(lens)
        order = sorted(range(len(lens)), key=lambda i: lens[i])
        self.sizes: list[tuple[int, int]] = []
        for i in order:
            if self.sizes and self.sizes[-1][0] == lens[i]:
                self.sizes[-1] = (lens[i], self.sizes[-1][1] + 1)
            else:
                self.sizes.append((lens[i], 1))
        self.perm = self.inv = None
        if order != sorted(order):
            starts = [0]
            for n in lens[:-1]:
                starts.append(starts[-1] + n)
            perm = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in order])
            self.perm = perm.to(device)
            self.inv = torch.argsort(perm).to(device)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      plan: SegmentPlan) -> torch.Tensor:
    """Non-causal attention within each group of a packed sequence.

    q, k, v: [N, H, D] (any float dtype; N = ``sum(plan.lens)``); returns [N, H, D], token i
    attending to exactly the tokens of its own group (softmax scale ``D ** -0.5``).
    """
    if plan.perm is not None:
        q, k, v = q[plan.perm], k[plan.perm], v[plan.perm]
    outs, at = [], 0
    for length, count in plan.sizes:
        n = length * count
        qs, ks, vs = (t[at:at + n].view(count, length, *t.shape[1:]).transpose(1, 2)
                      for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
                    .reshape(n, *q.shape[1:]))
        at += n
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if plan.inv is None else out[plan.inv]


class VisionAttention(nn.Module):
    """Non-causal multi-head attention over groups of tokens (windows or the whole image),
    with the tower's 2D rotary on q and k."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, True, dtype)
        self.proj = ReplicatedLinear(dim, dim, True, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lens: list[int] | SegmentPlan) -> torch.Tensor:
        """x [N, dim]; cos, sin [N, head_dim] fp32; lens: the groups' sizes (sum N), or
        their :class:`SegmentPlan` (built once per image by the tower)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = (_rotate(y, cos, sin) for y in (q, k))
        plan = lens if isinstance(lens, SegmentPlan) else SegmentPlan(lens, x.device)
        return self.proj(segment_attention(q, k, v, plan).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [N, H, D] by cos/sin [N, D] (fp32), back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return (xf * cos.unsqueeze(1) + rot * sin.unsqueeze(1)).to(x.dtype)


class VisionBlock(nn.Module):
    """Pre-norm ViT block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, vc, dtype: torch.dtype):
        super().__init__()
        self.norm1 = RMSNorm(vc.hidden_size, VISION_EPS, dtype)
        self.norm2 = RMSNorm(vc.hidden_size, VISION_EPS, dtype)
        self.attn = VisionAttention(vc.hidden_size, vc.num_heads, dtype)
        self.mlp = VisionMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act, dtype)

    def forward(self, x, cos, sin, lens):
        x = x + self.attn(self.norm1(x), cos, sin, lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate ``merge^2`` neighbours, then Linear-GELU-Linear to
    the language model's width."""

    def __init__(self, vc, dtype: torch.dtype):
        super().__init__()
        self.width = vc.hidden_size * vc.spatial_merge_size ** 2
        self.ln_q = RMSNorm(vc.hidden_size, VISION_EPS, dtype)
        self.mlp = nn.ModuleList([ReplicatedLinear(self.width, self.width, True, dtype),
                                  nn.GELU(),
                                  ReplicatedLinear(self.width, vc.out_hidden_size, True, dtype)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).reshape(-1, self.width)
        return self.mlp[2](self.mlp[1](self.mlp[0](x)))


class PatchEmbed(nn.Module):
    """The Conv3d patch embedding (stride = kernel) as a linear map of the flattened patch;
    the weight keeps the checkpoint's shape ``[dim, C, tp, p, p]`` (``bias``: Qwen3-VL's)."""

    def __init__(self, vc, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        tp, p = vc.temporal_patch_size, vc.patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(vc.hidden_size, vc.in_channels, tp, p, p,
                                                    dtype=dtype), requires_grad=False)
        self.proj.bias = nn.Parameter(torch.empty(vc.hidden_size, dtype=dtype),
                                      requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class Qwen25VisionTower(nn.Module):
    """The vision tower of ``Qwen2_5_VLForConditionalGeneration`` (module docstring).

    Args:
        vc: the HF ``vision_config`` (``depth``, ``hidden_size``, ``num_heads``,
            ``intermediate_size``, ``hidden_act``, ``patch_size``, ``temporal_patch_size``,
            ``in_channels``, ``spatial_merge_size``, ``window_size``,
            ``fullatt_block_indexes``, ``out_hidden_size``).
        dtype: parameter and activation dtype.
    """

    def __init__(self, vc, dtype: torch.dtype):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size
        self.full = set(vc.fullatt_block_indexes or ())
        self.dtype = dtype
        self.patch_embed = PatchEmbed(vc, dtype)
        self.blocks = nn.ModuleList(VisionBlock(vc, dtype) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, dtype)
        half = vc.hidden_size // vc.num_heads // 2
        rope = getattr(vc, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, half, 2, dtype=torch.float32) / half), persistent=False)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches ``[t*h*w, C*tp*p*p]`` -> its token embeddings
        ``[t*h*w / merge^2, out_hidden]`` (in the model's dtype)."""
        unit = self.merge ** 2
        x = self.patch_embed(pixels.to(self.inv_freq.device))
        order, win_lens = window_order(grid, self.merge, self.window)
        # windows sorted by size (stable), so each size's windows are contiguous: one SDPA call
        # per size and no gather per block (each window's attention is independent of order)
        by_size = sorted(range(len(win_lens)), key=lambda i: win_lens[i])
        order = torch.cat([order.split(win_lens)[i] for i in by_size]).to(x.device)
        win_lens = [win_lens[i] for i in by_size]
        x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)  # window by window
        pos = patch_positions(grid, self.merge).to(x.device).float()
        freqs = (pos.unsqueeze(-1) * self.inv_freq).flatten(1)      # [N, D/2]: h then w
        freqs = freqs.view(-1, unit, freqs.shape[-1])[order].reshape(freqs.shape)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        t, h, w = grid
        image_plan = SegmentPlan([h * w] * t, x.device)
        win_plan = SegmentPlan([n * unit for n in win_lens], x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, image_plan if i in self.full else win_plan)
        out = self.merger(x)
        return out[torch.argsort(order)]
