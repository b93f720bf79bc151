"""LoRA adapters in the engine (issue 29) against transformers + peft, on a tiny seeded random
Llama (fp32, CPU): greedy tokens identical and the chosen tokens' log-probs within 1e-3, for
each adapter and the base alone and in one mixed batch; fewer slots than adapters (slots
reused, the scheduler holding requests back); unloading while requests run; the prefix
cache kept apart per adapter; adapters that must be refused, with the field named.

Adapters: ``a1`` rank 8 on all seven projections; ``a2`` rank 16, rsLoRA, on q/v/down only
(the other projections of its slot stay zero).
"""

from __future__ import annotations

import pytest
import torch
from lora_helpers import (
    ALL_MODULES,
    edit_config,
    greedy_reference,
    save_adapter,
    save_llama,
)

from engine.device import is_accelerator, resolve_device
from engine.sampling.params import SamplingParams

N = 6
PROMPTS = [[5, 9, 14, 3, 77, 120, 31], list(range(40, 70)), [200, 201, 7, 7]]
KW = dict(device="cpu", max_total_tokens=2048, chunked_prefill_size=32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    hf = save_llama(base)
    a1 = save_adapter(base, root / "a1", seed=1, r=8, targets=ALL_MODULES)
    a2 = save_adapter(base, root / "a2", seed=2, r=16, targets=["q_proj", "v_proj", "down_proj"],
                      alpha=8, rslora=True)
    refs = {name: [greedy_reference(m, p, N) for p in PROMPTS]
            for name, m in (("base", hf), ("a1", a1), ("a2", a2))}
    return {"base": str(base), "a1": str(root / "a1"), "a2": str(root / "a2"),
            "root": root, "refs": refs}


def _sp():
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=0)


def _check(out, ref, what):
    toks, lps = ref
    assert out.token_ids == toks, f"{what}: tokens differ from transformers + peft"
    got = [lp[0] for lp in out.logprobs]
    assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3, f"{what}: log-probs differ"


def test_adapters_change_the_answer(ckpt):
    """The fixture can tell adapters apart (else the comparisons below prove nothing)."""
    r = ckpt["refs"]
    for i in range(len(PROMPTS)):
        assert len({tuple(r[k][i][0]) for k in ("base", "a1", "a2")}) == 3


def test_alone_and_mixed_match_peft(ckpt):
    from engine import LLM

    llm = LLM(ckpt["base"], lora_paths=[f"a1={ckpt['a1']}", ckpt["a2"]], **KW)
    llm.scheduler.check_kv = True
    refs = ckpt["refs"]
    for name in ("a1", "a2", None):  # each alone (a2 is named after its directory)
        for out, ref in zip(llm.generate(PROMPTS, _sp(), lora=name), refs[name or "base"]):
            _check(out, ref, f"{name} alone")
    # one concurrent mixed batch: every prompt under base, a1 and a2 together
    names = [None, "a1", "a2"]
    prompts = [p for p in PROMPTS for _ in names]
    outs = llm.generate(prompts, _sp(), lora=names * len(PROMPTS))
    for i, out in enumerate(outs):
        name = names[i % 3]
        _check(out, refs[name or "base"][i // 3], f"{name} mixed")
    llm.scheduler.kv.check([])


def test_fewer_slots_than_adapters(ckpt):
    """One slot, two adapters and the base in one call: the scheduler runs one adapter at a
    time beside the base rows, the slot is rewritten, every answer is still peft's."""
    from engine import LLM

    llm = LLM(ckpt["base"], lora_paths=[f"a1={ckpt['a1']}", f"a2={ckpt['a2']}"],
              max_loras_per_batch=1, **KW)
    names = ["a1", "a2", None, "a2", "a1"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = llm.generate(prompts, _sp(), lora=names)
    for i, (out, name) in enumerate(zip(outs, names)):
        _check(out, ckpt["refs"][name or "base"][i % 3], f"{name} with one slot")


def test_prefix_cache_is_per_adapter(ckpt):
    from engine import LLM

    llm = LLM(ckpt["base"], lora_paths=[f"a1={ckpt['a1']}", f"a2={ckpt['a2']}"], **KW)
    long = PROMPTS[1]
    base = llm.generate([long], _sp())[0]
    first = llm.generate([long], _sp(), lora="a1")[0]
    assert first.num_cached_tokens == 0, "a1 reused the base model's KV"
    _check(first, ckpt["refs"]["a1"][1], "a1 after base")
    again = llm.generate([long], _sp(), lora="a1")[0]
    assert again.num_cached_tokens > 0, "a1 did not reuse its own KV"
    _check(again, ckpt["refs"]["a1"][1], "a1 cached")
    other = llm.generate([long], _sp(), lora="a2")[0]
    assert other.num_cached_tokens == 0, "a2 reused a1's KV"
    _check(other, ckpt["refs"]["a2"][1], "a2 after a1")
    base2 = llm.generate([long], _sp())[0]
    assert base2.num_cached_tokens > 0 and base2.token_ids == base.token_ids


def test_load_and_unload_under_load(ckpt):
    """Requests on a1 keep running after a1 is unloaded and a2 is loaded under its name;
    new requests for the name get a2; an unknown name is refused naming it."""
    from engine import LLM
    from engine.scheduler.request import Req

    llm = LLM(ckpt["base"], enable_lora=True, max_lora_rank=16, max_loras_per_batch=2, **KW)
    llm.load_lora("x", ckpt["a1"])
    sched = llm.scheduler
    mgr = llm.runner.lora
    reqs = [Req(f"r{i}", list(p), _sp(), lora_id=mgr.resolve("x"))
            for i, p in enumerate(PROMPTS)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):
        sched.step()
    assert not any(r.finished for r in reqs)
    llm.unload_lora("x")
    with pytest.raises(ValueError, match="'x'"):
        llm.generate(PROMPTS[:1], _sp(), lora="x")
    llm.load_lora("x", ckpt["a2"])  # the same name, another adapter, while a1 still runs
    late = Req("late", list(PROMPTS[0]), _sp(), lora_id=mgr.resolve("x"))
    sched.add_request(late)
    while not all(r.finished for r in reqs + [late]):
        sched.step()
    for i, r in enumerate(reqs):
        assert r.output_ids == ckpt["refs"]["a1"][i][0], "in-flight request lost its adapter"
    assert late.output_ids == ckpt["refs"]["a2"][0][0]
    assert [a["name"] for a in mgr.list()] == ["x"] and len(mgr.adapters) == 1  # a1 gone
    with pytest.raises(ValueError, match="'nope'"):
        llm.unload_lora("nope")


@pytest.mark.parametrize("field,value,match", [
    ("use_dora", True, "use_dora"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("target_modules", ["q_proj", "embed_tokens"], "target_modules"),
    ("bias", "all", "bias"),
])
def test_unsupported_adapters_are_refused(ckpt, tmp_path, field, value, match):
    import shutil

    from engine import LLM
    from engine.lora.adapter import LoRAError

    bad = tmp_path / "bad"
    shutil.copytree(ckpt["a1"], bad)
    edit_config(bad, **{field: value})
    llm = LLM(ckpt["base"], enable_lora=True, **KW)
    with pytest.raises(LoRAError, match=match):
        llm.load_lora("bad", str(bad))
    with pytest.raises(LoRAError, match="--max-lora-rank 4"):
        LLM(ckpt["base"], lora_paths=[ckpt["a1"]], max_lora_rank=4, **KW)
    with pytest.raises(LoRAError, match="not a directory"):
        llm.load_lora("gone", str(tmp_path / "missing"))


def test_lora_rows_leave_base_rows_alone(ckpt):
    """The torch path adds nothing to base rows (a direct check on one projection)."""
    from engine import LLM

    llm = LLM(ckpt["base"], lora_paths=[f"a1={ckpt['a1']}"], **KW)
    layer = llm.runner.model.model.layers[0].self_attn.qkv_proj
    mgr = llm.runner.lora
    slots, _ = mgr.slots_for([mgr.resolve("a1")])
    x = torch.randn(5, 64)
    mgr.set_batch([0, 2], [2, 3], [-1, slots[0]])
    y = layer(x)
    mgr.set_batch([0], [5], [-1])
    y0 = layer(x)
    assert torch.equal(y[:2], y0[:2]) and not torch.allclose(y[2:], y0[2:])


def test_tensor_parallel_2_matches_peft(ckpt):
    """TP=2 on the CPU (gloo): A and B split with their base layers; one slot, so rank 0
    copies adapters in during the run and the worker repeats the copies (a2 loaded late)."""
    from engine import LLM

    with LLM(ckpt["base"], lora_paths=[f"a1={ckpt['a1']}"], enable_lora=True,
             max_lora_rank=16, max_loras_per_batch=1, tp_size=2, cpu_threads=1, **KW) as llm:
        llm.load_lora("a2", ckpt["a2"])
        names = ["a2", None, "a1", "a1", "a2"]
        prompts = [PROMPTS[i % 3] for i in range(len(names))]
        outs = llm.generate(prompts, _sp(), lora=names)
    for i, (out, name) in enumerate(zip(outs, names)):
        _check(out, ckpt["refs"][name or "base"][i % 3], f"{name} at TP=2")


@pytest.mark.gpu
@pytest.mark.skipif(not is_accelerator(resolve_device("auto")), reason="needs a CUDA or XPU "
                    "device")
def test_gpu_triton_and_decode_graphs_match_peft(ckpt):
    """On an accelerator (fp32: IEEE tl.dot): the Triton kernels in eager prefill and in
    captured decode graphs (slots read from the graph's buffer), mixed batch of base + both
    adapters, then base requests alone (the graphs captured without the LoRA kernels); then
    the same with graphs off."""
    from engine import LLM

    names = [None, "a1", "a2"]
    prompts = [p for p in PROMPTS for _ in names]
    for graphs in (True, False):
        llm = LLM(ckpt["base"], lora_paths=[f"a1={ckpt['a1']}", f"a2={ckpt['a2']}"],
                  device=resolve_device("auto"), dtype="float32", max_total_tokens=2048,
                  disable_cuda_graph=not graphs)
        assert (llm.runner.graph_runner is not None) == graphs
        outs = llm.generate(prompts, _sp(), lora=names * len(PROMPTS))
        for i, out in enumerate(outs):
            _check(out, ckpt["refs"][names[i % 3] or "base"][i // 3],
                   f"{names[i % 3]} on the device, graphs {graphs}")
        if graphs:  # steps without an adapter row replay the graphs without the kernels
            gr = llm.runner.graph_runner
            assert set(gr.base_graphs) == set(gr.graphs)
        outs = llm.generate(PROMPTS, _sp(), lora=[None] * len(PROMPTS))
        for i, out in enumerate(outs):
            _check(out, ckpt["refs"]["base"][i], f"base alone on the device, graphs {graphs}")
        llm.shutdown()


@pytest.mark.slow
def test_embedded_model_with_an_adapter_matches_peft(tmp_path, hf_embedded_model,
                                                     hf_embedded_tokenizer):
    """The embedded SmolLM2 (its GGUF dequantized by transformers, saved as safetensors) with
    a peft adapter on q/v/o/down: ferry's greedy tokens and log-probs are peft's, for the
    adapter and the base in one batch."""
    from transformers import LlamaForCausalLM

    from engine import LLM

    gguf = hf_embedded_model  # the session's (tests/conftest.py): read, never changed
    hf = LlamaForCausalLM(gguf.config).eval()
    hf.load_state_dict(gguf.state_dict())
    base = tmp_path / "smollm2"
    hf.save_pretrained(base)
    hf_embedded_tokenizer.save_pretrained(base)  # the session's HF conversion (tests/conftest.py)
    peft_model = save_adapter(base, tmp_path / "ad", seed=5, r=8,
                              targets=["q_proj", "v_proj", "o_proj", "down_proj"], scale=0.2)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 198, 2683, 1090, 30]]
    refs = {name: [greedy_reference(m, p, 4) for p in prompts]
            for name, m in (("ad", peft_model), (None, hf))}
    assert refs["ad"] != refs[None]
    llm = LLM(str(base), lora_paths=[f"ad={tmp_path / 'ad'}"], device="cpu",
              max_total_tokens=1024)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    names = ["ad", None] * len(prompts)
    outs = llm.generate([p for p in prompts for _ in range(2)], sp, lora=names)
    for i, out in enumerate(outs):
        _check(out, refs[names[i]][i // 2], f"embedded model, adapter {names[i]}")
