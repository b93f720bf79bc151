"""Gemma 3's image projector with the fused (Triton) ops, in the interpreter, against HF's
``Gemma3MultiModalProjector``.

The projector's soft-embedding RMSNorm reads the average-pooled patches, a transposed view;
the Triton RMSNorm wants rows of unit stride, so this failed on the GPU ("x must have a
unit-stride last axis", H200, 2026-12-04) while the CPU's reference op took the view."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Gemma3Config  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector  # noqa: E402

from engine.layers import select_ops  # noqa: E402
from engine.models.gemma3_vision import Gemma3Projector  # noqa: E402


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
def test_projector_with_triton_ops_matches_hf(dtype, tol):
    torch.manual_seed(0)
    cfg = Gemma3Config(
        text_config={"hidden_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
                     "vocab_size": 128},
        vision_config={"hidden_size": 32, "image_size": 32, "patch_size": 4,
                       "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 64},
        mm_tokens_per_image=4)
    hf = Gemma3MultiModalProjector(cfg).eval()
    with torch.no_grad():
        hf.mm_input_projection_weight.normal_()
        hf.mm_soft_emb_norm.weight.normal_(0, 0.5)
    ours = Gemma3Projector(cfg, cfg.text_config.hidden_size, dtype)
    with torch.no_grad():
        ours.mm_input_projection_weight.copy_(hf.mm_input_projection_weight)
        ours.mm_soft_emb_norm.weight.copy_(hf.mm_soft_emb_norm.weight)
    assert select_ops(ours, "triton") == 1  # the norm runs the Triton kernel
    patches = torch.randn(64, 32)  # an 8 x 8 patch grid, vision hidden 32
    with torch.no_grad():
        want = hf(patches[None])[0]
        got = ours(patches.to(dtype)).float()
    assert got.shape == (4, 48)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
