"""Scheduler logic with a fake model whose next token is hand-computable.

The fake "model" predicts ``(last_token + 1) % V``, so every output is known in advance. It
also keeps a shadow KV cache: each step it writes the token id of every new position into its
slot, and before computing it checks that ``req_to_token`` maps every cached position of every
request to a slot holding that request's token. Page reuse, chunked prefill or preemption bugs
show up as a mismatch.
"""

import pytest
import torch

from engine.args import ServerArgs
from engine.forward_batch import ForwardMode, resolve_placeholders
from engine.kv.pool import KVPool, ReqToTokenPool
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req
from engine.scheduler.scheduler import Scheduler

V = 1000


class FakeResult:
    def __init__(self, ids):
        self.ids_dev = ids

    def host(self):
        return self.ids_dev.tolist(), None


class FakeRunner:
    """A ``StepRunner`` (engine/executor/step_runner.py) whose model is the successor table."""

    supports_overlap = False
    device_type = "cpu"
    vocab_size = V
    lora = None  # no adapters (a test may set its own)
    tp_size = 1
    max_verify_rows = None
    pooling = None  # a generation engine (no pool() steps)
    layer_specs = ()  # no per-layer kinds: one paged pool
    swa_pool = swa_req_pool = state_pool = state_snapshots = None

    def __init__(self, max_total_tokens, page_size=1, max_running=8, max_context=4096,
                 overlap=False):
        self.supports_overlap = overlap
        self.kv_pool = KVPool(max_total_tokens, page_size, 1, 1, 1, torch.float32, "cpu")
        self.max_context_len = min(max_context, self.kv_pool.capacity_tokens)
        self.req_to_token_pool = ReqToTokenPool(max_running, self.max_context_len, "cpu")
        self.slot_token = torch.full((self.kv_pool.num_slots,), -1, dtype=torch.int64)
        self.batches = []

    def commit_verify(self, keep):
        """No linear-attention layers: nothing to commit after a verify step."""

    def forward(self, batch, future_ids=None):
        r2t = self.req_to_token_pool.req_to_token
        off = 0
        rows = []
        assert len(set(batch.out_cache_loc)) == len(batch.out_cache_loc), "slot handed out twice"
        for req, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            fill = resolve_placeholders(torch.tensor(req.fill_ids), future_ids).tolist()
            assert min(fill) >= 0, "an unresolvable placeholder reached the model"
            cached = self.slot_token[r2t[req.req_pool_idx, :p].long()]
            assert cached.tolist() == fill[:p], f"{req.rid}: KV of the prefix is corrupt"
            for j in range(n):
                slot = batch.out_cache_loc[off + j]
                assert slot >= self.kv_pool.page_size, "a request wrote into the padding page"
                r2t[req.req_pool_idx, p + j] = slot
                self.slot_token[slot] = fill[p + j]
            off += n
            rows.append((fill[p + n - 1] + 1) % V)
        self.batches.append((batch.mode, batch.batch_size, batch.num_tokens))
        logits = torch.zeros(len(rows), V)
        logits[torch.arange(len(rows)), torch.tensor(rows)] = 1.0
        return logits

    def sample(self, logits, reqs, eos_ids):
        assert len(reqs) == logits.shape[0]
        return FakeResult(torch.argmax(logits, -1))

    def pool(self, batch, logits):
        raise AssertionError("a generation engine never pools")

    def memory_report(self):
        return {"weight_bytes": 0, "kv_bytes": self.kv_pool.num_slots * 4}


def assert_idle(sched) -> bool:
    """No request holds KV: every page is free or an unlocked page of the prefix cache."""
    sched.kv.check([])
    tree = sched.kv.tree
    assert tree.protected_pages == 0
    assert sched.kv_pool.used_tokens() == tree.cached_tokens() == tree.evictable_tokens()
    assert sched.kv.used_tokens() == 0
    return True


def expected(prompt, n):
    return [(prompt[-1] + 1 + i) % V for i in range(n)]


def run_all(sched, reqs, max_steps=10_000):
    sched.check_kv = True  # the page accounting after every step
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def make_reqs(lens, max_tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i, n in enumerate(lens):
        prompt = torch.randint(0, V, (n,), generator=g).tolist()
        reqs.append(Req(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)))
    return reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_continuous_batching_chunked_prefill(page_size):
    runner = FakeRunner(max_total_tokens=4096, page_size=page_size)
    args = ServerArgs(chunked_prefill_size=16, max_running_requests=8, page_size=page_size)
    sched = Scheduler(args, runner)
    reqs = make_reqs([3, 40, 17, 1, 64, 9], max_tokens=12)
    run_all(sched, reqs)
    for r in reqs:
        assert r.output_ids == expected(r.origin_input_ids, 12)
        assert r.finished_reason.type == "length"
    # no step computed more than the chunk budget of prompt tokens plus one per running decode
    assert all(t <= 16 + 8 for _, _, t in runner.batches)
    assert_idle(sched)
    assert runner.req_to_token_pool.available() == 8


@pytest.mark.parametrize("page_size", [1, 4])
def test_preemption_recomputes_and_keeps_outputs(page_size):
    # 96 tokens of KV for 6 requests that need ~40 each: they cannot all run at once
    runner = FakeRunner(max_total_tokens=96, page_size=page_size)
    args = ServerArgs(chunked_prefill_size=32, max_running_requests=8, page_size=page_size)
    sched = Scheduler(args, runner)
    reqs = make_reqs([20, 25, 10, 30, 15, 22], max_tokens=20, seed=1)
    run_all(sched, reqs)
    for r in reqs:
        assert r.output_ids == expected(r.origin_input_ids, 20)
    assert sched.stats["preemptions"] > 0
    assert_idle(sched)


def test_queue_time_runs_from_receipt_to_the_first_admission():
    """``Req.queue_time`` (``ferry:request_queue_time_seconds``): None while the request
    waits, then the seconds from the scheduler's receipt to its first admission, unchanged by
    a preemption (the readmission is not a new wait)."""
    runner = FakeRunner(max_total_tokens=1024)
    sched = Scheduler(ServerArgs(chunked_prefill_size=64, max_running_requests=1), runner)
    a, b = make_reqs([5, 5], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    sched.step()
    assert a.queue_time is not None and 0 <= a.queue_time < 60 and b.queue_time is None
    first = a.scheduled_time
    run_all(sched, [])
    assert a.scheduled_time == first and b.scheduled_time >= first
    assert b.queue_time >= b.scheduled_time - first  # it waited for a to finish
    # a small pool: these preempt each other (their admissions are still the first ones)
    runner = FakeRunner(max_total_tokens=96)
    sched = Scheduler(ServerArgs(chunked_prefill_size=32, max_running_requests=8), runner)
    reqs = make_reqs([20, 25, 10, 30, 15, 22], max_tokens=20, seed=1)
    for r in reqs:
        r.recv_time -= 1.0  # received 1 s ago
    stamps = {}
    for r in reqs:
        sched.add_request(r)
    while sched.has_work():
        sched.step()
        for r in reqs:
            if r.scheduled_time is not None:
                assert stamps.setdefault(r.rid, r.scheduled_time) == r.scheduled_time
    assert sched.stats["preemptions"] > 0
    assert all(r.queue_time >= 1.0 for r in reqs)


def test_abort_frees_kv_and_reports():
    runner = FakeRunner(max_total_tokens=1024)
    sched = Scheduler(ServerArgs(chunked_prefill_size=64), runner)
    a, b = make_reqs([10, 10], max_tokens=100)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        sched.step()
    assert runner.kv_pool.used_tokens() > 0
    sched.abort_request("r0")
    outs = sched.step()
    aborted = [o for o in outs if o.req is a]
    assert aborted and aborted[0].finished_reason.type == "abort"
    assert a.finished and not b.finished
    sched.abort_request("r1")
    sched.step()
    assert assert_idle(sched) and not sched.has_work()
    sched.abort_request("unknown")  # ignored
    assert not sched.has_work()


def test_stop_token_eos_and_min_tokens():
    runner = FakeRunner(max_total_tokens=1024)
    prompt = [5]
    # the fake model emits 6, 7, 8, ...: EOS 8 stops at the third token
    sched = Scheduler(ServerArgs(), runner, eos_ids=[8])
    r = Req("a", prompt, SamplingParams(max_tokens=50))
    run_all(sched, [r])
    assert r.output_ids == [6, 7, 8] and r.finished_reason.type == "stop"
    assert r.finished_reason.matched == 8
    # min_tokens 5 ignores the EOS at token 3; stop_token_ids 12 stops at the 7th
    r = Req("b", prompt, SamplingParams(max_tokens=50, min_tokens=5, stop_token_ids=[12]))
    run_all(sched, [r])
    assert r.output_ids == [6, 7, 8, 9, 10, 11, 12] and r.finished_reason.matched == 12
    # ignore_eos runs to max_tokens
    r = Req("c", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    run_all(sched, [r])
    assert r.output_ids == [6, 7, 8, 9, 10, 11] and r.finished_reason.type == "length"


def test_context_limit_ends_with_length():
    runner = FakeRunner(max_total_tokens=1024, max_context=16)
    sched = Scheduler(ServerArgs(), runner)
    r = Req("a", list(range(10)), SamplingParams(max_tokens=None), max_new_tokens=1 << 30)
    run_all(sched, [r])
    assert r.seq_len == 16 and r.finished_reason.type == "length"


def test_mixed_batches_are_extend_mode():
    runner = FakeRunner(max_total_tokens=1024)
    sched = Scheduler(ServerArgs(chunked_prefill_size=8), runner)
    a, = make_reqs([4], max_tokens=30)
    sched.add_request(a)
    sched.step()
    sched.step()
    b, = make_reqs([20], max_tokens=3, seed=3)
    b.rid = "late"
    sched.add_request(b)
    sched.step()  # b's first chunk of 8 plus a's decode, in one extend batch
    mode, bs, toks = runner.batches[-1]
    assert mode == ForwardMode.EXTEND and bs == 2 and toks == 9
    run_all(sched, [])
    assert a.output_ids == expected(a.origin_input_ids, 30)
    assert b.output_ids == expected(b.origin_input_ids, 3)


@pytest.mark.parametrize("page_size", [1, 4])
def test_overlap_schedule_gives_identical_outputs(page_size):
    """Overlap on (launch N+1 before reading N) vs off, under chunking and preemption."""
    results = {}
    for overlap in (False, True):
        runner = FakeRunner(max_total_tokens=120, page_size=page_size, overlap=overlap)
        sched = Scheduler(ServerArgs(chunked_prefill_size=24, page_size=page_size), runner)
        assert sched.overlap is overlap
        reqs = make_reqs([20, 25, 10, 30, 15, 22, 3], max_tokens=17, seed=5)
        reqs[2].sampling_params = SamplingParams(max_tokens=1)
        reqs[2].max_new_tokens = 1
        run_all(sched, reqs)
        results[overlap] = [r.output_ids for r in reqs]
        for r in reqs:
            assert r.output_ids == expected(r.origin_input_ids, r.max_new_tokens)
        assert_idle(sched)
        assert sched.inflight is None
    assert results[False] == results[True]


def test_overlap_abort_and_eos():
    runner = FakeRunner(max_total_tokens=1024, overlap=True)
    sched = Scheduler(ServerArgs(), runner, eos_ids=[9])
    a = Req("a", [5], SamplingParams(max_tokens=50))      # 6 7 8 9 -> EOS
    b = Req("b", [100], SamplingParams(max_tokens=50))
    sched.add_request(a)
    sched.add_request(b)
    outs = []
    for _ in range(6):
        outs += sched.step()
    sched.abort_request("b")
    while sched.has_work():
        outs += sched.step()
    assert a.output_ids == [6, 7, 8, 9] and a.finished_reason.matched == 9
    assert b.finished_reason.type == "abort" and all(t >= 0 for t in b.output_ids)
    assert b.output_ids == expected([100], len(b.output_ids))
    got_a = [t for o in outs if o.req is a for t in o.new_token_ids]
    assert got_a == [6, 7, 8, 9]
    assert_idle(sched)


def test_admission_headroom_avoids_preemption_thrash():
    """More demand than KV: requests that cannot all grow to max_tokens wait instead of being
    admitted and preempted again and again (each preemption recomputes the whole prefix)."""
    runner = FakeRunner(max_total_tokens=1024, max_running=16)
    sched = Scheduler(ServerArgs(chunked_prefill_size=256, max_running_requests=16), runner)
    reqs = make_reqs([20] * 12, max_tokens=200, seed=7)
    run_all(sched, reqs)
    for r in reqs:
        assert r.output_ids == expected(r.origin_input_ids, 200)
    # 12 x 220 tokens of demand on a 1024-token pool: at most a few requests ever need to be
    # recomputed (a policy that admits whatever fits right now preempts dozens of times)
    assert sched.stats["preemptions"] <= 6, sched.stats
    assert_idle(sched)


def test_stop_string_check_ignores_partial_characters():
    """The engine decodes a window of the output's tail to find stop strings; a window that
    cuts a multi-byte character must not look like it contains U+FFFD."""
    from engine.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    ids = tok.encode("Emoji 🎉🎉 party", add_special_tokens=False)
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    assert any(p.endswith("\ufffd") for p in pieces), "the emoji should span several tokens"
    sched = Scheduler(ServerArgs(), FakeRunner(max_total_tokens=256), tokenizer=tok)
    for stop, expect_at in (("\ufffd", None), ("🎉", pieces.index(next(
            p for p in pieces if "🎉" in p)))):
        r = Req("s", [1], SamplingParams(max_tokens=100, stop=[stop]))
        hit = None
        for i, t in enumerate(ids):
            r.output_ids.append(t)
            if sched.out.check_finished(r, t, i + 1) is not None:
                hit = i
                break
        assert hit == expect_at, (stop, hit, expect_at)


def test_engine_warm_up_leaves_the_scheduler_clean():
    from engine.scheduler.engine_loop import warm_up

    runner = FakeRunner(max_total_tokens=512)
    sched = Scheduler(ServerArgs(chunked_prefill_size=64), runner)
    warm_up(sched)
    assert not sched.has_work() and not sched.reqs
    assert assert_idle(sched) and runner.req_to_token_pool.available() == 8
    assert sched.stats["generation_tokens"] == 0
    assert sched.stats["prefix_cache_queries"] == 0
    assert runner.kv_pool.used_tokens() == 0  # the warm-up prompts left no cached prefix
    # it ran a mixed step: a prefill together with a decode
    assert any(mode == ForwardMode.EXTEND and bs == 2 for mode, bs, _ in runner.batches)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_request_that_fills_the_whole_pool_finishes(page_size):
    """A prompt one token short of the pool (the context limit), and a lone request that
    decodes until the pool is full, both finish: the scheduler reserves only the pages the
    running requests' next tokens really need (it used to keep a whole spare page, which
    left a lone request with nothing to do forever at page_size > 1)."""
    runner = FakeRunner(max_total_tokens=2048, page_size=page_size, max_context=2048)
    args = ServerArgs(chunked_prefill_size=64, max_running_requests=4, page_size=page_size)
    sched = Scheduler(args, runner)
    (full,) = make_reqs([2047], max_tokens=1, seed=3)
    run_all(sched, [full], max_steps=200)
    assert full.output_ids == expected(full.origin_input_ids, 1)
    # 1000 prompt tokens + 1040 generated: the last page fills up while it runs alone
    (long,) = make_reqs([1000], max_tokens=1040, seed=4)
    run_all(sched, [long], max_steps=3000)
    assert long.output_ids == expected(long.origin_input_ids, 1040)
    assert sched.stats["preemptions"] == 0   # alone, it never has to give up its KV
    assert_idle(sched)


def test_a_request_waiting_for_an_adapter_slot_is_not_starved():
    """One adapter slot: a request for adapter 2 that has waited past LORA_MAX_DEFER_S holds
    back a later request for the running adapter 1, so adapter 1 drains and 2 runs next
    (without the hold, a steady stream for adapter 1 keeps adapter 2 out)."""
    class Adapters:  # the scheduler's side of LoRAManager: who holds which adapter
        held: dict[int, int] = {}

        def acquire(self, i):
            self.held[i] = self.held.get(i, 0) + 1

        def release(self, i):
            self.held[i] -= 1

    runner = FakeRunner(max_total_tokens=4096)
    runner.lora = Adapters()
    sched = Scheduler(ServerArgs(chunked_prefill_size=256, max_running_requests=8,
                                 max_loras_per_batch=1), runner)
    sched.check_kv = True

    def req(rid, lora, n=4, tok=7):
        return Req(rid, [tok] * n, SamplingParams(max_tokens=5, temperature=0), lora_id=lora)

    first, starved = req("a1-first", 1), req("a2", 2)
    sched.add_request(first)
    sched.step()
    starved.recv_time -= 1.0  # it has waited a second already
    sched.add_request(starved)
    sched.add_request(later := req("a1-later", 1))
    order = []
    while sched.has_work():
        sched.step()
        for r in (starved, later):
            if r.scheduled_time is not None and r.rid not in order:
                order.append(r.rid)
    assert order == ["a2", "a1-later"]
    for r in (first, starved, later):
        assert r.output_ids == expected(r.origin_input_ids, 5)
    assert_idle(sched)
    # a fresh request for adapter 2 (not yet past the bound) does not hold adapter 1 back
    sched.add_request(a := req("a1-again", 1))
    sched.step()
    sched.add_request(fresh := req("a2-fresh", 2))
    sched.add_request(more := req("a1-more", 1))
    sched.step()
    assert more.scheduled_time is not None and fresh.scheduled_time is None
    run_all(sched, [])
    assert a.finished_reason is not None and fresh.output_ids == expected([7] * 4, 5)
    assert all(n == 0 for n in runner.lora.held.values())
    # two slots, one free: an old request for adapter 2 takes the free slot, and adapter 1's
    # new request still runs beside it (the hold is for full batches and new slots only)
    runner = FakeRunner(max_total_tokens=4096)
    runner.lora = Adapters()
    sched = Scheduler(ServerArgs(chunked_prefill_size=256, max_running_requests=8,
                                 max_loras_per_batch=2), runner)
    sched.add_request(one := req("a1-running", 1))
    sched.step()
    sched.add_request(mine := req("a1-new", 1, tok=9))  # other prompts: no prefix twins
    old = req("a2-old", 2, tok=8)
    old.recv_time -= 1.0  # as if it had queued behind other work for a second
    sched.add_request(old)
    sched.add_request(third := req("a3-new", 3, tok=10))
    sched.step()
    assert old.scheduled_time is not None and mine.scheduled_time is not None
    assert third.scheduled_time is None  # no third slot
    run_all(sched, [])
    assert one.finished_reason is not None and third.output_ids == expected([10] * 4, 5)


def step_runner_members() -> set[str]:
    """The attributes and methods ``StepRunner`` names (engine/executor/step_runner.py)."""
    from engine.executor.step_runner import StepRunner

    return set(StepRunner.__annotations__) | {
        n for n, v in vars(StepRunner).items() if callable(v) and not n.startswith("_")}


def test_the_fake_runner_has_what_step_runner_names():
    runner = FakeRunner(max_total_tokens=64)
    members = step_runner_members()
    assert {"forward", "sample", "memory_report", "max_verify_rows", "tp_size"} <= members
    assert [n for n in sorted(members) if not hasattr(runner, n)] == []


def test_lora_gate_caps_adapters_and_holds_back_behind_a_starved_one():
    """``LoRAGate`` on its own: the cap on distinct adapters per step, and the hold while an
    adapter has waited past LORA_MAX_DEFER_S (only for new slots or a full step)."""
    from types import SimpleNamespace as R

    from engine.lora.gate import LORA_MAX_DEFER_S, LoRAGate

    now = 100.0
    running = [R(lora_id=1, recv_time=now), R(lora_id=None, recv_time=now)]
    waiting = [R(lora_id=2, recv_time=now - 2 * LORA_MAX_DEFER_S), R(lora_id=3, recv_time=now)]
    gate = LoRAGate.for_step(2, running, waiting, served=True, now=now)
    assert gate.starved == {2} and gate.active == {1}
    assert gate.admits(None) and gate.admits(2)
    assert not gate.admits(3)  # a new slot, while adapter 2 starves
    assert gate.admits(1)      # adapter 1 is in the step and the step is not full
    gate.take(2)
    assert gate.starved == set() and gate.active == {1, 2}
    assert not gate.admits(3) and gate.admits(1)  # no third slot
    assert LoRAGate.for_step(2, running, waiting, served=False, now=now).starved == set()


def test_recurrent_state_models_reuse_no_prefix():
    """A model with linear-attention (RECURRENT_STATE) layers and no state-snapshot pool
    (``--max-state-snapshots 0``) runs with the prefix cache off: a shared prefix is
    recomputed, and the answers are unchanged."""
    from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RecurrentStateSpec

    linear = LayerSpec(attention=AttentionKind.LINEAR, cache=CacheKind.RECURRENT_STATE,
                       head_dim=8, v_head_dim=8, num_kv_heads=1,
                       state=RecurrentStateSpec(24, 4, 1, 8, 8))
    runner = FakeRunner(max_total_tokens=1024)
    runner.layer_specs = [linear, LayerSpec(head_dim=1, v_head_dim=1, num_kv_heads=1)]
    sched = Scheduler(ServerArgs(chunked_prefill_size=64), runner)
    assert sched.recurrent_state and not sched.kv.enabled
    first = make_reqs([20], max_tokens=4)[0]
    run_all(sched, [first])
    again = make_reqs([20], max_tokens=4)[0]
    run_all(sched, [again])
    assert again.output_ids == first.output_ids == expected(first.origin_input_ids, 4)
    # the second request's whole prompt was computed: no cached prefix
    assert [t for m, _, t in runner.batches if m == ForwardMode.EXTEND] == [20, 20]
    plain = Scheduler(ServerArgs(), FakeRunner(max_total_tokens=1024))
    assert not plain.recurrent_state and plain.kv.enabled
