"""The EAGLE head's DECODE chain on static buffers (``engine/speculative/head_graphs.py``,
issue 26) on the CPU, where nothing is captured: the host-side packing against hand values,
the chain's drafts against the eager step-by-step loop (``ModelProposer.decode_steps``) on
the same draft state, and a whole greedy generation (output = the target's without
speculation, drafts = those of an engine with eager head steps). The GPU tests
(``test_speculative_models_gpu.py``) run the same checks on captured graphs."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.params import SamplingParams


def test_pack_chain_positions_slots_and_padding():
    from engine.speculative.head_graphs import pack_chain

    # request A: req_to_token row 5, base 100, 7 KV entries, 3 steps; B: row 3, base 0,
    # 2 entries, 1 step; the batch padded to 4
    got = pack_chain([(5, 100, 7, [40, 41, 42], 9), (3, 0, 2, [8], 4)], steps=3, gbs=4)
    pad = [0, 0, 0, 0, 1, 0]
    want = torch.tensor([
        # (id, rotary position, row, slot, seq_len, req_to_token column) per row
        [[9, 107, 5, 40, 8, 7], [4, 2, 3, 8, 3, 2], pad, pad],
        [[0, 108, 5, 41, 9, 8], pad, pad, pad],
        [[0, 109, 5, 42, 10, 9], pad, pad, pad],
    ]).transpose(1, 2)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    with pytest.raises(ValueError):
        pack_chain([(5, 0, 0, [1, 2], 0)], steps=1, gbs=1)
    with pytest.raises(ValueError):
        pack_chain([(5, 0, 0, [1], 0)] * 3, steps=1, gbs=2)


class _Req:
    finished = False
    req_pool_idx = 1

    def __init__(self, rid: str):
        self.rid = rid


def chain_matches_steps(prop, runner, lens, ks, seed=0):
    """Catch up ``len(lens)`` fresh draft sequences (random ids and target states, bases
    0, 3, 6...), then draft the rest of their chains twice from the same state: through
    ``runner`` and through the eager ``decode_steps``. Returns both drafts and both KV ids
    lists (equal when the chain is right)."""
    from engine.executor.schedule_batch import ScheduleBatch
    from engine.forward_batch import ForwardMode
    from engine.speculative.draft import DraftSeq
    from engine.speculative.head_graphs import draft_chain

    g = torch.Generator().manual_seed(seed)
    head = prop.head
    width = head.fc.weight.shape[1] if head.eagle3 else head.hidden_size
    seqs, locs = [], []
    for j, L in enumerate(lens):
        seq = prop.seqs[f"c{j}"] = DraftSeq(_Req(f"c{j}"), base=3 * j)
        ids = torch.randint(3, head.mc.vocab_size, (L,), generator=g).tolist()
        locs += prop._grow(seq, ids)
        seqs.append(seq)
    hidden = torch.randn(sum(lens), width, generator=g).to(prop.device, head.dtype)
    batch = ScheduleBatch(ForwardMode.EXTEND, seqs, [0] * len(seqs), list(lens),
                          [True] * len(seqs), locs)
    toks, nxt = prop.forward(batch, seqs, hidden)
    first = toks.tolist()
    live = [(j, s, nxt[j:j + 1]) for j, s in enumerate(seqs)]
    results = []
    for chained in (True, False):
        out = [[t] for t in first]
        if chained:
            assert draft_chain(prop, runner, live, out, ks)
        else:
            prop.decode_steps(live, out, ks)
        prop.check()
        results.append((out, [list(s.ids) for s in seqs]))
        for s, L in zip(seqs, lens):
            prop.truncate(s, L)
    for j in range(len(lens)):
        prop.drop(f"c{j}")
    return results


def eagle3_paths(root):
    from test_speculative_models import save_head, save_llama

    save_llama(root / "t", layers=4, seed=3)
    save_head(root / "h", True, seed=5)
    return str(root / "t"), str(root / "h")


def eagle3_engine(target, head, **kw):
    from engine import LLM

    return LLM(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
               speculative_num_steps=3, **kw)


def generate_with_drafts(engine, prompts, sp):
    """The greedy outputs and every proposal of the engine's proposer."""
    prop, seen = engine.scheduler.spec.proposer, []
    orig = prop.propose_reqs
    prop.propose_reqs = lambda reqs, ks: seen.append(orig(reqs, ks)) or seen[-1]
    engine.scheduler.check_kv = True
    return [o.token_ids for o in engine.generate(prompts, sp)], seen


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return eagle3_paths(tmp_path_factory.mktemp("head_graphs"))


@pytest.mark.parametrize("lens,ks", [([5], [4]), ([5, 9, 17], [4, 2, 3]),
                                     ([4, 6, 8, 10, 12], [3, 3, 4, 2, 4])])
def test_chain_drafts_match_eager_steps(paths, lens, ks):
    from test_speculative_models import KW

    from engine.speculative.head_graphs import HeadGraphRunner

    prop = eagle3_engine(*paths, **KW).scheduler.spec.proposer
    assert prop.head_graphs is None  # the CPU: no graphs
    runner = HeadGraphRunner(prop, 8, capture=False)
    (chain, chain_ids), (steps, step_ids) = chain_matches_steps(prop, runner, lens, ks)
    assert [len(d) for d in steps] == ks
    assert chain == steps and chain_ids == step_ids


def test_generation_through_the_chain_keeps_output_and_drafts(paths):
    from test_speculative_models import KW, PROMPTS

    from engine import LLM
    from engine.speculative.head_graphs import HeadGraphRunner

    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(paths[0], **KW).generate(PROMPTS, sp)]
    out, eager = generate_with_drafts(eagle3_engine(*paths, **KW), PROMPTS, sp)
    assert out == want
    llm = eagle3_engine(*paths, **KW)
    prop = llm.scheduler.spec.proposer
    prop.head_graphs = runner = HeadGraphRunner(prop, 4, capture=False)
    calls = []
    orig_chain = runner.run_chain
    runner.run_chain = lambda *a: calls.append(len(a[0])) or orig_chain(*a)
    out, chained = generate_with_drafts(llm, PROMPTS, sp)
    assert out == want and chained == eager
    assert calls and max(calls) == len(PROMPTS)
    assert llm.scheduler.spec.info()["head_graphs"] is True


def test_start_up_check_passes_a_right_chain_and_drops_a_wrong_one(paths, monkeypatch):
    from test_speculative_models import KW

    from engine.speculative.head_graphs import HeadGraphRunner, check_head_graphs

    prop = eagle3_engine(*paths, **KW).scheduler.spec.proposer
    runner = HeadGraphRunner(prop, 4, capture=False)
    rows = prop.req_pool.available()
    ok, detail = check_head_graphs(prop, runner)
    assert ok, detail
    assert prop.used_tokens() == 0 and prop.req_pool.available() == rows
    real = runner._step

    def stale(bs):  # a replay that leaves the previous step's hidden state
        keep = runner.hidden[:bs].clone()
        real(bs)
        runner.hidden[:bs].copy_(keep)

    monkeypatch.setattr(runner, "_step", stale)
    ok, detail = check_head_graphs(prop, runner)
    assert not ok and "max |replay - eager|" in detail
    assert prop.used_tokens() == 0
