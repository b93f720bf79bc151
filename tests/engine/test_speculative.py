"""Speculative decoding (issue 26): the NGRAM proposer, draft acceptance (greedy and
rejection sampling, checked statistically), the verify step inside the scheduler with the
KV accounting after every step, and greedy outputs of the real model identical with and
without speculation."""

import random

import pytest
import torch

from engine.args import ServerArgs
from engine.forward_batch import ForwardMode, resolve_placeholders
from engine.kv.pool import KVPool, ReqToTokenPool
from engine.sampling import acceptance
from engine.sampling.acceptance import verify_drafts
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import SamplingBatchInfo
from engine.scheduler.request import Req
from engine.scheduler.scheduler import Scheduler
from engine.speculative import NgramProposer
from engine.speculative.worker import VerifyReq

# ---- the proposer -------------------------------------------------------------------------


def test_ngram_copies_what_followed_the_latest_longest_match():
    p = NgramProposer(1, 12)
    assert p.propose([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 4) == [4, 5, 9, 9]
    # two matches of the suffix [2, 3]: the most recent one's continuation
    assert p.propose([2, 3, 7, 2, 3, 8, 2, 3], 1) == [8]
    # the longest window wins over a more recent shorter match
    assert p.propose([1, 2, 3, 5, 9, 3, 6, 1, 2, 3], 1) == [5]
    # a period shorter than k: the copy runs on into its own output
    assert p.propose([7, 8, 7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert p.propose([4, 4], 3) == [4, 4, 4]
    assert p.propose([1, 2, 3], 3) == [] and p.propose([5], 2) == []
    assert p.propose([1, 2, 1], 0) == []


def test_ngram_window_bounds():
    toks = [5, 6, 1, 9, 6, 1]  # the suffix [6, 1] occurred at 1..2; [9, 6, 1] never did
    assert NgramProposer(2, 3).propose(toks, 2) == [9, 6]
    assert NgramProposer(3, 4).propose(toks, 2) == []
    assert NgramProposer(1, 1).match(toks) == (3, 1)
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# ---- acceptance ---------------------------------------------------------------------------

V = 8


def _info(params, steps=None):
    return SamplingBatchInfo.from_params(params, V, "cpu", steps=steps)


def test_greedy_acceptance_is_the_argmax_match():
    logits = torch.randn(4, V)
    top = logits.argmax(-1)
    drafts = torch.tensor([int(top[0]), (int(top[1]) + 1) % V, int(top[2]), -1])
    acc, emit = verify_drafts(logits, _info([SamplingParams(temperature=0)] * 4), drafts)
    assert acc.tolist() == [True, False, True, False]
    assert emit.tolist() == top.tolist()


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    exp = p * counts.sum()
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


#: chi-square critical value for 7 degrees of freedom at p = 0.001
CHI2_7_999 = 24.32


def _emitted(params, logits, draft, q=None, n=40000, seed=0):
    """The token emitted at one position over n independent runs (rows): the draft when
    accepted, else the residual draw. With a draft distribution q the drafts are drawn
    from it (the theorem's premise); without, every row drafts ``draft`` (a point mass)."""
    torch.manual_seed(seed)
    info = _info([params] * n)
    if q is None:
        drafts = torch.full((n,), draft, dtype=torch.int64)
    else:
        drafts = torch.multinomial(q[0], n, replacement=True)
    qs = None if q is None else q.expand(n, V)
    acc, emit = verify_drafts(logits.expand(n, V), info, drafts, qs)
    return torch.where(acc, drafts, emit), acc


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.3, top_k=5),
                                    SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05)])
@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_emits_the_target_distribution(params, with_q):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, V, generator=g) * 1.5
    info1 = _info([params])
    target = torch.softmax(acceptance.apply_cuts(
        acceptance.target_logits(logits, info1) / info1.temperatures, info1), -1)[0]
    draft = int(target.argmax())  # a likely draft: accepted often, rejected often enough
    q = torch.softmax(torch.randn(1, V, generator=g), -1) if with_q else None
    if q is not None:
        q[0, draft] = q[0].max() * 2  # overconfident on the draft: p(d) < q(d)
        q = q / q.sum()
    toks, acc = _emitted(params, logits, draft, q)
    counts = torch.bincount(toks, minlength=V).float()
    assert _chi_square(counts, target) < CHI2_7_999
    # the acceptance rate: p(d) for a point mass, sum_x min(p(x), q(x)) for d ~ q
    rate = float(target[draft]) if q is None else float(torch.minimum(target, q[0]).sum())
    assert abs(acc.float().mean() - rate) < 0.01

    if q is None:
        return  # point-mass drafts: the residual is implicit (the decode step's draw)
    # without the correction (a rejected position drawn from p itself) the test fails
    orig = acceptance.residual_logits
    try:
        acceptance.residual_logits = lambda p, d, q: torch.log(p)
        bad, _ = _emitted(params, logits, draft, q)
    finally:
        acceptance.residual_logits = orig
    assert _chi_square(torch.bincount(bad, minlength=V).float(), target) > 10 * CHI2_7_999


def test_seeded_acceptance_is_reproducible_and_batch_independent():
    logits = torch.randn(3, V)
    sp = SamplingParams(temperature=1.0, seed=42)
    drafts = torch.tensor([1, 2, -1])
    a = verify_drafts(logits, _info([sp] * 3, steps=[5, 6, 7]), drafts)
    torch.manual_seed(123)  # the global generator plays no part in seeded rows
    b = verify_drafts(logits, _info([sp] * 3, steps=[5, 6, 7]), drafts)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    other = SamplingParams(temperature=1.0)
    c = verify_drafts(torch.cat([torch.randn(1, V), logits]),
                      _info([other, sp, sp, sp], steps=[0, 5, 6, 7]),
                      torch.tensor([3, 1, 2, -1]))
    assert torch.equal(c[0][1:], a[0]) and torch.equal(c[1][1:], a[1])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, seed=5),
                                    SamplingParams(temperature=1.2, top_p=0.9, seed=6),
                                    SamplingParams(temperature=0.7, top_k=4)])
def test_point_mass_verify_emits_the_decode_steps_token(params):
    """Issue 41 item 3: at every position a verify row's token (the draft when accepted,
    else the emitted one) is the token ``sample`` draws for that position in a decode step,
    whatever the draft; so a seeded request's output does not depend on whether (or with
    which drafts) a step speculated."""
    from engine.sampling.sampler import sample

    n = 400
    logits = torch.randn(n, V) * 2
    steps = list(range(n))
    for draft_of in (lambda t: t, lambda t: (t + 1) % V, lambda t: 3):
        torch.manual_seed(0)  # the unseeded row draws the same global noise both times
        want = sample(logits, _info([params] * n, steps=steps)).next_token_ids
        drafts = torch.tensor([draft_of(int(t)) for t in want])
        torch.manual_seed(0)
        acc, emit = verify_drafts(logits, _info([params] * n, steps=steps), drafts)
        assert torch.equal(torch.where(acc, drafts, emit), want)
        assert torch.equal(acc, drafts == want)


def test_acceptance_applies_min_tokens_penalties_and_bias():
    """The target at each row is the sampler's: min_tokens bans EOS at its own step, and
    logit_bias moves the argmax (greedy rows)."""
    logits = torch.zeros(3, V)
    logits[:, 0] = 5.0  # token 0 (the EOS here) is the raw argmax
    sp = SamplingParams(temperature=0, min_tokens=2, logit_bias={3: 4.0})
    info = SamplingBatchInfo.from_params([sp] * 3, V, "cpu", steps=[0, 1, 2], eos_ids=[0])
    acc, emit = verify_drafts(logits, info, torch.tensor([3, 3, -1]))
    assert emit.tolist() == [3, 3, 0] and acc.tolist() == [True, True, False]


# ---- the verify step in the scheduler (a fake model) --------------------------------------

FV = 40


def fake_next(tok: int, pos: int) -> int:
    """The fake model: a fixed successor table (cycles, so outputs repeat and NGRAM drafts
    get accepted), broken at pseudo-random positions (so some drafts get rejected)."""
    if (pos * 2654435761) % 7 == 0:
        return (tok * 3 + pos) % FV
    return (tok * 7 + 3) % FV


class FakeRunner:
    """Logits for every row of an ``all_rows`` request; a shadow KV that must hold each
    request's tokens at the slots ``req_to_token`` names (checked every forward)."""

    supports_overlap = False
    vocab_size = FV
    device_type = "cpu"
    lora = None
    tp_size = 1
    max_verify_rows = None  # no small-M cliff (a test may set the CPU's)
    pooling = None
    layer_specs = ()  # no per-layer kinds: one paged pool
    swa_pool = swa_req_pool = state_pool = state_snapshots = None

    def __init__(self, max_total_tokens, page_size=1, max_running=8, overlap=False,
                 verify_as_decode=False):
        self.supports_overlap = overlap
        # the worker verifies as decode rows when the extra KV they read is small against
        # the weights: huge weights -> always, none -> always an all-rows EXTEND
        self.weight_bytes = 1 << 50 if verify_as_decode else 0
        self.kv_pool = KVPool(max_total_tokens, page_size, 1, 1, 1, torch.float32, "cpu")
        self.max_context_len = min(4096, self.kv_pool.capacity_tokens)
        self.req_to_token_pool = ReqToTokenPool(max_running, self.max_context_len, "cpu")
        self.slot_token = torch.full((self.kv_pool.num_slots,), -1, dtype=torch.int64)
        self.verify_tokens = 0
        self.verify_modes = set()  # the ForwardModes verify steps ran as

    def forward(self, batch, future_ids=None):
        r2t = self.req_to_token_pool.req_to_token
        off, rows = 0, []
        assert len(set(batch.out_cache_loc)) == len(batch.out_cache_loc)
        for i, (req, p, n) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
            fill = resolve_placeholders(torch.tensor(req.tokens(0, p + n)), future_ids).tolist()
            assert min(fill) >= 0
            cached = self.slot_token[r2t[req.req_pool_idx, :p].long()]
            assert cached.tolist() == fill[:p], "KV of the prefix is corrupt"
            for j in range(n):
                slot = batch.out_cache_loc[off + j]
                assert slot >= self.kv_pool.page_size
                r2t[req.req_pool_idx, p + j] = slot
                self.slot_token[slot] = fill[p + j]
            off += n
            every = batch.all_rows and batch.all_rows[i]
            if every or isinstance(req, VerifyReq):
                self.verify_tokens += n
                self.verify_modes.add(batch.mode)
            for j in (range(n) if every else [n - 1]):
                rows.append(fake_next(fill[p + j], p + j))
        logits = torch.zeros(len(rows), FV)
        logits[torch.arange(len(rows)), torch.tensor(rows)] = 1.0
        return logits

    def memory_report(self):
        return {"weight_bytes": self.weight_bytes, "kv_bytes": self.kv_pool.num_slots * 8}

    def sample(self, logits, reqs, eos_ids):
        from engine.sampling.sampler import sample

        out = sample(logits, SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs], FV, "cpu"))

        class R:
            ids_dev = out.next_token_ids

            def host(self):
                return out.next_token_ids.tolist(), None
        return R()


def fake_expected(prompt, n, stop_ids=()):
    toks = list(prompt)
    out = []
    for _ in range(n):
        t = fake_next(toks[-1], len(toks) - 1)
        toks.append(t)
        out.append(t)
        if t in stop_ids:
            break
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("as_decode", [False, True])
def test_verify_steps_keep_outputs_and_kv_accounting(page_size, as_decode):
    """Random prompts, lengths and aborts; the page accounting after every step; outputs
    equal to the model's own greedy continuation; verify steps as all-rows EXTENDs and as
    DECODEs of k + 1 rows per request (each row checks the KV of every earlier position)."""
    rnd = random.Random(page_size)
    runner = FakeRunner(max_total_tokens=600, page_size=page_size, verify_as_decode=as_decode)
    args = ServerArgs(chunked_prefill_size=32, page_size=page_size,
                      speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    sched = Scheduler(args, runner, eos_ids=[])
    sched.check_kv = True
    reqs = []
    for i in range(14):
        prompt = [rnd.randrange(FV) for _ in range(rnd.randrange(2, 40))]
        stop = [rnd.randrange(FV)] if i % 3 == 0 else []
        sp = SamplingParams(max_tokens=rnd.randrange(1, 60), temperature=0, stop_token_ids=stop)
        reqs.append(Req(f"r{i}", prompt, sp))
    pending = list(reqs)
    aborted = set()
    steps = 0
    while pending or sched.has_work():
        if pending and rnd.random() < 0.3:
            sched.add_request(pending.pop(0))
        if steps % 9 == 4 and sched.running:
            victim = rnd.choice(sched.running)
            sched.abort_request(victim.rid)
            aborted.add(victim.rid)
        sched.step()
        steps += 1
        assert steps < 5000
    for r in reqs:
        exp = fake_expected(r.origin_input_ids, r.max_new_tokens, r.sampling_params.stop_token_ids)
        if r.rid in aborted and r.finished_reason.type == "abort":
            assert r.output_ids == exp[:len(r.output_ids)]
        else:
            assert r.output_ids == exp, r.rid
            assert len(r.output_ids) <= r.max_new_tokens
    sched.kv.check([])
    assert sched.kv.used_tokens() == 0
    assert runner.verify_modes == {ForwardMode.DECODE if as_decode else ForwardMode.EXTEND}
    st = sched.stats
    assert st["spec_verify_steps"] > 0
    assert 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]  # both outcomes seen
    assert st["spec_emitted_tokens"] == st["spec_accepted_tokens"] + st["spec_verify_reqs"]
    assert sum(st["spec_accept_lengths"]) == st["spec_verify_reqs"]


def test_radix_cache_holds_only_accepted_tokens():
    runner = FakeRunner(max_total_tokens=400)
    sched = Scheduler(ServerArgs(speculative_algorithm="NGRAM"), runner)
    sched.check_kv = True
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    r = Req("a", prompt, SamplingParams(max_tokens=30, temperature=0))
    sched.add_request(r)
    while sched.has_work():
        sched.step()
    assert sched.stats["spec_verify_steps"] > 0
    tree = sched.kv.tree
    full = prompt + r.output_ids
    pages, _ = tree.match_prefix(full)
    assert tree.cached_tokens() == len(pages) <= len(full)
    # every cached slot holds the token the tree keys it by
    assert runner.slot_token[torch.tensor(pages)].tolist() == full[:len(pages)]


def test_large_batches_decode_normally():
    runner = FakeRunner(max_total_tokens=800)
    sched = Scheduler(ServerArgs(speculative_algorithm="NGRAM",
                                 speculative_max_batch_size=2), runner)
    reqs = [Req(f"r{i}", [i, 5, i, 5, i, 5], SamplingParams(max_tokens=8, temperature=0))
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    sched.step()  # the prefill
    while sched.has_work():
        sched.step()
        assert len(sched.running) <= 2 or runner.verify_tokens == 0
    for r in reqs:
        assert r.output_ids == fake_expected(r.origin_input_ids, 8)


class SampledFakeRunner(FakeRunner):
    """``FakeRunner`` with a peaked distribution (the successor at logit 6 over 40 tokens:
    p about 0.91 at temperature 1, so NGRAM drafts are taken and rejected) and a decode
    step that keys seeded noise by the step, as the real runner does."""

    def forward(self, batch, future_ids=None):
        return super().forward(batch, future_ids) * 6.0

    def sample(self, logits, reqs, eos_ids):
        from engine.sampling.sampler import sample

        out = sample(logits, SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs], FV, "cpu",
            steps=[len(r.output_ids) for r in reqs]))

        class R:
            ids_dev = out.next_token_ids

            def host(self):
                return out.next_token_ids.tolist(), None
        return R()


def _seeded_outputs(spec_args: dict, n_others: int) -> tuple[list[int], dict]:
    runner = SampledFakeRunner(max_total_tokens=4000, max_running=32)
    sched = Scheduler(ServerArgs(chunked_prefill_size=256, **spec_args), runner, eos_ids=[])
    mine = Req("mine", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(
        max_tokens=40, temperature=1.0, seed=1234, ignore_eos=True))
    sched.add_request(mine)
    for i in range(n_others):
        sched.add_request(Req(f"o{i}", [i % FV, 5, i % FV, 5], SamplingParams(
            max_tokens=4 + 2 * i, temperature=1.0, seed=i, ignore_eos=True)))
    while sched.has_work():
        sched.step()
    return mine.output_ids, dict(sched.stats)


def test_seeded_output_is_independent_of_speculation_and_load():
    """Issue 41 item 3: a seeded sampled request's tokens alone with NGRAM, beside a dozen
    others (past --speculative-max-batch-size, so those steps decode), and without
    speculation, are the same."""
    ngram = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4,
             "speculative_max_batch_size": 8}
    alone, st = _seeded_outputs(ngram, 0)
    assert st["spec_verify_steps"] > 0 and 0 < st["spec_accepted_tokens"] \
        < st["spec_proposed_tokens"]
    busy, st_busy = _seeded_outputs(ngram, 12)
    assert st_busy["spec_verify_steps"] > 0  # speculates again once the others thin out
    plain, _ = _seeded_outputs({}, 0)
    assert alone == busy == plain
    assert len(set(alone)) > 3  # sampled, not the fake model's greedy cycle


# ---- the real model (SmolLM2-135M, fp32, CPU) ---------------------------------------------

PARAGRAPH = ("The river rises in the hills north of the town, runs south through the old "
             "mill and the market square, and joins the sea at the harbour.")
COPY_PROMPTS = [
    f"Repeat this paragraph word for word.\n\n{PARAGRAPH}\n\nRepeated:\n",
    "Rename the variable total to acc:\n\ndef add_all(xs):\n    total = 0\n    for x in xs:\n"
    "        total += x\n    return total\n\nRenamed:\n",
    "Echo the list: apples, pears, plums, cherries, grapes, lemons, limes.\nEcho:",
]
OTHER_PROMPTS = ["The capital of France is", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def llms():
    from engine import LLM

    kw = dict(model_path=None, device="cpu", max_total_tokens=8192)
    # 2 drafts: a batch of the 5 prompts below is 15 verify rows, within the CPU's 16
    # (CPU_KERNEL_MAX_M), so it speculates as a batch
    spec = LLM(speculative_algorithm="NGRAM", speculative_num_draft_tokens=2, **kw)
    spec.scheduler.check_kv = True
    return LLM(**kw), spec


@pytest.mark.slow
def test_real_model_greedy_identical_with_ngram(llms):
    from engine import SamplingParams

    base, spec = llms
    prompts = COPY_PROMPTS + OTHER_PROMPTS
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = base.generate(prompts, sp)
    st = spec.scheduler.stats
    before = st["spec_accepted_tokens"]
    got = spec.generate(prompts, sp)
    for p, w, g in zip(prompts, want, got):
        assert g.token_ids == w.token_ids, p
        assert g.text == w.text and g.finish_reason == w.finish_reason
    assert st["spec_accepted_tokens"] - before > 20  # the copy prompts' drafts were taken
    # alone (batch 1), each prompt too
    for p, w in zip(prompts[:2], want[:2]):
        assert spec.generate(p, sp)[0].token_ids == w.token_ids


@pytest.mark.slow
def test_real_model_stops_max_tokens_n_and_logprobs(llms):
    from engine import SamplingParams

    base, spec = llms
    prompt = COPY_PROMPTS[0]
    ref = base.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = ref.text[len(ref.text) // 2:][:6].strip() or ref.text[-4:]
    for sp in [SamplingParams(max_tokens=40, temperature=0, stop=[stop]),
               *(SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                 for m in (1, 3, 9)),
               SamplingParams(max_tokens=24, temperature=0, logprobs=3)]:
        w = base.generate([prompt, prompt], sp)  # n = 2: the same prompt twice
        g = spec.generate([prompt, prompt], sp)
        for a, b in zip(w, g):
            assert b.token_ids == a.token_ids and b.text == a.text
            assert (b.finish_reason, b.matched_stop) == (a.finish_reason, a.matched_stop)
            assert len(b.token_ids) <= sp.max_tokens
            if sp.logprobs:
                assert len(b.logprobs) == len(b.token_ids)
                for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs):
                    assert lp_b == pytest.approx(lp_a, abs=1e-3)
                    assert [t[0] for t in top_b] == [t[0] for t in top_a]
    assert g[0].finish_reason == "length" and w[0].finish_reason == "length"


@pytest.mark.slow
def test_real_model_radix_hit_and_sampling(llms):
    from engine import SamplingParams

    base, spec = llms
    prompt = COPY_PROMPTS[1]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    first = spec.generate(prompt, sp)[0]
    again = spec.generate(prompt, sp)[0]
    assert again.num_cached_tokens and again.num_cached_tokens >= len(first.prompt_token_ids) - 1
    assert again.token_ids == first.token_ids == base.generate(prompt, sp)[0].token_ids
    # sampled, seeded: reproducible, and within max_tokens
    ssp = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=7, ignore_eos=True)
    a, b = spec.generate([prompt, prompt], ssp)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 32
    spec.scheduler.kv.check([])


def test_metrics_export_the_engine_spec_counters():
    from server.metrics import Metrics

    m = Metrics("m", include_process_metrics=False)
    assert b"spec_decode" not in m.render()[0]  # speculation off: no series

    class Info:  # a ServerInfoOut
        num_running, num_waiting, kv_used_tokens, kv_total_tokens = 0, 0, 0, 1
        stats = {"spec_verify_steps": 3, "spec_verify_reqs": 4, "spec_proposed_tokens": 16,
                 "spec_accepted_tokens": 5, "spec_emitted_tokens": 9,
                 "spec_accept_lengths": [1, 2, 1, 0, 0]}

    m.on_engine_stats(Info())
    text = m.render()[0].decode()
    for line in ['ferry:spec_decode_num_draft_tokens_total{model_name="m"} 16.0',
                 'ferry:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0',
                 'ferry:spec_decode_num_emitted_tokens_total{model_name="m"} 9.0',
                 'ferry:spec_decode_accept_length_bucket{le="2.0",model_name="m"} 3.0',
                 'ferry:spec_decode_accept_length_count{model_name="m"} 4.0',
                 'ferry:spec_decode_accept_length_sum{model_name="m"} 8.0']:
        assert line in text
    assert "step_cost_ratio" not in text  # step costs: once measured
    Info.stats = {**Info.stats, "spec_verify_step_seconds": 0.03,
                  "spec_decode_step_seconds": 0.02}
    m.on_engine_stats(Info())
    text = m.render()[0].decode()
    for line in ['ferry:spec_decode_verify_step_seconds{model_name="m"} 0.03',
                 'ferry:spec_decode_decode_step_seconds{model_name="m"} 0.02',
                 'ferry:spec_decode_step_cost_ratio{model_name="m"} 1.5']:
        assert line in text


def test_breakeven_comes_from_measured_step_times():
    """``wants`` times each scheduler step (verify or decode, as ``build`` labelled it) with
    the worker's clock; a step interval that spans more than one scheduler step (a prefill
    in between) is not counted; the break-even is verify time / decode time."""
    runner = FakeRunner(max_total_tokens=200)
    sched = Scheduler(ServerArgs(speculative_algorithm="NGRAM"), runner)
    w = sched.spec
    now = [0.0]
    w.clock = lambda: now[0]

    def step(kind, dt, steps=1):
        assert w.wants([object()])
        w._label(kind)
        sched.stats["steps"] += steps
        now[0] += dt

    assert w.breakeven == 1.0
    step("verify", 0.030)
    step("decode", 0.010)
    step("decode", 0.500, steps=2)  # a prefill ran in between: not a decode step's time
    w.wants([object()])
    assert w.step_time["verify"] == pytest.approx(0.030)
    assert w.step_time["decode"] == pytest.approx(0.010)
    assert w.breakeven == pytest.approx(3.0)
    assert w.info()["breakeven_accept_length"] == pytest.approx(3.0)


@pytest.mark.parametrize("verify_cost,backs_off", [(3.0, True), (1.2, False)])
def test_a_request_below_breakeven_backs_off(verify_cost, backs_off):
    """One accepted draft of four per step (accept length 2): worth it when a verify step
    costs 1.2 decode steps, a loss at 3 (the CPU's order with many drafts)."""
    from engine.speculative.worker import MISSES_BEFORE_BACKOFF

    runner = FakeRunner(max_total_tokens=200)
    w = Scheduler(ServerArgs(speculative_algorithm="NGRAM"), runner).spec
    w.step_time.update(verify=verify_cost * 0.01, decode=0.01)
    r = Req("a", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0))
    for _ in range(MISSES_BEFORE_BACKOFF):
        w._track("a", 1)
    assert (w.budget(r) == 0) == backs_off


def test_cpu_speculates_only_while_verify_rows_fit_the_small_m_kernels():
    """On the CPU a verify step of bs x (1 + k) rows speculates only up to the rows the
    packed-weight kernels take (CPU_KERNEL_MAX_M = 16): k = 4 -> at most 3 requests. The
    runner answers the cap (``max_verify_rows``): the CPU's kernel limit, none on a GPU."""
    from types import SimpleNamespace

    from engine.executor.rank_runner import RankRunner
    from engine.layers.quantization.wq import CPU_KERNEL_MAX_M

    def rows_of(device_type):
        return RankRunner.max_verify_rows.fget(SimpleNamespace(device_type=device_type))

    assert rows_of("cpu") == CPU_KERNEL_MAX_M and rows_of("cuda") is None
    runner = FakeRunner(max_total_tokens=200)
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    assert Scheduler(args, runner).spec.wants([object()] * 8)  # no small-M cliff: no cap
    runner.max_verify_rows = rows_of("cpu")
    w = Scheduler(args, runner).spec
    fits = CPU_KERNEL_MAX_M // 5
    assert [w.wants([object()] * n) for n in range(1, 9)] == [n <= fits for n in range(1, 9)]


def test_a_request_whose_drafts_keep_failing_backs_off():
    from engine.speculative.worker import MISSES_BEFORE_BACKOFF

    runner = FakeRunner(max_total_tokens=200)
    sched = Scheduler(ServerArgs(speculative_algorithm="NGRAM"), runner)
    w = sched.spec
    r = Req("a", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0))
    assert w.budget(r) == 4
    for _ in range(MISSES_BEFORE_BACKOFF):
        w._track("a", 0)
    skipped = 0
    while w.budget(r) == 0:
        skipped += 1
    assert skipped == 2
    w._track("a", 0)
    assert [w.budget(r) for _ in range(5)] == [0, 0, 0, 0, 4]
    w._track("a", 2)  # an accepted draft resets it
    assert w.budget(r) == 4
