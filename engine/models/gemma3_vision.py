"""Gemma 3's image encoder: the SigLIP vision tower and the multimodal projector, as
transformers' ``siglip`` (``SiglipVisionModel``, no pooling head) and ``gemma3``
(``Gemma3MultiModalProjector``) define them.

One image at a time (:meth:`Gemma3ImageEncoder.forward`): the processor's image (resized to
``image_size`` square, normalised) arrives as its ``patch x patch`` patches, row-major,
each flattened channel-first (``[h * w, C * patch * patch]``; ``server/media/process.py``
cuts them), so the patch embedding (a Conv2d whose stride is its kernel) is a linear map;
the learned position table is added (one row per patch: Gemma 3 never resizes it); the
encoder layers are pre-LayerNorm ViT blocks (biased q/k/v/out projections, non-causal
attention over the whole image through torch SDPA, a ``gelu_pytorch_tanh`` MLP), then the
post-LayerNorm. The projector average-pools the ``h x w`` patch grid to ``mm_tokens_per_image``
tokens (``sqrt`` per side; kernel = stride = patches per side / tokens per side), applies the
soft-embedding ``(1 + w)`` RMSNorm (fp32) and projects to the language model's width with
``mm_input_projection_weight`` ``[vision hidden, text hidden]``. Weights are replicated on
every rank; checkpoint names ``vision_tower.*`` (``vision_tower.vision_model.*`` in the Hub's
files) and ``multi_modal_projector.*``; SigLIP's pooling head, which Gemma 3 does not use,
is not built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import ReplicatedLinear
from engine.layers.norm import GemmaRMSNorm

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
         "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class SiglipAttention(nn.Module):
    """Non-causal multi-head self-attention over one image's patches (scale ``head ** -0.5``)."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = ReplicatedLinear(dim, dim, True, dtype)
        self.k_proj = ReplicatedLinear(dim, dim, True, dtype)
        self.v_proj = ReplicatedLinear(dim, dim, True, dtype)
        self.out_proj = ReplicatedLinear(dim, dim, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> [N, dim]."""
        n = x.shape[0]
        # [1, heads, N, head_dim]: SDPA's flash and memory-efficient kernels take 4-D inputs
        # only; 3-D ones fall back to the math path, which materialises the heads x N x N
        # scores (16 x 4096 x 4096 for an 896 px image, every layer)
        q, k, v = (p(x).view(1, n, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)              # [1, heads, N, head_dim]
        return self.out_proj(o[0].transpose(0, 1).reshape(n, -1))


class SiglipMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with biases."""

    def __init__(self, dim: int, inter: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.fc1 = ReplicatedLinear(dim, inter, True, dtype)
        self.fc2 = ReplicatedLinear(inter, dim, True, dtype)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, vc, dtype: torch.dtype):
        super().__init__()
        eps = float(getattr(vc, "layer_norm_eps", 1e-6))
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = SiglipAttention(vc.hidden_size, vc.num_attention_heads, dtype)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=eps, dtype=dtype)
        self.mlp = SiglipMLP(vc.hidden_size, vc.intermediate_size,
                             getattr(vc, "hidden_act", "gelu_pytorch_tanh"), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    """The Conv2d patch embedding as a linear map of the flattened patch (the weight keeps
    the checkpoint's ``[dim, C, p, p]``) plus the learned position of each patch."""

    def __init__(self, vc, dtype: torch.dtype):
        super().__init__()
        p, c = vc.patch_size, getattr(vc, "num_channels", 3)
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = nn.Parameter(
            torch.empty(vc.hidden_size, c, p, p, dtype=dtype), requires_grad=False)
        self.patch_embedding.bias = nn.Parameter(torch.empty(vc.hidden_size, dtype=dtype),
                                                 requires_grad=False)
        self.num_patches = (vc.image_size // p) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, vc.hidden_size, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.patch_embedding.weight
        x = F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.patch_embedding.bias)
        return x + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """``vision_tower``: ``embeddings``, ``encoder.layers``, ``post_layernorm`` (the Hub's
    files name them under ``vision_tower.vision_model.``; the model maps them)."""

    def __init__(self, vc, dtype: torch.dtype):
        super().__init__()
        self.embeddings = SiglipEmbeddings(vc, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipEncoderLayer(vc, dtype) for _ in range(vc.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(
            vc.hidden_size, eps=float(getattr(vc, "layer_norm_eps", 1e-6)), dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches ``[h * w, C * p * p]`` -> ``[h * w, hidden]``."""
        x = self.embeddings(patches)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """``multi_modal_projector``: average pool to ``mm_tokens_per_image``, soft-embedding
    RMSNorm, projection (module docstring)."""

    def __init__(self, config, text_hidden: int, dtype: torch.dtype):
        super().__init__()
        vc = config.vision_config
        self.side = vc.image_size // vc.patch_size
        tokens_side = int(round(config.mm_tokens_per_image ** 0.5))
        if tokens_side ** 2 != config.mm_tokens_per_image or self.side % tokens_side:
            raise ValueError(f"Gemma 3: mm_tokens_per_image {config.mm_tokens_per_image} is "
                             f"not a square dividing the {self.side}x{self.side} patch grid")
        self.kernel = self.side // tokens_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vc.hidden_size, text_hidden, dtype=dtype), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vc.hidden_size,
                                             float(getattr(vc, "layer_norm_eps", 1e-6)), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[side * side, vision hidden]`` -> ``[mm_tokens_per_image, text hidden]``."""
        grid = x.t().reshape(1, x.shape[1], self.side, self.side)
        # contiguous: the fused (Triton) RMSNorm reads rows of unit stride
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].t().contiguous()
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).to(x.dtype)


def encode_image(tower: SiglipVisionTower, projector: Gemma3Projector, pixels: torch.Tensor
                 ) -> torch.Tensor:
    """One image's patches ``[h * w, C * p * p]`` (``h = w = image_size / patch``) -> its
    ``[mm_tokens_per_image, text hidden]`` embeddings, in the model's dtype."""
    dev = projector.mm_input_projection_weight.device
    return projector(tower(pixels.to(dev)))
