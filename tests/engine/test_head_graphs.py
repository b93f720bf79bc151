"""The EAGLE head's graph paths on static buffers (``engine/speculative/head_graphs.py``,
issue 26) on the CPU, where nothing is captured: the host-side packing against hand values;
the chain's drafts against the eager step-by-step loop (``ModelProposer.decode_steps``) and
a whole round (catch-up as DECODE rows, then the chain) against an eager EXTEND + steps, from
the same draft state, for a chain of the runner's usual length (the whole chain's function,
what its chain graph runs) and of another (the one-step function per step); a runner's
limits; the start-up check (catch-up, whole round, one step) (passes, and fails for a stale replay); and a whole
greedy generation (output = the target's without speculation, drafts = those of an engine
with eager head steps). The GPU tests (``test_speculative_models_gpu.py``) run the same
checks on captured graphs."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.params import SamplingParams


def test_pack_chain_positions_slots_and_padding():
    from engine.speculative.head_packing import pack_chain

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



def test_pack_rows_of_a_catch_up():
    from engine.speculative.head_packing import pack_rows

    # request A: row 5, base 100, 7 entries, 2 new rows; B: row 3, base 0, 2 entries, 1 row
    rows, last = pack_rows([(5, 100, 7, [40, 41], [9, 10]), (3, 0, 2, [8], [4])], rb=4,
                           nlast=3)
    want = torch.tensor([[9, 107, 5, 40, 8, 7], [10, 108, 5, 41, 9, 8], [4, 2, 3, 8, 3, 2],
                         [0, 0, 0, 0, 1, 0]]).T
    assert torch.equal(rows, want) and last.tolist() == [1, 2, 0]
    with pytest.raises(ValueError):
        pack_rows([(5, 0, 0, [1, 2], [3, 4])], rb=1, nlast=1)
    with pytest.raises(ValueError):
        pack_rows([(5, 0, 0, [1], [3, 4])], rb=4, nlast=1)

class _Req:
    finished = False
    req_pool_idx = 1

    def __init__(self, rid: str):
        self.rid = rid


def _catch_up(prop, seqs, feeds, hidden):
    """An eager catch-up EXTEND of ``feeds[j]`` for ``seqs[j]`` from target states
    ``hidden``; the first drafts (list) and the next hidden states [len(seqs), hidden]."""
    from engine.executor.schedule_batch import ScheduleBatch
    from engine.forward_batch import ForwardMode

    prefix, locs = [], []
    for seq, ids in zip(seqs, feeds):
        prefix.append(seq.kv_len)
        locs += prop._grow(seq, ids)
    batch = ScheduleBatch(ForwardMode.EXTEND, seqs, prefix, [len(f) for f in feeds],
                          [True] * len(seqs), locs)
    toks, nxt = prop.forward(batch, seqs, hidden)
    return toks.tolist(), nxt


def _random_feeds(prop, lens, g):
    from engine.speculative.head_graphs import hidden_in_width

    head = prop.head
    feeds = [torch.randint(3, head.mc.vocab_size, (n,), generator=g).tolist() for n in lens]
    hidden = torch.randn(sum(lens), hidden_in_width(head), generator=g)
    return feeds, hidden.to(prop.device, head.dtype)


def _fresh(prop, lens, g):
    """Fresh draft sequences (bases 0, 3, 6...) caught up eagerly over random ids and
    target states of ``lens`` positions."""
    from engine.speculative.draft import DraftSeq

    seqs = []
    for j in range(len(lens)):
        seqs.append(DraftSeq(_Req(f"c{j}"), base=3 * j))
        prop.seqs[f"c{j}"] = seqs[-1]
    return seqs, _catch_up(prop, seqs, *_random_feeds(prop, lens, g))


def _twice(prop, seqs, keep, run):
    """``run(chained)`` for True then False from the same draft state; each time the drafts
    and the KV ids, then the sequences cut back to ``keep`` entries (dropped at the end)."""
    results = []
    for chained in (True, False):
        out = run(chained)
        prop.check()
        results.append((out, [list(s.ids) for s in seqs]))
        for s, n in zip(seqs, keep):
            prop.truncate(s, n)
    for s in seqs:
        prop.drop(s.req.rid)
    return results


def chain_matches_steps(prop, runner, lens, ks, seed=0):
    """Catch up fresh draft sequences of ``lens`` positions, then draft the rest of their
    chains twice from the same state: through ``runner`` (the chain) and through the eager
    ``decode_steps``. Returns both drafts and KV ids lists (equal when the chain is right)."""
    from engine.speculative.head_graphs import draft_chain

    seqs, (first, nxt) = _fresh(prop, lens, torch.Generator().manual_seed(seed))
    live = [(j, s, nxt[j:j + 1]) for j, s in enumerate(seqs)]

    def run(chained):
        out = [[t] for t in first]
        if chained:
            assert draft_chain(prop, runner, live, out, ks)
        else:
            prop.decode_steps(live, out, ks)
        return out

    return _twice(prop, seqs, list(lens), run)


def round_matches_eager(prop, runner, lens, news, ks, seed=0):
    """Fresh draft sequences of ``lens`` positions, then a round of ``news[j]`` new
    positions (random ids and target states) and chains of ``ks[j]`` drafts twice: through
    ``runner`` (catch-up graph + chain) and eagerly (an EXTEND, then ``decode_steps``).
    Returns both drafts and KV ids lists."""
    from engine.speculative.head_graphs import draft_round

    g = torch.Generator().manual_seed(seed)
    seqs, _ = _fresh(prop, lens, g)
    feeds, hidden = _random_feeds(prop, news, g)
    offs = [sum(news[:j]) for j in range(len(news) + 1)]

    def run(chained):
        if chained:
            out = [[] for _ in seqs]
            work = [[j, s, feeds[j], hidden[offs[j]:offs[j + 1]]] for j, s in enumerate(seqs)]
            assert draft_round(prop, runner, work, out, ks)
            return out
        first, nxt = _catch_up(prop, seqs, feeds, hidden)
        out = [[t] for t in first]
        live = [(j, s, nxt[j:j + 1]) for j, s in enumerate(seqs) if ks[j] > 1]
        if live:
            prop.decode_steps(live, out, ks)
        return out

    return _twice(prop, seqs, list(lens), run)


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


@pytest.fixture(scope="module")
def proposer(paths):
    from test_speculative_models import KW

    prop = eagle3_engine(*paths, **KW).scheduler.spec.proposer
    assert prop.head_graphs is None  # the CPU: no graphs
    return prop


def spied(runner):
    """``runner`` counting the calls of its graph functions (``_catch_up``, the whole
    chain's ``_chain_steps``, the one-step ``_step``)."""
    calls = {"_catch_up": 0, "_chain_steps": 0, "_step": 0}
    for name in calls:
        real = getattr(runner, name)
        setattr(runner, name, lambda n, _real=real, _name=name:
                calls.__setitem__(_name, calls[_name] + 1) or _real(n))
    return calls


# a chain of the runner's steps (3 for the longest, k = 4) is one call of the whole chain's
# function; a runner of 4 steps runs the same chains one step at a time
@pytest.mark.parametrize("graph_steps", [3, 4])
@pytest.mark.parametrize("lens,ks", [([5], [4]), ([5, 9, 17], [4, 2, 3]),
                                     ([4, 6, 8, 10, 12], [3, 3, 4, 2, 4]),
                                     ([5, 9, 17, 40], [4, 2, 4, 1])])  # one chain complete
def test_chain_drafts_match_eager_steps(proposer, lens, ks, graph_steps):
    from engine.speculative.head_graphs import HeadGraphRunner

    runner = HeadGraphRunner(proposer, 8, capture=False, steps=graph_steps)
    calls = spied(runner)
    (chain, chain_ids), (steps, step_ids) = chain_matches_steps(proposer, runner, lens, ks)
    assert [len(d) for d in steps] == ks
    assert chain == steps and chain_ids == step_ids
    whole = graph_steps == max(ks) - 1
    assert calls == {"_catch_up": 0, "_chain_steps": int(whole),
                     "_step": 0 if whole else max(ks) - 1}


@pytest.mark.parametrize("lens,news,ks", [([5], [1], [4]), ([5, 9, 17], [4, 1, 2], [4, 2, 3]),
                                          ([4, 6, 8, 10, 12], [2, 2, 3, 1, 4], [3, 3, 4, 1, 4]),
                                          ([5, 7], [2, 3], [1, 1])])
@pytest.mark.parametrize("graph_steps", [3, 4])
def test_round_drafts_match_an_eager_round(proposer, lens, news, ks, graph_steps):
    from engine.speculative.head_graphs import HeadGraphRunner

    runner = HeadGraphRunner(proposer, 8, 16, capture=False, steps=graph_steps)
    calls = spied(runner)
    (chain, chain_ids), (eager, eager_ids) = round_matches_eager(proposer, runner, lens, news,
                                                                 ks)
    assert [len(d) for d in eager] == ks
    assert chain == eager and chain_ids == eager_ids
    steps = max(ks) - 1
    whole = steps == graph_steps
    assert calls == {"_catch_up": 1, "_chain_steps": int(whole),
                     "_step": 0 if whole else steps}


def test_a_runner_refuses_past_its_buckets(proposer):
    """Batches, catch-ups and chains past what the runner holds: can_run says no, the
    runs raise, draft_round leaves the round to the eager path (nothing done)."""
    from engine.speculative.head_graphs import HeadGraphRunner, draft_round

    runner = HeadGraphRunner(proposer, 2, 8, capture=False, steps=2)
    assert runner.can_run(2, 8, 2)
    assert not runner.can_run(3) and not runner.can_run(1, 9) and not runner.can_run(1, 1, 3)
    with pytest.raises(ValueError):
        runner.run_chain([(1, 0, 0, [1, 2, 3], 0)], None, 3)
    work = [[0, None, [5], torch.zeros(1, 1)]]
    assert not draft_round(proposer, runner, work, [[]], [4])


def test_generation_through_the_graph_paths_keeps_output_and_drafts(paths):
    """Rounds on the static buffers (a catch-up of up to 16 rows; the prompts' longer
    first catch-ups run eagerly, then the chain): the output is the target's, the drafts
    those of an engine with eager head steps."""
    from test_speculative_models import KW, PROMPTS

    from engine import LLM
    from engine.speculative.head_graphs import HeadGraphRunner

    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(paths[0], **KW).generate(PROMPTS, sp)]
    out, eager = generate_with_drafts(eagle3_engine(*paths, **KW), PROMPTS, sp)
    assert out == want
    llm = eagle3_engine(*paths, **KW)
    prop = llm.scheduler.spec.proposer
    prop.head_graphs = runner = HeadGraphRunner(prop, 4, 16, capture=False, steps=2)
    calls = {"run_chain": 0, "run_round": 0}
    for name in calls:
        real = getattr(runner, name)
        setattr(runner, name, lambda *a, _real=real, _name=name:
                calls.__setitem__(_name, calls[_name] + 1) or _real(*a))
    out, chained = generate_with_drafts(llm, PROMPTS, sp)
    assert out == want and chained == eager
    assert calls["run_chain"] and calls["run_round"], calls
    assert llm.scheduler.spec.info()["head_graphs"] is True


@pytest.mark.parametrize("broken", ["_step", "_catch_up", "_chain_steps"])
def test_start_up_check_passes_right_graphs_and_drops_a_wrong_one(proposer, monkeypatch,
                                                                  broken):
    from engine.speculative.head_graphs import HeadGraphRunner, check_head_graphs

    prop = proposer
    runner = HeadGraphRunner(prop, 4, 16, capture=False, steps=2)
    rows = prop.req_pool.available()
    ok, detail = check_head_graphs(prop, runner)
    assert ok and "catch-up: max |replay - eager|" in detail and "chain: " in detail
    assert "round of 2 steps: max |replay - eager|" in detail
    assert prop.used_tokens() == 0 and prop.req_pool.available() == rows
    real = getattr(runner, broken)

    def stale(n):  # a replay that leaves the chain's previous hidden states
        keep = runner.hidden.clone()
        real(n)
        runner.hidden.copy_(keep)

    monkeypatch.setattr(runner, broken, stale)
    ok, detail = check_head_graphs(prop, runner)
    assert not ok
    assert prop.used_tokens() == 0 and prop.req_pool.available() == rows
