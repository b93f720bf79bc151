"""``--dp-size`` dispatch (server/replicas.py) against hand-computed cases."""

from __future__ import annotations

import pytest

from engine.args import ServerArgs
from server.replicas import Dispatcher, prefix_keys


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_prefix_keys_are_per_whole_block_and_chain():
    assert prefix_keys(ids(15), 16) == []
    a, b = prefix_keys(ids(40), 16), prefix_keys(ids(32), 16)
    assert len(a) == 2 and a == b  # the 8-token tail is not a block
    # the second block's key depends on the first: same tokens after another prefix differ
    c = prefix_keys([99] + ids(31, 1), 16)
    assert c[0] != a[0] and c[1] != a[1]


def test_round_robin_skips_dead():
    d = Dispatcher(3, "round_robin")
    assert [d.choose([1], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [d.choose([1], [0, None, 0]) for _ in range(3)] == [2, 0, 2]


def test_shortest_queue_ties_go_low():
    d = Dispatcher(3, "shortest_queue")
    assert d.choose([1], [2, 1, 1]) == 1
    assert d.choose([1], [None, 5, 4]) == 2
    with pytest.raises(LookupError):
        d.choose([1], [None, None, None])


def test_prefix_affinity_follows_the_longest_prefix():
    d = Dispatcher(2, "prefix_affinity", abs_threshold=2, rel_threshold=1.5, block=4)
    sys_a, sys_b = ids(12, 100), ids(12, 200)
    assert d.choose(sys_a + [1, 2], [0, 0]) == 0       # nothing known: least loaded, low
    assert d.choose(sys_b + [3], [1, 0]) == 1          # nothing known: least loaded
    assert d.choose(sys_a + [5, 6, 7, 8], [0, 3]) == 0  # 3 blocks on 0
    assert d.choose(sys_b + [9], [0, 1]) == 1          # busier by 1 <= 2: affinity wins
    # 1 holds 3 blocks, 0 holds sys_a's 3 + [5,6,7,8] = 4 blocks: longest wins
    assert d.choose(sys_a + [5, 6, 7, 8, 0], [2, 0]) == 0
    # shorter than a block: no affinity
    assert d.choose([1, 2, 3], [1, 0]) == 1


def test_prefix_affinity_yields_to_imbalance():
    d = Dispatcher(2, "prefix_affinity", abs_threshold=2, rel_threshold=1.5, block=4)
    p = ids(8, 50)
    assert d.choose(p, [0, 0]) == 0
    assert d.choose(p, [3, 1]) == 0   # 3 - 1 = 2, not > 2
    assert d.choose(p, [4, 1]) == 1   # 4 - 1 > 2 and 4 > 1.5: the least loaded
    # both now know p; 1 is less loaded, ties on match go to the least loaded
    assert d.choose(p, [2, 1]) == 1
    assert d.choose(p, [10, 8]) == 1
    # rel threshold: 12 - 8 > 2 but 12 <= 8 * 1.5 -> affinity holds (both match; 1 less busy)
    d2 = Dispatcher(2, "prefix_affinity", abs_threshold=2, rel_threshold=1.5, block=4)
    d2.record(0, prefix_keys(p, 4))
    assert d2.choose(p, [12, 8]) == 0
    assert d2.choose(p, [13, 8]) == 1


def test_dead_replica_is_skipped_and_forgotten():
    d = Dispatcher(2, "prefix_affinity", block=4)
    p = ids(8)
    d.record(1, prefix_keys(p, 4))
    assert d.choose(p, [0, None]) == 0
    d.forget(1)
    assert d.matched(1, prefix_keys(p, 4)) == 0


def test_lru_bound():
    d = Dispatcher(1, "prefix_affinity", max_blocks=3, block=2)
    d.record(0, prefix_keys(ids(4, 0), 2))      # 2 keys
    d.record(0, prefix_keys(ids(4, 10), 2))     # 2 more: the oldest goes
    assert len(d.index[0]) == 3
    assert d.matched(0, prefix_keys(ids(4, 0), 2)) == 0
    assert d.matched(0, prefix_keys(ids(4, 10), 2)) == 2


def test_server_args_bounds():
    assert ServerArgs(dp_size=2, load_balance_method="round_robin").dp_size == 2
    with pytest.raises(ValueError, match="--dp-size"):
        ServerArgs(dp_size=0)
    with pytest.raises(ValueError, match="--load-balance-method"):
        ServerArgs(load_balance_method="random")
    with pytest.raises(ValueError, match="--dp-balance-rel-threshold"):
        ServerArgs(dp_balance_rel_threshold=0.5)


def _two_replica_tm(method: str = "prefix_affinity"):
    """A fake ``TokenizerManager`` with two replicas, each a held ``FakeEngine``."""
    from app_helpers import FakeEngine, fake_tm

    from engine import io_struct as io
    from server.replicas import Replica

    tm = fake_tm(ServerArgs(load_balance_method=method))
    second = FakeEngine(tm)
    tm.replicas.append(Replica(1, second))
    tm.replicas[1].ready["engine"] = tm.ready["engine"]
    tm.router.dispatcher = Dispatcher(2, method, block=4)
    for e in (tm.push, second):
        e.hold = True
    assert isinstance(tm.ready["engine"], io.ReadyOut)
    return tm, [tm.push, second]


def test_requests_spread_die_with_their_replica_and_abort_there():
    import asyncio

    from engine import io_struct as io
    from engine.sampling.params import SamplingParams
    from server.http.errors import APIError

    async def main():
        tm, engines = _two_replica_tm()
        sp = SamplingParams(max_tokens=1)

        async def run(rid, ids):
            return [o async for o in tm.generate([(rid, ids, sp)], False)]

        a = asyncio.ensure_future(run("a", ids(8, 100)))
        b = asyncio.ensure_future(run("b", ids(8, 200)))
        await asyncio.sleep(0)
        assert engines[0].rids == ["a"] and engines[1].rids == ["b"]  # least loaded
        assert [r.inflight for r in tm.replicas] == [1, 1] and tm.router.owner == {"a": 0, "b": 1}
        # the same prefix as "a" follows it though replica 0 is busier
        c = asyncio.ensure_future(run("c", ids(8, 100) + [1]))
        await asyncio.sleep(0)
        assert engines[0].rids == ["a", "c"]
        c.cancel()
        await asyncio.gather(c, return_exceptions=True)
        assert [type(m) for m in engines[0].sent][-1] is io.AbortReq  # to its own replica
        assert not any(isinstance(m, io.AbortReq) for m in engines[1].sent)
        tm.on_replica_died(1, "engine", -9)
        with pytest.raises(APIError) as err:
            await b
        assert err.value.status == 503 and "replica 1" in err.value.message
        assert tm.dead is None and tm.replicas[1].dead
        engines[0].release()
        assert (await a)[-1].finish_reason is not None
        d = asyncio.ensure_future(run("d", ids(8, 200)))  # 200's prefix was on 1: now 0
        await asyncio.sleep(0)
        engines[0].release()
        await d
        assert engines[0].rids == ["a", "c", "d"] and tm.router.owner == {}
        assert [r.inflight for r in tm.replicas] == [0, 0]
        tm.on_replica_died(0, "detokenizer", 1)  # the last one: the server's engine is gone
        assert tm.dead is not None

    asyncio.run(main())


def test_replica_figures_survive_a_later_step_stats_message():
    """/server_info's replicas list shows each replica's answer to the server-info request,
    even when an engine's periodic StatsOut (no KV token figures) lands after it (the
    --dp-size e2e test read a KeyError there when it did)."""
    from engine import io_struct as io
    from server.replicas import replica_status

    tm, _ = _two_replica_tm()
    for i in (0, 1):
        tm._dispatch(io.ServerInfoOut(rid=f"info-{i}", kv_used_tokens=10 + i, kv_free_tokens=90,
                                      kv_total_tokens=100, num_running=i, num_waiting=0), i)
    tm._dispatch(io.StatsOut(num_running=3, num_waiting=0, kv_usage=0.5), 0)
    reps = replica_status(tm.replicas, [])
    assert [r["kv_total_tokens"] for r in reps] == [100, 100]
    assert [r["kv_used_tokens"] for r in reps] == [10, 11]
