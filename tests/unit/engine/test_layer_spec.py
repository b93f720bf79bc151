"""The per-layer contract (engine/layer_spec.py) and its readers: the attention layer, the
attention backends and the KV pool build what they run and refuse the rest by name."""

from __future__ import annotations

import pytest
import torch

from engine.attention import ATTENTION_BACKENDS, create_attention_backend
from engine.kv.pool import build_kv_pool, kv_bytes_per_token
from engine.layer_spec import (
    AttentionKind,
    CacheKind,
    LayerSpec,
    cache_groups,
    kv_heads_per_rank,
)
from engine.layers.attention import Attention

FULL = LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2)


def test_spec_checks_itself():
    with pytest.raises(ValueError, match="window"):
        LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2, sliding_window=128)
    with pytest.raises(ValueError, match="window"):
        LayerSpec(attention=AttentionKind.SLIDING, head_dim=16, v_head_dim=16, num_kv_heads=2)
    with pytest.raises(ValueError, match="head_dim"):
        LayerSpec()
    assert LayerSpec(attention=AttentionKind.NONE, cache=CacheKind.NONE).head_dim == 0
    assert FULL.softmax_scale == 16 ** -0.5
    with pytest.raises(AttributeError):
        FULL.head_dim = 8  # frozen


def test_per_rank_heads_and_groups():
    assert FULL.per_rank(1) is FULL
    assert FULL.per_rank(2).num_kv_heads == 1 and FULL.per_rank(4).num_kv_heads == 1
    assert kv_heads_per_rank(8, 4) == 2 and kv_heads_per_rank(2, 8) == 1
    latent = LayerSpec(attention=AttentionKind.LATENT, cache=CacheKind.LATENT_KV,
                       head_dim=192, v_head_dim=128, num_kv_heads=1)
    assert cache_groups([FULL, latent, FULL]) == {CacheKind.PAGED_KV: [0, 2],
                                                  CacheKind.LATENT_KV: [1]}


def test_attention_layer_holds_its_spec_and_refuses_other_kinds():
    """Full and sliding layers, with soft-capping and sinks (a learned [Hq] float32 tensor),
    run; latent and recurrent ones are refused by name."""
    a = Attention(4, 1, 16, 3, spec=FULL)
    assert a.spec.num_kv_heads == 1 and a.spec.head_dim == 16   # this rank's heads
    assert a.scaling == 16 ** -0.5
    assert Attention(4, 2, 16, 0).spec == FULL                  # the default: full, paged
    assert Attention(4, 2, 16, 0, spec=LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2,
                                                 scale=0.5)).scaling == 0.5
    sliding = LayerSpec(attention=AttentionKind.SLIDING, sliding_window=4096, head_dim=16,
                        v_head_dim=16, num_kv_heads=2)
    # a window and a soft-cap travel with the spec to the backend (which checks them)
    assert Attention(4, 2, 16, 5, spec=sliding).spec.sliding_window == 4096
    capped = Attention(4, 2, 16, 0, spec=LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2,
                                                   logit_softcap=50.0))
    assert capped.spec.logit_softcap == 50.0 and capped.sinks is None
    with_sinks = Attention(2, 1, 16, 0, spec=LayerSpec(head_dim=16, v_head_dim=16,
                                                       num_kv_heads=2, sinks=True))
    assert with_sinks.sinks.shape == (2,) and with_sinks.sinks.dtype == torch.float32
    with_sinks.sinks.weight_loader(with_sinks.sinks, torch.tensor([0.5, -1.0]))
    assert with_sinks.sinks.tolist() == [0.5, -1.0]
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\)"):
        with_sinks.sinks.weight_loader(with_sinks.sinks, torch.zeros(3))
    latent = LayerSpec(attention=AttentionKind.LATENT, cache=CacheKind.LATENT_KV,
                       head_dim=16, v_head_dim=16, num_kv_heads=1)
    with pytest.raises(NotImplementedError, match=r"layer 5: latent attention"):
        Attention(4, 1, 16, 5, spec=latent)
    with pytest.raises(NotImplementedError, match="recurrent_state"):
        Attention(4, 2, 16, 0, spec=LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2,
                                              cache=CacheKind.RECURRENT_STATE))


@pytest.mark.parametrize("name", sorted(ATTENTION_BACKENDS))
def test_backends_refuse_layers_they_cannot_run(name):
    cls = ATTENTION_BACKENDS[name]
    cls.check_layer_specs([FULL, FULL])
    # a window and a soft-cap come from the spec and every kernel path runs them
    windowed = LayerSpec(attention=AttentionKind.SLIDING, sliding_window=8, logit_softcap=30.0,
                         head_dim=16, v_head_dim=16, num_kv_heads=2)
    cls.check_layer_specs([FULL, windowed])
    # sinks: the Attention layer's learned tensor, passed to every kernel path
    sinks = LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2, sinks=True)
    cls.check_layer_specs([FULL, sinks, windowed])
    linear = LayerSpec(attention=AttentionKind.LINEAR, cache=CacheKind.RECURRENT_STATE,
                       head_dim=16, v_head_dim=16, num_kv_heads=2)
    with pytest.raises(NotImplementedError, match=r"layer 0 needs linear attention"):
        cls.check_layer_specs([linear])


def test_create_backend_checks_the_specs():
    b = create_attention_backend("torch_native", 4, 2, 16, layer_specs=[FULL] * 3)
    assert b.layer_specs == (FULL,) * 3
    latent = LayerSpec(attention=AttentionKind.LATENT, cache=CacheKind.LATENT_KV,
                       head_dim=16, v_head_dim=16, num_kv_heads=2)
    # MLA layers attend over the latent pool themselves on the torch path; Triton refuses
    create_attention_backend("torch_native", 4, 2, 16, layer_specs=[FULL, latent])
    with pytest.raises(NotImplementedError, match="latent attention"):
        ATTENTION_BACKENDS["triton"].check_layer_specs([FULL, latent])


def test_kv_pool_from_specs():
    pool = build_kv_pool([FULL] * 3, 64, 4, torch.float32, "cpu")
    assert pool.num_layers == 3 and tuple(pool.k_buffers[0].shape) == (68, 2, 16)
    assert kv_bytes_per_token([FULL] * 3, torch.float16) == 2 * 3 * 2 * 16 * 2
    latent = LayerSpec(attention=AttentionKind.LATENT, cache=CacheKind.LATENT_KV,
                       head_dim=16, v_head_dim=16, num_kv_heads=1)
    with pytest.raises(NotImplementedError, match=r"layers \[1\] keep a latent_kv cache"):
        build_kv_pool([FULL, latent], 64, 4, torch.float32, "cpu")
    with pytest.raises(NotImplementedError, match="latent pool has one width"):
        build_kv_pool([latent], 64, 4, torch.float32, "cpu")   # no kv_lora_rank


def test_latent_kv_pool_from_specs():
    """DeepSeek's MLA: one [slots, 1, kv_lora_rank + qk_rope_head_dim] tensor per layer,
    the paged pool's pages and padding sink, no V buffers."""
    from engine.kv.pool import LatentKVPool
    latent = LayerSpec(attention=AttentionKind.LATENT, cache=CacheKind.LATENT_KV,
                       head_dim=24, v_head_dim=16, num_kv_heads=1, kv_lora_rank=32,
                       qk_rope_head_dim=8)
    assert latent.latent_dim == 40 and latent.per_rank(2) is latent
    pool = build_kv_pool([latent] * 3, 64, 4, torch.float32, "cpu")
    assert isinstance(pool, LatentKVPool) and pool.num_layers == 3
    assert tuple(pool.k_buffers[2].shape) == (68, 1, 40) and pool.v_buffers == [None] * 3
    assert pool.capacity_tokens == 64 and pool.nbytes == 3 * 68 * 40 * 4
    assert kv_bytes_per_token([latent] * 3, torch.bfloat16) == 3 * 40 * 2
    pages = pool.alloc_pages(2)
    assert pool.slots_for(pages, 0, 5)[:4] == [pages[0] * 4 + i for i in range(4)]
    pool.free_pages(pages)
    assert pool.free_tokens() == 64
    # layers of other K/V shapes (Gemma 4's global layers) are summed, each at its own
    assert kv_bytes_per_token([FULL, FULL.per_rank(2)], torch.float32) == 2 * (2 + 1) * 16 * 4


def test_kv_pool_per_layer_shapes_and_kv_sharing():
    """Gemma 4: a layer of another K/V shape gets buffers at its own shape; a layer that
    reads another's K/V (``kv_source_layer``) gets its source's tensors and no memory, in
    the undivided pool and with the windowed pool."""
    from dataclasses import replace

    from engine.kv.windowed import PoolSplit, build_pools

    wide = replace(FULL, head_dim=32, v_head_dim=32, num_kv_heads=1)
    specs = [FULL, wide, replace(FULL, kv_source_layer=0), replace(wide, kv_source_layer=1)]
    pool = build_kv_pool(specs, 64, 4, torch.float32, "cpu")
    assert pool.num_layers == 2 and len(pool.k_buffers) == 4
    assert pool.k_buffers[2] is pool.k_buffers[0] and pool.v_buffers[3] is pool.v_buffers[1]
    assert tuple(pool.k_buffers[1].shape) == (68, 1, 32)
    assert pool.nbytes == 2 * 68 * (2 * 16 + 32) * 4
    assert kv_bytes_per_token(specs, torch.float16) == 2 * (2 * 16 + 32) * 2
    # sliding layers 0 and 2 (2 reads 0) in the windowed pool, full layers 1 and 3 (3 reads 1)
    slide = replace(FULL, attention=AttentionKind.SLIDING, sliding_window=8)
    specs = [slide, wide, replace(slide, kv_source_layer=0), replace(wide, kv_source_layer=1)]
    full, win = build_pools(specs, PoolSplit(64, 32), 4, torch.float32, "cpu")
    assert win.num_layers == 1 and full.k_buffers[0] is win.k_buffers[0]
    assert full.k_buffers[2] is win.k_buffers[0] and full.v_buffers[3] is full.v_buffers[1]
    assert tuple(full.k_buffers[3].shape) == (68, 1, 32)
    with pytest.raises(ValueError, match="earlier layer"):
        build_kv_pool([replace(FULL, kv_source_layer=1), FULL], 64, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="same K/V shape"):
        build_kv_pool([FULL, replace(wide, kv_source_layer=0)], 64, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="paged K/V only"):
        LayerSpec(attention=AttentionKind.LATENT, cache=CacheKind.LATENT_KV, head_dim=8,
                  v_head_dim=8, num_kv_heads=1, kv_source_layer=0)
