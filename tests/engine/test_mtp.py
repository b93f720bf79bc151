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


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE"])
def test_other_algorithms_on_mla_are_lossless(deepseek, tmp_path, algo):
    """MLA targets speculate with the other proposers too: NGRAM, and an EAGLE-1 head (a
    random one of the tests' Llama shape: hidden 64, vocabulary 256, as the DeepSeek's)."""
    from engine import LLM

    extra = {}
    if algo == "EAGLE":
        from test_speculative_models import save_head

        save_head(str(tmp_path / "head"), False, seed=5)
        extra = {"speculative_draft_model_path": str(tmp_path / "head"),
                 "speculative_num_steps": 3}
    base = _run(LLM(str(deepseek["random"]), **KW))
    llm = LLM(str(deepseek["random"]), speculative_algorithm=algo, **extra, **KW)
    llm.scheduler.check_kv = True
    assert _run(llm) == base
    assert llm.scheduler.stats["spec_verify_steps"] > 0


def test_deepseek_mtp_with_dummy_weights(deepseek, tmp_path):
    """``--load-format dummy``: the config alone (``num_nextn_predict_layers`` 1) gets a
    seeded random MTP layer (MLA + MoE); greedy output is still the target's."""
    import shutil

    from engine import LLM

    shutil.copy(deepseek["random"] / "config.json", tmp_path / "config.json")
    kw = dict(KW, load_format="dummy", tokenizer_path=str(deepseek["random"]))
    base = [o.token_ids for o in LLM(str(tmp_path), **kw).generate(PROMPTS, _greedy())]
    llm = LLM(str(tmp_path), speculative_algorithm="MTP", speculative_num_steps=2, **kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, _greedy())] == base
    assert llm.scheduler.stats["spec_proposed_tokens"] > 0


def test_mtp_refused_without_mtp_weights(tmp_path):
    from engine.args import ServerArgs
    from engine.executor.preflight import check_start_up

    save_deepseek("v3", tmp_path / "plain")           # no model.layers.3.* tensors
    args = ServerArgs(model_path=str(tmp_path / "plain"), device="cpu",
                      speculative_algorithm="MTP")
    with pytest.raises(ValueError, match="has no MTP layer") as e:
        check_start_up(args)
    assert "\n" not in str(e.value)


# ---- Qwen3-Next / Qwen3.5: the linear layers' states roll back to the accepted tokens ----

QWEN_FULL_LAYER = {"qwen3_next": 3, "qwen3_5": 3}   # a full-attention layer to copy


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def qwen(request, tmp_path_factory):
    from mtp_helpers import add_qwen_mtp
    from qwen3_next_helpers import save_tiny as save_qwen

    case = request.param
    root = tmp_path_factory.mktemp(f"mtp_{case}")
    hf = save_qwen(case, root / "random")
    add_qwen_mtp(root / "random", QWEN_FULL_LAYER[case])
    from engine import LLM

    base = _run(LLM(str(root / "random"), **KW))
    return {"case": case, "root": root, "hf": hf, "base": base}


def test_qwen_mtp_is_lossless(qwen):
    """Random MTP weights: the drafts are mostly rejected, so nearly every verify step
    rolls the recurrent states back to the request's first row."""
    for ours, theirs in zip(qwen["base"], _hf_greedy(qwen["hf"], PROMPTS)):
        assert ours[:len(theirs)] == theirs
    llm = _spec_llm(qwen["root"] / "random")
    assert _run(llm) == qwen["base"]
    st = llm.scheduler.stats
    assert st["spec_verify_reqs"] > 0 and st["spec_proposed_tokens"] > 0
    _check_released(llm)


def test_qwen_mtp_partial_rejections_keep_the_accepted_state(qwen, monkeypatch):
    """The MTP head drafts, then its chain is replaced by the true continuation (the
    baseline's tokens) for its first ``n % k`` positions and a wrong token after, so the
    verify steps accept every count from 0 to k - 1 (and k where the chain is all true):
    the states must be those after exactly the accepted tokens."""
    if qwen["case"] != "qwen3_next":
        pytest.skip("one hybrid family is enough for the rollback at every count")
    k = 3
    llm = _spec_llm(qwen["root"] / "random", k=k)
    prop = llm.scheduler.spec.proposer
    real = prop.propose_reqs
    base = {tuple(p): b for p, b in zip(PROMPTS, qwen["base"])}

    def steered(reqs, ks):
        out = real(reqs, ks)
        for i, (req, d) in enumerate(zip(reqs, out)):
            if not d:
                continue
            n = len(req.output_ids)
            true = base[tuple(req.origin_input_ids)][n:n + len(d)]
            j = n % (k + 1)
            out[i] = [t if m < j else (t + 1) % 256 for m, t in enumerate(true)]
        return out

    monkeypatch.setattr(prop, "propose_reqs", steered)
    assert _run(llm) == qwen["base"]
    lengths = llm.scheduler.stats["spec_accept_lengths"]
    assert lengths[0] > 0 and lengths[1] > 0 and lengths[2] > 0, lengths
    _check_released(llm)


def test_qwen_mtp_oracle_drafts_are_accepted(qwen):
    from mtp_helpers import add_qwen_mtp
    from qwen3_next_helpers import save_tiny as save_qwen

    from engine import LLM

    path = qwen["root"] / "oracle"
    save_qwen(qwen["case"], path)
    add_qwen_mtp(path, QWEN_FULL_LAYER[qwen["case"]], oracle=True)
    base = _run(LLM(str(path), **KW))
    llm = _spec_llm(path, k=3)
    assert _run(llm) == base
    st = llm.scheduler.stats
    assert st["spec_accepted_tokens"] >= 0.9 * st["spec_proposed_tokens"] > 0


def test_qwen_mtp_with_dummy_weights(qwen, tmp_path):
    """``--load-format dummy`` (the benchmarks' path): a config alone declaring the MTP
    layer gets seeded random MTP weights; greedy output is still the target's."""
    import shutil

    from engine import LLM

    if qwen["case"] != "qwen3_next":
        pytest.skip("one family is enough for the dummy path")
    shutil.copy(qwen["root"] / "random" / "config.json", tmp_path / "config.json")
    kw = dict(KW, load_format="dummy", tokenizer_path=str(qwen["root"] / "random"))
    base = [o.token_ids for o in LLM(str(tmp_path), **kw).generate(PROMPTS, _greedy())]
    llm = LLM(str(tmp_path), speculative_algorithm="MTP", speculative_num_steps=2, **kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, _greedy())] == base
    assert llm.scheduler.stats["spec_proposed_tokens"] > 0


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE"])
def test_other_algorithms_on_hybrid_models_are_lossless(qwen, tmp_path, algo):
    """The verify step's state commit serves every proposer the hybrid models run."""
    from engine import LLM

    if qwen["case"] != "qwen3_next":
        pytest.skip("one hybrid family is enough")
    extra = {}
    if algo == "EAGLE":
        from test_speculative_models import save_head

        save_head(str(tmp_path / "head"), False, seed=5)
        extra = {"speculative_draft_model_path": str(tmp_path / "head"),
                 "speculative_num_steps": 3}
    llm = LLM(str(qwen["root"] / "random"), speculative_algorithm=algo, **extra, **KW)
    llm.scheduler.check_kv = True
    assert _run(llm) == qwen["base"]
    if algo == "EAGLE":  # (this model's outputs do not repeat: NGRAM may find no match)
        assert llm.scheduler.stats["spec_verify_steps"] > 0
