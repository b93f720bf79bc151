"""Speculative decoding with model proposers on an accelerator (marker gpu): with the
target's decode graphs (which keep an EAGLE head's hidden states) and the draft's own
graphs (a STANDALONE draft model's decode graphs, an EAGLE head's DECODE-step graphs,
``engine/speculative/head_graphs.py``), greedy float32 output must be the target's without
speculation, and the head graphs' drafts must be those of the head's eager steps."""

import pytest

from engine.device import resolve_device

pytestmark = pytest.mark.gpu
DEVICE = resolve_device("auto")
if DEVICE == "cpu":
    pytest.skip("needs a CUDA or XPU device", allow_module_level=True)


@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE", "EAGLE3"])
def test_model_proposers_with_graphs_keep_greedy_output(tmp_path, algo):
    from test_speculative_models import PROMPTS, save_head, save_knowing_pair, save_llama

    from engine import LLM, SamplingParams

    kw = dict(device=DEVICE, dtype="float32", max_total_tokens=4096, chunked_prefill_size=16,
              enable_xpu_graph=True)
    if algo == "EAGLE":
        target, draft = save_knowing_pair(tmp_path)
    else:
        target = str(tmp_path / "t")
        save_llama(target, layers=4, seed=3)
        draft = str(tmp_path / "d")
        if algo == "EAGLE3":
            save_head(draft, True, seed=5)
        else:
            save_llama(draft, layers=1, seed=11)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM(target, **kw)
    want = [o.token_ids for o in base.generate(PROMPTS, sp)]
    spec = LLM(target, speculative_algorithm=algo, speculative_draft_model_path=draft,
               speculative_num_steps=3, **kw)
    assert spec.runner.graph_runner is not None  # the decode graphs stay on
    if algo != "STANDALONE":  # and the head's draft steps replay graphs
        assert spec.scheduler.spec.proposer.head_graphs is not None
    spec.scheduler.check_kv = True
    assert [o.token_ids for o in spec.generate(PROMPTS, sp)] == want
    st = spec.scheduler.stats
    assert st["spec_proposed_tokens"] > 0
    if algo == "EAGLE":  # the head that knows the target: drafts accepted through graphs
        assert st["spec_accepted_tokens"] > 0


def _eagle3(tmp_path, dtype, caplog):
    from test_head_graphs import eagle3_engine, eagle3_paths

    target, head = eagle3_paths(tmp_path)
    kw = dict(device=DEVICE, dtype=dtype, max_total_tokens=4096, chunked_prefill_size=16,
              enable_xpu_graph=True)
    with caplog.at_level("INFO"):
        llm = eagle3_engine(target, head, **kw)
    return llm, target, head, kw


# (request lengths, chain lengths): batches of a bucket's size (1, 2, 4, 8) and padded ones;
# the engine's chains are 3 long (--speculative-num-steps 3): a longest chain of 3 replays
# the whole chain's graph (2 steps after the first draft), a shorter one the one-step graph
CHAINS = [([5], [3]), ([7, 30], [3, 3]), ([5, 9, 17, 40], [3, 2, 3, 1]),
          ([4, 6, 8, 10, 12, 14, 16, 90], [3] * 8), ([5, 9, 17], [3, 2, 3]),
          ([4, 6, 8, 10, 12], [2, 2, 1, 2, 2]), ([7, 30], [2, 2])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle3_head_graph_drafts_match_eager_steps(tmp_path, dtype, caplog):
    """The chain through the captured graphs against the head's eager DECODE steps from the
    same draft state (seeded random head and target states). float32: every case; bfloat16:
    the batches of a bucket's size whose chains are all as long (a padded step's GEMMs may
    round differently from the eager step's smaller ones)."""
    from test_head_graphs import chain_matches_steps

    llm, *_ = _eagle3(tmp_path, dtype, caplog)
    prop = llm.scheduler.spec.proposer
    runner = prop.head_graphs
    assert runner is not None and runner.graphs, caplog.text
    # chain buckets 1, 2, 4, 8; catch-up row buckets 1, 2, 4, 8, 16, ..., 64
    # and chains of 2 steps (after the catch-up's draft) as one graph per batch bucket
    assert sorted(runner.graphs) == [1, 2, 4, 8] and max(runner.row_graphs) == 64
    assert sorted(runner.chain_graphs) == [1, 2, 4, 8] and runner.steps == 2
    assert f"captured {8 + len(runner.row_graphs)} EAGLE head graphs" in caplog.text
    assert "EAGLE head graphs: a replay matches the eager step (catch-up" in caplog.text
    assert "round of 2 steps: max |replay - eager|" in caplog.text
    assert llm.scheduler.spec.info()["head_graphs"] is True
    for lens, ks in CHAINS:
        if dtype != "float32" and (len(lens) not in runner.buckets or len(set(ks)) > 1):
            continue  # a padded step (the eager loop's batch shrinks as chains end)
        (chain, chain_ids), (steps, step_ids) = chain_matches_steps(prop, runner, lens, ks)
        assert [len(d) for d in steps] == ks
        assert chain == steps and chain_ids == step_ids, (lens, ks)



# (positions the head has, new positions of the round, chain lengths)
# (chains of 3 replay the whole chain's graph, shorter ones the one-step graph)
ROUNDS = [([5], [1], [3]), ([5, 9, 17, 40], [4, 1, 2, 3], [3, 2, 3, 1]),
          ([4, 6, 8, 10, 12], [2, 2, 3, 1, 4], [2, 2, 1, 1, 2]), ([5, 7], [2, 3], [1, 1]),
          ([9] * 8, [4] * 8, [3] * 8), ([30], [60], [3]), ([7, 30], [2, 3], [2, 2])]


def test_eagle3_round_graphs_match_an_eager_round(tmp_path, caplog):
    """float32: a whole round through the graphs (the catch-up as DECODE rows, then the
    chain) against an eager EXTEND and eager DECODE steps, from the same draft state."""
    from test_head_graphs import round_matches_eager

    llm, *_ = _eagle3(tmp_path, "float32", caplog)
    prop = llm.scheduler.spec.proposer
    for lens, news, ks in ROUNDS:
        (graph, graph_ids), (eager, eager_ids) = round_matches_eager(prop, prop.head_graphs,
                                                                     lens, news, ks)
        assert [len(d) for d in eager] == ks
        assert graph == eager and graph_ids == eager_ids, (lens, news, ks)


def test_eagle3_generation_with_head_graphs_keeps_output_and_drafts(tmp_path, caplog):
    """float32 greedy generation: EAGLE-3 with head graphs = the target without speculation,
    and its every proposal = an engine's whose head steps run eagerly; graph rounds ran."""
    from test_head_graphs import eagle3_engine, generate_with_drafts
    from test_speculative_models import PROMPTS

    from engine import LLM, SamplingParams

    llm, target, head, kw = _eagle3(tmp_path, "float32", caplog)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(target, **kw).generate(PROMPTS, sp)]
    runner = llm.scheduler.spec.proposer.head_graphs
    assert runner is not None
    calls = []
    orig = runner.run_round
    runner.run_round = lambda *a: calls.append(len(a[0])) or orig(*a)
    out, drafts = generate_with_drafts(llm, PROMPTS, sp)
    assert out == want and calls
    eager = eagle3_engine(target, head, **kw)
    eager.scheduler.spec.proposer.head_graphs = None
    out_e, drafts_e = generate_with_drafts(eager, PROMPTS, sp)
    assert out_e == want and drafts == drafts_e
