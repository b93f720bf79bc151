"""--kv-cache-dtype fp8: the pool stores fp8 (a quarter of fp32's bytes, half of bf16's) and
the logits stay close to those of the model-dtype cache."""

from __future__ import annotations

import pytest
import torch

from engine.args import ServerArgs
from engine.device import resolve_device, resolve_kv_dtype
from engine.forward_batch import ForwardMode
from engine.loader.loader import config_dir
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req

DEVICE = resolve_device("auto")


def test_resolve_kv_dtype():
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2
    with pytest.raises(ValueError, match="kv cache dtype"):
        resolve_kv_dtype("int4", torch.float32)


def _logits(kv_cache_dtype: str, dtype: str):
    """Logits of a prefill step (two prompts) and of the decode step after it."""
    from engine.executor.model_runner import ModelRunner
    from engine.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=config_dir("llama-tiny"), load_format="dummy", device=DEVICE,
                      dtype=dtype, max_total_tokens=2048, max_running_requests=4,
                      kv_cache_dtype=kv_cache_dtype, disable_overlap_schedule=True)
    runner = ModelRunner(args)
    sched = Scheduler(args, runner)
    g = torch.Generator().manual_seed(0)
    for rid, n in (("a", 40), ("b", 23)):
        ids = torch.randint(0, runner.vocab_size, (n,), generator=g).tolist()
        sched.add_request(Req(rid, ids, SamplingParams(max_tokens=8, temperature=0,
                                                       ignore_eos=True)))
    out = []
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        batch = sched.get_next_batch()
        assert batch.mode == mode
        out.append(runner.forward(batch).float().cpu())
        sched.inflight = sched._launch(batch)
        sched._drain()
    return runner, out


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_logits_close_to_model_dtype(kv):
    dtype = "float32" if DEVICE == "cpu" else "bfloat16"
    base_runner, base = _logits("auto", dtype)
    runner, got = _logits(kv, dtype)
    pool = runner.kv_pool
    assert pool.k_buffers[0].dtype == resolve_kv_dtype(kv, runner.dtype)
    assert pool.bytes_per_token(1, 1, 8, pool.dtype) * base_runner.dtype.itemsize == \
        pool.bytes_per_token(1, 1, 8, base_runner.kv_pool.dtype)
    # every step attends to fp8-rounded keys and values (the prefill to its new tokens as
    # stored, too): the logits move by about the fp8 rounding, and no more
    bound = {"fp8_e4m3": 0.05, "fp8_e5m2": 0.1}[kv]
    for step, (a, b) in enumerate(zip(got, base)):
        err = ((a - b).norm() / b.norm()).item()
        assert 0 < err < bound, f"step {step}: relative error {err:.3g}"


def _last_chunk_logits(chunk: int) -> torch.Tensor:
    """Logits of a 60-token prompt's last prefill chunk with an fp8 cache (CPU path)."""
    from engine.executor.model_runner import ModelRunner
    from engine.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=config_dir("llama-tiny"), load_format="dummy", device="cpu",
                      dtype="float32", max_total_tokens=1024, max_running_requests=2,
                      kv_cache_dtype="fp8_e4m3", chunked_prefill_size=chunk)
    runner = ModelRunner(args)
    sched = Scheduler(args, runner)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, runner.vocab_size, (60,), generator=g).tolist()
    sched.add_request(Req("a", ids, SamplingParams(max_tokens=2, temperature=0)))
    while True:
        batch = sched.get_next_batch()
        logits = runner.forward(batch)
        sched.inflight = sched._launch(batch)
        sched._drain()
        if batch.sample[0]:
            return logits


def test_fp8_cache_result_does_not_depend_on_chunking():
    """One 60-token chunk or chunks of 7: the same logits. New tokens are attended to as they
    are stored (fp8), not in the model dtype, so where a chunk ends (which varies with the
    load in mixed steps) does not change the answer."""
    one, many = _last_chunk_logits(64), _last_chunk_logits(7)
    err = ((one - many).norm() / one.norm()).item()
    assert err < 1e-4, f"relative logit error {err:.3g} between chunkings"
