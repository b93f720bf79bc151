"""Multi-token prediction (``--speculative-algorithm MTP`` / ``NEXTN``, issue 46 item 5 and
issue 45 item 5): the target checkpoint's own MTP layer drafts on the EAGLE machinery, on
tiny random checkpoints in float32 on the CPU (:mod:`mtp_helpers` adds the MTP tensors).

Lossless: greedy tokens with MTP equal those without, and HF ``generate``'s, for prompts of
different lengths batched. A random MTP layer's drafts are mostly rejected (the verify's
rollback is what is tested); the arranged ``oracle`` layer predicts exactly the target's
next token, so its drafts must be accepted (the acceptance counters move)."""

from __future__ import annotations

import pytest
import torch
from deepseek_helpers import save_tiny as save_deepseek
from mtp_helpers import add_deepseek_mtp

from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

KW = dict(device="cpu", max_total_tokens=2048, chunked_prefill_size=16)
PROMPTS = [[5, 9, 14, 3, 77, 120, 31], list(range(40, 80)), [200, 201, 7]]
STEPS = 12


def _greedy():
    return SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)


def _run(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, _greedy())]


def _hf_greedy(hf, prompts):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = hf.generate(ids, max_new_tokens=STEPS, do_sample=False,
                            attention_mask=torch.ones_like(ids))
        out.append(g[0, len(p):].tolist())
    return out


def _spec_llm(path, k=3, **kw):
    from engine import LLM

    llm = LLM(str(path), speculative_algorithm=kw.pop("algo", "MTP"), speculative_num_steps=k,
              **KW, **kw)
    llm.scheduler.check_kv = True
    return llm


def _check_released(llm):
    sched = llm.scheduler
    sched.kv.check([])
    prop = sched.spec.proposer
    prop.sweep()
    assert prop.seqs == {} and prop.used_tokens() == 0


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_deepseek")
    hf = save_deepseek("v3", root / "random")
    add_deepseek_mtp(root / "random")
    save_deepseek("v3", root / "oracle")
    add_deepseek_mtp(root / "oracle", oracle=True)
    return {"random": root / "random", "oracle": root / "oracle", "hf": hf}


def test_deepseek_mtp_is_lossless(deepseek, monkeypatch):
    """Verify as decode rows (the MLA decode path, several rows per request) and, with
    the share at 0, as an extend over the cached prefix."""
    from engine import LLM
    from engine.speculative import worker

    base = _run(LLM(str(deepseek["random"]), **KW))
    for ours, theirs in zip(base, _hf_greedy(deepseek["hf"], PROMPTS)):
        assert ours[:len(theirs)] == theirs     # HF stops at the end-of-sequence token
    llm = _spec_llm(deepseek["random"], algo="NEXTN")   # SGLang's name
    assert llm.args.speculative_algorithm == "MTP"
    assert _run(llm) == base
    st = llm.scheduler.stats
    assert st["spec_verify_reqs"] > 0 and st["spec_proposed_tokens"] > 0
    _check_released(llm)
    monkeypatch.setattr(worker, "VERIFY_AS_DECODE_KV_SHARE", 0.0)
    assert _run(_spec_llm(deepseek["random"], k=2)) == base


def test_deepseek_mtp_oracle_drafts_are_accepted(deepseek):
    from engine import LLM

    base = _run(LLM(str(deepseek["oracle"]), **KW))
    llm = _spec_llm(deepseek["oracle"], k=3)
    assert _run(llm) == base
    st = llm.scheduler.stats
    assert st["spec_accepted_tokens"] > 0
    # every draft is the target's own next token: accepted unless max_tokens cut the chain
    assert st["spec_accepted_tokens"] >= 0.9 * st["spec_proposed_tokens"]
    assert st["spec_accept_lengths"][-1] > 0
    _check_released(llm)


def test_mtp_refused_without_mtp_weights(tmp_path):
    from engine.args import ServerArgs
    from engine.executor.preflight import check_start_up

    save_deepseek("v3", tmp_path / "plain")           # no model.layers.3.* tensors
    args = ServerArgs(model_path=str(tmp_path / "plain"), device="cpu",
                      speculative_algorithm="MTP")
    with pytest.raises(ValueError, match="has no MTP layer") as e:
        check_start_up(args)
    assert "\n" not in str(e.value)
