"""The windowed KV pool (engine/kv/windowed.py) on the embedded SmolLM2 (fp32, CPU) whose
layers are made sliding-window ones (two of every three, window 24) by overriding
``layer_specs``: greedy tokens with the windowed pool equal those with one pool for every
layer (``--swa-full-tokens-ratio 0``), alone and batched, over decodes well past the window
(its pages come back), with the prefix cache hit and missed, across chunked-prefill edges
and under preemption. The page accounting of both pools is checked after every step."""

from dataclasses import replace

import pytest

from engine.layer_spec import AttentionKind

pytestmark = pytest.mark.slow

W = 24
HEADER = ("You are a careful assistant. Answer in one short sentence, plainly, without "
          "lists. The user is curious about geography and history.\n")
QUESTIONS = ["Q: What is the capital of France?\nA:", "Q: Who built the pyramids?\nA:",
             "Q: Name a river in Egypt.\nA:"]


@pytest.fixture(scope="module", autouse=True)
def windowed_model():
    from engine.models.llama import LlamaForCausalLM

    orig = LlamaForCausalLM.layer_specs

    def specs(self):
        return [replace(s, attention=AttentionKind.SLIDING, sliding_window=W) if i % 3 != 2
                else s for i, s in enumerate(orig(self))]

    import engine.layers.attention as attention
    from engine.layer_spec import unsupported_feature

    def runs_windows(spec, kinds, **kw):  # the backends run windows; the layer may, too
        return unsupported_feature(spec, kinds | {AttentionKind.SLIDING}, sliding_window=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LlamaForCausalLM, "layer_specs", specs)
        mp.setattr(attention, "unsupported_feature", runs_windows)
        yield


def _llm(**kw):
    from engine import LLM

    kw.setdefault("max_total_tokens", 2048)
    llm = LLM(model_path=None, device="cpu", **kw)
    llm.scheduler.check_kv = True
    return llm


def _greedy(llm, prompts, n=40):
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp)]


@pytest.fixture(scope="module")
def off():
    llm = _llm(swa_full_tokens_ratio=0, disable_radix_cache=True, chunked_prefill_size=32)
    assert llm.runner.swa_pool is None
    return llm


def test_windowed_pool_matches_one_pool_alone_batched_and_cached(off):
    on = _llm(swa_full_tokens_ratio=0.25, page_size=4, chunked_prefill_size=16)
    pool = on.runner.swa_pool
    assert pool is not None and pool.window == W and pool.num_layers == 20
    prompts = [HEADER + q for q in QUESTIONS]
    want = {p: _greedy(off, [p])[0] for p in prompts}
    for p in prompts:  # alone: a miss, then the header hits
        assert _greedy(on, [p])[0] == want[p]
    # the decodes ran 40 tokens past a 24-token window; what is not free is the tree's
    assert on.scheduler.kv.used_tokens() == 0
    held = len(on.scheduler.kv.tree.tree_swa_pages())
    assert pool.num_free_pages + held == pool.num_pages
    assert held < on.scheduler.kv.tree.total_pages  # behind-window pages were given back
    # the next turn: the tree still holds the window before the last turn's end (a hit);
    # the header alone fell behind every window (its match is cut back, a miss)
    tok = on.tokenizer
    turn = tok.encode(prompts[0]) + want[prompts[0]] + tok.encode("\nQ: And why?\nA:")
    hits = on.scheduler.stats["prefix_cache_hits"]
    assert _greedy(on, [turn]) == _greedy(off, [turn])
    assert on.scheduler.stats["prefix_cache_hits"] - hits >= len(tok.encode(prompts[0]))
    got = _greedy(on, prompts + prompts[:1])  # batched, the repeat hits a live twin
    assert got == [want[p] for p in prompts + prompts[:1]]


def test_long_decode_frees_pages_and_preemption_in_a_small_pool(off):
    """Windowed pool smaller than the batch's contexts: each request holds about W slots."""
    on = _llm(swa_full_tokens_ratio=0.25, page_size=4, chunked_prefill_size=16,
              max_total_tokens=400)
    pool = on.runner.swa_pool
    prompts = [HEADER + q for q in QUESTIONS] * 2
    got = _greedy(on, prompts, n=60)
    want = {p: _greedy(off, [p], n=60)[0] for p in set(prompts)}
    assert got == [want[p] for p in prompts]
    # six requests of ~100 tokens each ran in a windowed pool far smaller than their KV
    assert pool.capacity_tokens < 6 * 100
    assert on.scheduler.kv.used_tokens() == 0
