"""Qwen3-VL's vision tower: patch embedding (with a bias) plus a learned position table
resampled to each image's grid, ViT blocks of full attention per frame with LayerNorm and a
plain GELU(tanh) MLP, the 2D rotary of :mod:`engine.models.qwen_vision`, the patch merger,
and DeepStack: the mergers of ``deepstack_visual_indexes`` turn those blocks' outputs into
extra embeddings that the language model adds to the image tokens' hidden states after its
first layers. Qwen3.5's tower (``engine/models/qwen3_5_vl.py``) is the same without
DeepStack (no ``deepstack_visual_indexes``).

One image at a time (:meth:`Qwen3VisionTower.forward`): patches ``[t*h*w, C*tp*p*p]`` ->
``[t*h*w / merge^2, out_hidden * (1 + len(deepstack_visual_indexes))]``, the merger's
embeddings first, then each DeepStack level's. Attention is plain torch SDPA (non-causal,
per frame); weights are replicated on every rank under tensor parallelism
(``engine/models/qwen_vision.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import ReplicatedLinear
from engine.models.qwen_vision import VISION_EPS, PatchEmbed, VisionAttention, patch_positions

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
         "silu": F.silu}


class Qwen3VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with biases."""

    def __init__(self, dim: int, inter: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(dim, inter, True, dtype)
        self.linear_fc2 = ReplicatedLinear(inter, dim, True, dtype)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    """Pre-LayerNorm ViT block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, vc, dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(vc.hidden_size, eps=VISION_EPS, dtype=dtype)
        self.norm2 = nn.LayerNorm(vc.hidden_size, eps=VISION_EPS, dtype=dtype)
        self.attn = VisionAttention(vc.hidden_size, vc.num_heads, dtype)
        self.mlp = Qwen3VisionMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act, dtype)

    def forward(self, x, cos, sin, lens):
        x = x + self.attn(self.norm1(x), cos, sin, lens)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm (per patch, or after concatenating the ``merge^2`` neighbours: DeepStack's
    ``postshuffle``), then Linear-GELU-Linear to the language model's width."""

    def __init__(self, vc, dtype: torch.dtype, postshuffle: bool):
        super().__init__()
        self.width = vc.hidden_size * vc.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else vc.hidden_size, eps=VISION_EPS,
                                 dtype=dtype)
        self.linear_fc1 = ReplicatedLinear(self.width, self.width, True, dtype)
        self.linear_fc2 = ReplicatedLinear(self.width, vc.out_hidden_size, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle else \
            self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """The vision tower of ``Qwen3VLForConditionalGeneration`` (module docstring).

    Args:
        vc: the HF ``vision_config`` (``depth``, ``hidden_size``, ``num_heads``,
            ``intermediate_size``, ``hidden_act``, ``patch_size``, ``temporal_patch_size``,
            ``in_channels``, ``spatial_merge_size``, ``num_position_embeddings``,
            ``deepstack_visual_indexes`` (none: Qwen3.5's tower), ``out_hidden_size``).
        dtype: parameter and activation dtype.
    """

    def __init__(self, vc, dtype: torch.dtype):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.side = int(vc.num_position_embeddings ** 0.5)
        self.deepstack = list(getattr(vc, "deepstack_visual_indexes", None) or ())
        self.patch_embed = PatchEmbed(vc, dtype, bias=True)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size, dtype=dtype)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(vc, dtype) for _ in range(vc.depth))
        self.merger = Qwen3PatchMerger(vc, dtype, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(vc, dtype, postshuffle=True) for _ in self.deepstack)
        half = vc.hidden_size // vc.num_heads // 2
        rope = getattr(vc, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, half, 2, dtype=torch.float32) / half), persistent=False)

    def _positions(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """The learned position table resampled (bilinear, corners aligned) to the image's
        ``h x w`` patches, in the processor's merge-block order, once per frame."""
        t, h, w = grid
        m, d = self.merge, self.pos_embed.weight.shape[1]
        table = self.pos_embed.weight.float().view(self.side, self.side, d).permute(2, 0, 1)
        grid_emb = F.interpolate(table[None], size=(h, w), mode="bilinear",
                                 align_corners=True)[0].permute(1, 2, 0)       # [h, w, d]
        blocks = grid_emb.reshape(h // m, m, w // m, m, d).permute(0, 2, 1, 3, 4)
        return blocks.reshape(h * w, d).repeat(t, 1)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches ``[t*h*w, C*tp*p*p]`` -> ``[t*h*w / merge^2, out_hidden *
        (1 + DeepStack levels)]`` (the merger's embeddings, then each level's)."""
        x = self.patch_embed(pixels.to(self.inv_freq.device))
        x = x + self._positions(grid).to(x.dtype)
        pos = patch_positions(grid, self.merge).to(x.device).float()
        freqs = (pos.unsqueeze(-1) * self.inv_freq).flatten(1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        t, h, w = grid
        lens = [h * w] * t
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lens)
            if i in self.deepstack:
                levels.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return torch.cat([self.merger(x)] + levels, dim=-1)
