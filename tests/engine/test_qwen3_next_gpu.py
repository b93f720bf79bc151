"""Qwen3-Next on the GPU (marker gpu): the tiny random checkpoint of ``qwen3_next_helpers``
served by ``LLM`` on CUDA in float32, whose linear layers run fla-core's chunked kernel for
prefills (the torch reference where fla-core is missing) and ferry's Triton decode step,
against HF on the CPU (its torch path). Triton's fp32 dots may run in TF32 on the GPU, so
the check allows a greedy token to differ only where HF's two best logits nearly tie.

- prefill: the prompt log-probs of prompt + HF's continuation (chunked prefill, chunks of 64,
  the 150-token prompt crossing FLA's chunks and ferry's prefill chunks) within 2e-2;
- decode: greedy tokens equal HF's up to a near-tie, their log-probs within 2e-2 before it;
- every state slot given back;
- prefix hits with overlap scheduling (state snapshots) against a cache-off run;
- decode graphs (the linear layers' slots from the graph runner's static buffer, padded rows
  on the scratch slot) against eager decode: 5 requests over 3 state slots (decode batches
  of 3, 2 and 1 rows in buckets of 1, 2 and 4; finished requests' slots reused), the same
  greedy tokens and log-probs within 2e-2, and the decode steps replayed.
"""

from __future__ import annotations

import pytest
import torch

from engine.device import resolve_device

pytestmark = pytest.mark.gpu
if resolve_device("auto") != "cuda":
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformers.models.qwen3_next")

NEW_TOKENS = 12
TOL = 2e-2
NEAR_TIE = 0.05


def _hf(hf, prompt):
    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
        toks = out.sequences[0, len(prompt):].tolist()
        steps = [torch.log_softmax(lg[0].float(), -1).cpu() for lg in out.logits]
        full = torch.tensor([prompt + toks], device=hf.device)
        prompt_lps = torch.log_softmax(hf(full).logits[0].float(), -1).cpu()
    seq = prompt + toks
    teacher = [prompt_lps[j - 1, seq[j]].item() for j in range(1, len(seq))]
    return toks, steps, seq, teacher


def test_tiny_qwen3_next_on_the_gpu_matches_hf(tmp_path):
    from qwen3_next_helpers import save_tiny

    from engine.llm import LLM
    from engine.sampling.params import SamplingParams
    from kernels.linear_attention import gated_delta_rule_backend

    # HF on the GPU too: with fla-core installed, transformers' Gated DeltaNet takes FLA's
    # Triton kernels, which cannot read CPU tensors (the first H200 run failed so)
    hf = save_tiny("qwen3_next", tmp_path).to("cuda")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 13, 70, 150)]
    refs = [_hf(hf, p) for p in prompts]
    print("gated delta rule prefill backend:", gated_delta_rule_backend("cuda"))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    echo = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    with LLM(str(tmp_path), dtype="float32", device="cuda", max_total_tokens=4096,
             chunked_prefill_size=64, disable_cuda_graph=True) as llm:
        outs = llm.generate(prompts, greedy)
        echoed = llm.generate([r[2] for r in refs], echo)
        pool = llm.runner.state_pool
        assert pool.available() == pool.num_slots
    for i, (o, e, (toks, steps, _seq, teacher)) in enumerate(zip(outs, echoed, refs)):
        got = [entry[0] for entry in e.prompt_logprobs[1:]]
        worst = max(abs(a - b) for a, b in zip(got, teacher))
        assert worst < TOL, f"prompt {i}: prefill log-probs differ from HF by {worst:.2e}"
        for j, (a, b) in enumerate(zip(o.token_ids, toks)):
            if a != b:
                top2 = steps[j].topk(2).values
                gap = (top2[0] - top2[1]).item()
                assert gap < NEAR_TIE, (f"prompt {i} step {j}: ferry {a} != HF {b} with HF's "
                                        f"top-2 gap {gap:.3f}")
                break
            lp = o.logprobs[j][0]
            assert abs(lp - steps[j][b].item()) < TOL, f"prompt {i} step {j}: log-prob {lp}"


def test_prefix_hits_with_overlap_match_a_cache_off_run(tmp_path):
    """Prefix reuse on CUDA with overlap scheduling (the state snapshots are copied in stream
    order with the steps in flight): a prompt extending a finished one, one diverging inside
    its output, turn 2 of a chat and a miss, in one batch, against the same batch with the
    cache off; accounting (pages, slots, snapshots) checked after every step."""
    from qwen3_next_helpers import save_tiny

    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    save_tiny("qwen3_next", tmp_path)
    g = torch.Generator().manual_seed(9)
    first, turn1, miss = (torch.randint(3, 250, (n,), generator=g).tolist() for n in (90, 40, 20))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    kw = dict(dtype="float32", device="cuda", max_total_tokens=4096, chunked_prefill_size=32,
              disable_cuda_graph=True)
    with LLM(str(tmp_path), **kw) as llm:
        assert llm.scheduler.overlap and llm.scheduler.kv.snapshots is not None
        llm.scheduler.check_kv = True
        a, t1 = llm.generate([first, turn1], greedy)
        batch = [first + [5, 6, 7], first + a.token_ids[:4] + [8, 9],
                 turn1 + t1.token_ids + [10, 11, 12], miss]
        hits = llm.generate(batch, greedy)
        # turn 2: all of turn 1 that was fed (with overlap, its last token too: the step
        # after the one that sampled it was in flight when it finished)
        assert [o.num_cached_tokens for o in hits[:2]] + [hits[3].num_cached_tokens] == \
            [90, 90, 0]
        assert hits[2].num_cached_tokens in (40 + NEW_TOKENS - 1, 40 + NEW_TOKENS)
    with LLM(str(tmp_path), disable_radix_cache=True, **kw) as llm:
        plain = llm.generate(batch, greedy)
    for i, (o, p) in enumerate(zip(hits, plain)):
        for j, (x, y) in enumerate(zip(o.token_ids, p.token_ids)):
            if x != y:   # only where the two runs' numerics meet a near-tie
                break
            assert abs(o.logprobs[j][0] - p.logprobs[j][0]) < TOL, f"prompt {i} step {j}"


def test_decode_graphs_match_eager_decode(tmp_path):
    from qwen3_next_helpers import save_tiny

    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    save_tiny("qwen3_next", tmp_path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 23, 9, 70, 2)]
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1)
           for m in (6, 11, 3, 8, 5)]
    kw = dict(dtype="float32", device="cuda", max_total_tokens=4096, chunked_prefill_size=64,
              max_running_requests=3, cuda_graph_max_bs=4)
    with LLM(str(tmp_path), disable_cuda_graph=True, **kw) as llm:
        want = llm.generate(prompts, sps)
    with LLM(str(tmp_path), **kw) as llm:
        gr = llm.runner.graph_runner
        assert gr is not None, "decode graphs were not kept (see the start-up log)"
        assert llm.runner.piecewise_runner is None
        calls = []
        replay = gr.replay
        gr.replay = lambda *a, **k: (calls.append(a[0].batch_size), replay(*a, **k))[1]
        got = llm.generate(prompts, sps)
        pool = llm.runner.state_pool
        assert pool.available() == pool.num_slots
    assert len(calls) >= 10 and max(calls) == 3, calls   # 3 rows replay the 4-row bucket
    for i, (o, w) in enumerate(zip(got, want)):
        assert o.token_ids == w.token_ids, f"request {i}: graphs {o.token_ids} != eager " \
                                           f"{w.token_ids}"
        worst = max(abs(a[0] - b[0]) for a, b in zip(o.logprobs, w.logprobs))
        assert worst < TOL, f"request {i}: log-probs differ by {worst:.2e}"
