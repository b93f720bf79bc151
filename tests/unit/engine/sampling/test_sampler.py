"""Tests of the batched sampler (engine/sampling.py) against hand computations and HF.

References: hand-computed cut sets and distributions, plain-Python integer hashing,
torch.log_softmax / argmax of the raw logits, and transformers'
RepetitionPenaltyLogitsProcessor. Distributions are checked with a chi-square bound on many
seeded draws (fixed seeds, so the tests are deterministic, not flaky).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.device import resolve_device
from engine.sampling.noise import _mix32, seed_keys, seeded_gumbel
from engine.sampling.params import SamplingParams as SP
from engine.sampling.sampler import (
    SamplingBatchInfo,
    apply_cuts,
    apply_logits_processors,
    sample,
)

PROBS = [0.5, 0.3, 0.15, 0.05]
# chi-square critical values at p = 1e-4 for df = 1..4 (standard tables)
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51}


def _run(logits, params, device="cpu", **kw):
    info = SamplingBatchInfo.from_params(params, logits.shape[1], device, **kw)
    return sample(logits.to(device), info).next_token_ids.cpu()


def _draw(row: torch.Tensor, n: int, **sp) -> torch.Tensor:
    """n draws from one logits row: the row repeated n times, seeds 0..n-1."""
    logits = row.unsqueeze(0).repeat(n, 1)
    return _run(logits, [SP(seed=i, **sp) for i in range(n)])


def _chi2(tokens: torch.Tensor, expected: dict[int, float]) -> float:
    n = tokens.numel()
    total = sum(expected.values())
    stat = 0.0
    for tok, w in expected.items():
        e = n * w / total
        stat += (int((tokens == tok).sum()) - e) ** 2 / e
    return stat


def _crafted() -> torch.Tensor:
    return torch.tensor(PROBS, dtype=torch.float64).log().to(torch.float32)


# ---- counter-based noise -----------------------------------------------------------------

def _lowbias32_ref(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_matches_plain_python_hash():
    rng = random.Random(0)
    xs = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.getrandbits(32) for _ in range(2000)]
    got = _mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [_lowbias32_ref(x) for x in xs]


def test_seeded_noise_is_uniform_and_keyed():
    k1, k2 = seed_keys(7, 0)
    g = seeded_gumbel(torch.tensor([[k1]]), torch.tensor([[k2]]), torch.arange(50_000))
    u = torch.exp(-torch.exp(-g.double()))  # back to the uniform
    assert torch.isfinite(g).all()
    hist = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert ((hist - 5000).abs() < 5000 * 0.06).all(), hist
    k1b, k2b = seed_keys(7, 1)
    g2 = seeded_gumbel(torch.tensor([[k1b]]), torch.tensor([[k2b]]), torch.arange(50_000))
    assert abs(torch.corrcoef(torch.stack([g[0], g2[0]]))[0, 1]) < 0.03


# ---- greedy and logit_bias ---------------------------------------------------------------

def test_top_k_1_and_temperature_0_equal_greedy():
    torch.manual_seed(0)
    logits = torch.randn(16, 300) * 3
    params = [SP(top_k=1, seed=i if i % 2 else None, top_p=0.5) for i in range(8)]
    params += [SP(temperature=0.0, min_p=0.5) for _ in range(8)]
    assert torch.equal(_run(logits, params), logits.argmax(-1))


def test_all_greedy_fast_path_builds_nothing():
    torch.manual_seed(1)
    logits = torch.randn(5, 100)
    info = SamplingBatchInfo.from_params([SP(temperature=0.0)] * 5, 100, "cpu")
    assert info.is_all_greedy and not info.needs_processing
    assert info.temperatures is None and info.top_ks is None and info.seeded_rows is None
    assert torch.equal(sample(logits, info).next_token_ids, logits.argmax(-1))


def test_logit_bias_forces_and_bans():
    torch.manual_seed(2)
    V = 200
    logits = torch.randn(8, V)
    top = logits.argmax(-1)
    params = [SP(temperature=0.0, logit_bias={17: 100.0}), SP(seed=1, logit_bias={17: 100.0}),
              SP(logit_bias={42: 100.0, 3: -100.0}), SP(temperature=0.0, logit_bias={5: 2.0})]
    params += [SP(temperature=0.0, logit_bias={int(top[i]): -100.0}) for i in range(4, 8)]
    out = _run(logits, params)
    assert out[:3].tolist() == [17, 17, 42]
    biased = logits[3].clone()
    biased[5] += 2.0
    assert int(out[3]) == int(biased.argmax())
    for i in range(4, 8):  # banned: the runner-up wins
        assert int(out[i]) == int(logits[i].topk(2).indices[1])
    # banned tokens never appear when sampling
    flat = torch.zeros(V)
    draws = _draw(flat, 2000, logit_bias={t: -100.0 for t in range(0, V, 2)})
    assert (draws % 2 == 1).all()
    # ids outside the vocab are ignored, not an indexing error
    assert _run(logits[:1], [SP(temperature=0.0, logit_bias={V + 5: 100.0})]).item() == top[0]


# ---- seeds -------------------------------------------------------------------------------

def test_seeded_row_is_batch_invariant_over_steps():
    torch.manual_seed(3)
    V, steps = 1000, 6
    target = SP(seed=1234, temperature=0.8, top_p=0.9, top_k=40, presence_penalty=0.5)
    alone, batched, batched2 = [], [], []
    out_a: list[int] = []
    for s in range(steps):
        row = torch.randn(V) * 2
        others = torch.randn(4, V) * 2
        alone.append(int(_run(row[None], [target], output_ids=[list(out_a)])[0]))
        logits = torch.cat([others[:2], row[None], others[2:]])
        params = [SP(), SP(seed=99, top_k=5), target, SP(temperature=0.0), SP(min_p=0.1)]
        outs = [[1, 2], [3], list(out_a), [], [9]]
        batched.append(int(_run(logits, params, output_ids=outs)[2]))
        # the same row at position 0 of a different batch, with explicit steps
        logits2 = torch.cat([row[None], others])
        params2 = [target, SP(seed=5), SP(seed=6, temperature=1.5), SP(), SP(top_p=0.5)]
        steps2 = [s, 0, 3, 7, 1]
        outs2 = [list(out_a), [], [1, 1, 1], [2] * 7, [4]]
        batched2.append(int(_run(logits2, params2, output_ids=outs2, steps=steps2)[0]))
        out_a.append(alone[-1])
    assert alone == batched == batched2


def test_different_seeds_and_steps_differ():
    V = 1000
    flat = torch.zeros(1, V)
    seqs = {}
    for seed in (1, 2):
        seqs[seed] = [int(_run(flat, [SP(seed=seed)], steps=[s])[0]) for s in range(8)]
    assert seqs[1] != seqs[2]
    assert len(set(seqs[1])) > 1  # the noise changes with the step
    # same (seed, step) -> same token
    assert [int(_run(flat, [SP(seed=1)], steps=[s])[0]) for s in range(8)] == seqs[1]


# ---- cuts and distributions --------------------------------------------------------------

@pytest.mark.parametrize(
    "kw, allowed",
    [({"top_p": 0.8}, {0, 1}), ({"top_p": 0.7}, {0, 1}), ({"top_p": 0.85}, {0, 1, 2}),
     ({"top_p": 0.3}, {0}), ({"min_p": 0.2}, {0, 1, 2}), ({"min_p": 0.5}, {0, 1}),
     ({"top_k": 3}, {0, 1, 2}), ({"top_k": 3, "top_p": 0.82}, {0, 1}),
     ({"top_k": 3, "top_p": 0.9}, {0, 1, 2}),
     ({"top_k": 2, "min_p": 0.7}, {0}), ({}, {0, 1, 2, 3})])
def test_cut_sets_and_frequencies(kw, allowed):
    # probs [0.5, 0.3, 0.15, 0.05]; hand-computed kept sets. top_k + top_p: top_p is measured
    # after top_k renormalises: {0,1,2} -> [.526, .316, .158], cumulative .842 >= .82 at 2
    # tokens (on the un-renormalised distribution .8 < .82 would keep 3)
    row = _crafted()
    info = SamplingBatchInfo.from_params([SP(**kw)], 4, "cpu")
    kept = torch.isfinite(apply_cuts(row[None].clone(), info))[0].nonzero().flatten().tolist()
    assert set(kept) == allowed
    draws = _draw(row, 4000, **kw)
    assert set(draws.unique().tolist()) <= allowed
    expected = {t: PROBS[t] for t in allowed}
    if len(allowed) > 1:
        assert _chi2(draws, expected) < CHI2_CRIT[len(allowed) - 1]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scaling_distribution(temperature):
    row = _crafted()
    draws = _draw(row, 4000, temperature=temperature)
    scaled = {t: p ** (1.0 / temperature) for t, p in enumerate(PROBS)}
    assert _chi2(draws, scaled) < CHI2_CRIT[3]
    # and it is not the unscaled distribution (the check has power)
    assert _chi2(draws, dict(enumerate(PROBS))) > 100


# ---- penalties and min_tokens ------------------------------------------------------------

def test_presence_frequency_penalties_match_formula():
    torch.manual_seed(4)
    V = 10
    logits = torch.randn(3, V)
    params = [SP(presence_penalty=0.5, frequency_penalty=0.25),
              SP(presence_penalty=-1.0, frequency_penalty=1.5), SP()]
    outs = [[1, 1, 3], [2, 2, 2, 9], [4]]
    prompts = [[5, 6], [7], [8]]  # prompts do not count for presence/frequency
    info = SamplingBatchInfo.from_params(params, V, "cpu", output_ids=outs, prompt_ids=prompts)
    got = apply_logits_processors(logits, info)
    want = logits.clone()
    for i, p in enumerate(params):
        for t in set(outs[i]):
            c = outs[i].count(t)
            want[i, t] -= p.frequency_penalty * c + p.presence_penalty * (1 if c > 0 else 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[0, 1] == pytest.approx(float(logits[0, 1]) - 1.0)


def test_repetition_penalty_matches_hf():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(5)
    V = 50
    logits = torch.randn(3, V) * 4  # both signs
    pens = [1.3, 0.7, 1.0]
    prompts = [[1, 2, 3, 3], [10, 11], [4]]
    outs = [[40, 2], [12, 12, 49], [5]]
    info = SamplingBatchInfo.from_params([SP(repetition_penalty=p) for p in pens], V, "cpu",
                                         output_ids=outs, prompt_ids=prompts)
    got = apply_logits_processors(logits, info)
    for i, p in enumerate(pens):
        ids = torch.tensor([prompts[i] + outs[i]])
        ref = RepetitionPenaltyLogitsProcessor(penalty=p)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], ref)
    assert not torch.equal(got[0], logits[0])


def test_min_tokens_masks_eos_and_stop_ids():
    V, eos, stop = 20, 7, 3
    logits = torch.zeros(2, V)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    logits[:, 11] = 5.0
    sp = {"min_tokens": 2, "stop_token_ids": [stop]}
    params = [SP(temperature=0.0, **sp), SP(seed=0, temperature=0.3, **sp)]
    for n_out in (0, 1):
        out = _run(logits, params, output_ids=[[1] * n_out] * 2, eos_ids=[eos])
        assert out.tolist() == [11, 11]
    out = _run(logits, params, output_ids=[[1, 1]] * 2, eos_ids=[eos])
    assert out[0] == eos
    draws = _draw(logits[0], 500, min_tokens=3, stop_token_ids=[stop])  # default eos_ids=()
    assert (draws != stop).all() and (draws == eos).any()


def _mask(B: int, V: int, allowed: dict[int, list[int]]):
    """An xgrammar-style bitmask [B, ceil(V/32)] allowing ``allowed[row]`` on those rows."""
    words = torch.zeros(B, (V + 31) // 32, dtype=torch.int64)
    for r, ids in allowed.items():
        for t in ids:
            words[r, t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # int32 two's complement
    return words.to(torch.int32), sorted(allowed)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_never_empties_a_grammar_row(temperature):
    """Issue 34 kind 2: a grammar whose only continuation is EOS plus a min_tokens ban of
    EOS left a row all -inf, and the argmax drew token 0 (which the grammar then rejected:
    finish "abort"). The ban is lifted for that row only, so the grammar's EOS wins; the
    other rows keep the ban."""
    V, eos, stop = 40, 7, 3
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[:, eos] = -5.0
    params = [SP(temperature=temperature, seed=1, min_tokens=4, stop_token_ids=[stop])] * 3
    for step in range(3):
        info = SamplingBatchInfo.from_params(params, V, "cpu", steps=[step] * 3, eos_ids=[eos])
        # row 0: only EOS; row 1: EOS and the stop id (both banned); row 2: EOS or token 5
        info.vocab_mask = _mask(3, V, {0: [eos], 1: [eos, stop], 2: [eos, 5]})
        out = sample(logits, info, return_logprobs=0)
        ids = out.next_token_ids.tolist()
        assert ids[0] == eos and ids[1] in (eos, stop) and ids[2] == 5, ids
        assert torch.isfinite(out.logprobs).all()  # logprobs stay those of the raw logits


def test_min_tokens_ban_of_the_whole_vocab_is_lifted():
    """stop_token_ids + EOS covering the vocabulary under min_tokens: a defined draw from the
    unbanned row, never index 0 of an all -inf row (no grammar involved)."""
    V = 8
    logits = torch.zeros(2, V)
    logits[:, 6] = 3.0
    ids = list(range(1, V))
    params = [SP(temperature=0.0, min_tokens=2, stop_token_ids=ids),
              SP(temperature=1.0, seed=3, min_tokens=2, stop_token_ids=ids)]
    info = SamplingBatchInfo.from_params(params, V, "cpu", eos_ids=[0])
    x = apply_logits_processors(logits, info)
    assert torch.equal(x, logits)  # nothing left after the ban: every banned id back
    assert _run(logits, params, eos_ids=[0])[0] == 6
    # a row with one unbanned token keeps the ban
    params = [SP(temperature=0.0, min_tokens=2, stop_token_ids=ids[:-1])]
    assert _run(logits[:1], params, eos_ids=[0]).tolist() == [7]


def test_fuzz_no_draw_from_an_empty_row():
    """Random batches of grammar masks, min_tokens bans (EOS and stop ids), logit_bias and
    cuts: every draw is a token the grammar allows, outside the ban whenever the grammar
    leaves one, and never a token of an all -inf row."""
    rng = random.Random(34)
    V, eos = 64, 0
    for trial in range(60):
        B = rng.randint(1, 6)
        params, allowed = [], {}
        for r in range(B):
            stop_ids = rng.sample(range(1, V), rng.randint(0, 4))
            params.append(SP(
                temperature=rng.choice([0.0, 0.7, 1.5]), seed=rng.choice([None, trial]),
                top_k=rng.choice([-1, 1, 3]), top_p=rng.choice([1.0, 0.5]),
                min_tokens=rng.choice([0, 3]), stop_token_ids=stop_ids,
                logit_bias={rng.randrange(V): rng.choice([-100.0, 100.0])}))
            if rng.random() < 0.7:  # constrained: a few tokens, often only the banned ones
                pool = [eos, *stop_ids] if rng.random() < 0.5 else list(range(V))
                allowed[r] = rng.sample(pool, rng.randint(1, min(3, len(pool))))
        logits = torch.randn(B, V, generator=torch.Generator().manual_seed(trial))
        info = SamplingBatchInfo.from_params(params, V, "cpu", steps=[0] * B, eos_ids=[eos])
        if allowed:
            info.vocab_mask = _mask(B, V, allowed)
        ids = sample(logits, info).next_token_ids.tolist()
        for r, (p, t) in enumerate(zip(params, ids)):
            ok = allowed.get(r, range(V))
            assert t in ok, (trial, r, t, ok)
            banned = {eos, *p.stop_token_ids} if p.min_tokens else set()
            if set(ok) - banned:
                assert t not in banned, (trial, r, t, ok, banned)


# ---- logprobs and mixed batches ----------------------------------------------------------

def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(6)
    B, V, k = 4, 64, 5
    logits = torch.randn(B, V) * 2
    params = [SP(temperature=0.0, logit_bias={9: 100.0}), SP(seed=3, temperature=0.5),
              SP(presence_penalty=2.0), SP(top_k=3)]
    info = SamplingBatchInfo.from_params(params, V, "cpu", output_ids=[[], [], [1], []])
    before = logits.clone()
    out = sample(logits, info, return_logprobs=k)
    assert torch.equal(logits, before)  # the caller's logits are not modified
    assert out.top_logprobs.shape == (B, k) and out.top_logprobs_ids.shape == (B, k)
    assert out.logprobs.shape == (B,)
    assert (out.top_logprobs.exp().sum(-1) <= 1.0 + 1e-6).all()
    ld = logits.double()
    ref = ld - ld.max(-1, keepdim=True).values
    ref = ref - ref.exp().sum(-1, keepdim=True).log()  # log-softmax by hand
    for i in range(B):
        t = int(out.next_token_ids[i])
        assert float(out.logprobs[i]) == pytest.approx(float(ref[i, t]), abs=1e-5)
        order = sorted(range(V), key=lambda j: -float(ld[i, j]))[:k]
        assert out.top_logprobs_ids[i].tolist() == order
        assert out.top_logprobs[i].tolist() == pytest.approx(ref[i, order].tolist(), abs=1e-5)
    assert int(out.next_token_ids[0]) == 9 and float(out.logprobs[0]) < -1.0  # raw, not biased
    none = sample(logits, info)
    assert none.logprobs is None and none.top_logprobs is None


def test_mixed_greedy_and_sampled_batch():
    torch.manual_seed(7)
    V, n = 100, 64
    logits = torch.randn(2 * n, V)
    params = [SP(temperature=0.0) if i % 2 == 0 else SP(seed=i, temperature=1.5)
              for i in range(2 * n)]
    params[0] = SP(temperature=0.0, frequency_penalty=2.0)
    top0 = int(logits[0].argmax())
    outs = [[top0] if i == 0 else [] for i in range(2 * n)]
    out = _run(logits, params, output_ids=outs)
    greedy = out[0::2]
    assert torch.equal(greedy[1:], logits[2::2].argmax(-1))
    pen = logits[0].clone()
    pen[top0] -= 2.0
    assert int(greedy[0]) == int(pen.argmax())
    assert (out[1::2] != logits[1::2].argmax(-1)).any()  # sampled rows are not all argmax


def test_shape_mismatch_raises():
    info = SamplingBatchInfo.from_params([SP()], 10, "cpu")
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), info)
    with pytest.raises(ValueError):
        SamplingBatchInfo.from_params([SP()], 10, "cpu", output_ids=[[], []])


# ---- accelerator variants ----------------------------------------------------------------

_DEV = resolve_device("auto")
needs_accel = pytest.mark.skipif(_DEV == "cpu", reason="no CUDA/XPU device")


@pytest.mark.gpu
@needs_accel
def test_gpu_seeded_noise_and_tokens_match_cpu():
    ids = torch.arange(5000)
    keys = [seed_keys(s, st) for s, st in ((1, 0), (2**40 + 3, 9), (-5, 2))]
    k1 = torch.tensor([[k[0]] for k in keys])
    k2 = torch.tensor([[k[1]] for k in keys])
    cpu = seeded_gumbel(k1, k2, ids)
    dev = seeded_gumbel(k1.to(_DEV), k2.to(_DEV), ids.to(_DEV)).cpu()
    torch.testing.assert_close(dev, cpu, rtol=1e-5, atol=1e-5)
    torch.manual_seed(8)
    logits = torch.randn(32, 2000)
    params = [SP(seed=i, temperature=0.7, top_k=50) for i in range(32)]
    assert torch.equal(_run(logits, params, device=_DEV), _run(logits, params))


@pytest.mark.gpu
@needs_accel
def test_gpu_batch_invariance_bias_and_mixed():
    torch.manual_seed(9)
    V = 4096
    logits = torch.randn(6, V) * 2
    target = SP(seed=77, top_p=0.9, min_p=0.05)
    params = [SP(), target, SP(temperature=0.0), SP(seed=1), SP(temperature=0.0, top_k=1),
              SP(logit_bias={123: 100.0})]
    out = _run(logits, params, device=_DEV)
    alone = _run(logits[1:2], [target], device=_DEV)
    assert int(out[1]) == int(alone[0])
    assert int(out[2]) == int(logits[2].argmax()) and int(out[4]) == int(logits[4].argmax())
    assert int(out[5]) == 123
    row = _crafted()
    draws = _run(row.unsqueeze(0).repeat(4000, 1), [SP(seed=i, top_p=0.8) for i in range(4000)],
                 device=_DEV)
    assert set(draws.unique().tolist()) <= {0, 1}
    assert _chi2(draws, {0: 0.5, 1: 0.3}) < CHI2_CRIT[1]
    assert math.isfinite(float(draws.float().mean()))


def test_row_argmax_keeps_argmax_rules_on_ties_and_nan():
    """The CPU's ``torch.max`` route gives ``torch.argmax``'s answer: the first maximum on
    ties, a NaN's index where the row has one, 0 for an all -inf row."""
    from engine.sampling.sampler import row_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (200, 777), generator=g).float()   # many ties
    x[3, 7] = float("nan")
    x[5, :] = float("-inf")
    x[6, 10] = x[6, 20] = float("nan")
    got = row_argmax(x)
    want = [next(j for j, v in enumerate(row) if v != v) if any(v != v for v in row)
            else row.index(max(row)) for row in x.tolist()]
    assert got.dtype == torch.int64 and got.tolist() == want
    assert torch.equal(got, torch.argmax(x, dim=-1))
