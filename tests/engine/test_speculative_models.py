"""Speculative decoding with a model proposer (issue 26): STANDALONE (a draft model with the
target's vocabulary) and EAGLE / EAGLE-3 heads, on tiny seeded random Llama checkpoints in
float32 on the CPU. Greedy output must be the target's own (no speculation); a target that
drafts for itself has every draft accepted; the draft KV is released with the requests."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.params import SamplingParams

VOCAB = 256


def _llama_config(layers: int, hidden: int = 64, seed_heads: int = 4):
    import transformers as T

    return T.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_attention_heads=seed_heads, num_key_value_heads=2,
                         num_hidden_layers=layers, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False, attn_implementation="eager")


def save_llama(path, layers: int, seed: int, hidden: int = 64):
    """A seeded random HF Llama (fp32) saved with a 256-token character tokenizer."""
    from moe_helpers import save_random
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return save_random(LlamaForCausalLM(_llama_config(layers, hidden)).eval(), path, seed, 0.3)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")
    target, draft = root / "target", root / "draft"
    hf = save_llama(target, layers=4, seed=3)
    save_llama(draft, layers=1, seed=11)
    return {"target": str(target), "draft": str(draft), "hf": hf, "root": root}


KW = dict(device="cpu", max_total_tokens=2048, chunked_prefill_size=16)
PROMPTS = [[5, 9, 14, 3, 77, 120, 31], list(range(40, 80)), [200, 201, 7]]


@pytest.fixture(scope="module")
def baseline(ckpts):
    from engine import LLM

    llm = LLM(ckpts["target"], **KW)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, sp)]


def _run(llm, sp=None):
    sp = sp or SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, sp)]


def _check_released(llm):
    sched = llm.scheduler
    sched.kv.check([])
    prop = sched.spec.proposer
    prop.sweep()
    assert prop.seqs == {} and prop.used_tokens() == 0


def test_standalone_self_draft_accepts_every_draft(ckpts, baseline):
    from engine import LLM

    k = 3
    llm = LLM(ckpts["target"], speculative_algorithm="STANDALONE",
              speculative_draft_model_path=ckpts["target"], speculative_num_steps=k, **KW)
    llm.scheduler.check_kv = True
    assert _run(llm) == baseline
    st = llm.scheduler.stats
    assert st["spec_verify_reqs"] > 0
    lengths = st["spec_accept_lengths"]
    # every verify emits k + 1 tokens, except near max_tokens where fewer were proposed
    full = lengths[k]
    assert st["spec_accepted_tokens"] == st["spec_proposed_tokens"]
    assert full >= st["spec_verify_reqs"] - len(PROMPTS)
    _check_released(llm)


def test_standalone_other_draft_keeps_greedy_output(ckpts, baseline):
    from engine import LLM

    llm = LLM(ckpts["target"], speculative_algorithm="STANDALONE",
              speculative_draft_model_path=ckpts["draft"], speculative_num_steps=4,
              page_size=4, **KW)
    llm.scheduler.check_kv = True
    out = _run(llm)
    assert out == baseline
    st = llm.scheduler.stats
    assert st["spec_proposed_tokens"] > st["spec_accepted_tokens"]  # a poor draft: rejections
    # n > 1 (the same prompt twice), a max_tokens shorter than the chain, a radix-cache hit
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    two = llm.generate([PROMPTS[1], PROMPTS[1]], sp)
    assert [o.token_ids for o in two] == [baseline[1][:2]] * 2
    _check_released(llm)


def test_standalone_vocabulary_mismatch_fails_at_start(ckpts, tmp_path):
    import transformers as T

    from engine import LLM

    cfg = _llama_config(1)
    cfg.vocab_size = VOCAB + 64
    T.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--speculative-draft-model-path .* vocabulary has "
                                         "320 ids, the target's 256"):
        LLM(ckpts["target"], speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(tmp_path), **KW)


# ---- EAGLE / EAGLE-3 heads ----------------------------------------------------------------

H, HEADS, KV_HEADS, D = 64, 4, 2, 16
DRAFT_VOCAB = 64


def _head_tensors(eagle3: bool, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random head weights under the names SGLang and vLLM load."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    def norm():
        return 1.0 + r(H, scale=0.1)

    pre = "midlayer." if eagle3 else "layers.0."
    w = {f"{pre}self_attn.q_proj.weight": r(HEADS * D, 2 * H if eagle3 else H),
         f"{pre}self_attn.k_proj.weight": r(KV_HEADS * D, 2 * H if eagle3 else H),
         f"{pre}self_attn.v_proj.weight": r(KV_HEADS * D, 2 * H if eagle3 else H),
         f"{pre}self_attn.o_proj.weight": r(H, HEADS * D),
         f"{pre}post_attention_layernorm.weight": norm(),
         f"{pre}mlp.gate_proj.weight": r(2 * H, H), f"{pre}mlp.up_proj.weight": r(2 * H, H),
         f"{pre}mlp.down_proj.weight": r(H, 2 * H)}
    if eagle3:
        hot = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
        w.update({"fc.weight": r(H, 3 * H), "midlayer.input_layernorm.weight": norm(),
                  "midlayer.hidden_norm.weight": norm(), "norm.weight": norm(),
                  "lm_head.weight": r(DRAFT_VOCAB, H, scale=1.0),
                  "d2t": hot - torch.arange(DRAFT_VOCAB),
                  "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, hot, True)})
    else:
        w.update({"fc.weight": r(H, 2 * H), "fc.bias": r(H)})
    return w


def save_head(path, eagle3: bool, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    cfg = _llama_config(1)
    cfg.architectures = ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"]
    if eagle3:
        cfg.draft_vocab_size, cfg.target_hidden_size = DRAFT_VOCAB, H
    cfg.save_pretrained(path)
    w = _head_tensors(eagle3, seed)
    save_file({k: v.contiguous() for k, v in w.items()}, f"{path}/model.safetensors")
    return w


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    f = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([f, f], -1)[:, None], torch.cat([f, f], -1)[:, None]
    cos, sin = cos.cos(), sin.sin()
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_head_next(w, eagle3, hidden, ids_next, embed, lm_head):
    """A plain torch EAGLE / EAGLE-3 head over positions 0..P-1 (causal attention, NeoX
    RoPE): the greedy token after the last row, as a target id."""
    pre = "midlayer." if eagle3 else "layers.0."
    e = embed[ids_next]
    if eagle3:
        h = hidden @ w["fc.weight"].T
        x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"]),
                       _rms(h, w["midlayer.hidden_norm.weight"])], -1)
        res = h
    else:
        x = torch.cat([e, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
        res = x
    P = x.shape[0]
    pos = torch.arange(P)
    q = _rope((x @ w[f"{pre}self_attn.q_proj.weight"].T).view(P, HEADS, D), pos)
    k = _rope((x @ w[f"{pre}self_attn.k_proj.weight"].T).view(P, KV_HEADS, D), pos)
    v = (x @ w[f"{pre}self_attn.v_proj.weight"].T).view(P, KV_HEADS, D)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    att = att.masked_fill(torch.ones(P, P, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(P, HEADS * D)
    r2 = o @ w[f"{pre}self_attn.o_proj.weight"].T + res
    hp = _rms(r2, w[f"{pre}post_attention_layernorm.weight"])
    m = (torch.nn.functional.silu(hp @ w[f"{pre}mlp.gate_proj.weight"].T)
         * (hp @ w[f"{pre}mlp.up_proj.weight"].T)) @ w[f"{pre}mlp.down_proj.weight"].T
    out = m + r2
    if eagle3:
        i = int((_rms(out, w["norm.weight"])[-1] @ w["lm_head.weight"].T).argmax())
        return i + int(w["d2t"][i])
    return int((out[-1] @ lm_head.T).argmax())


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_eagle_heads_keep_greedy_output_and_match_a_torch_reference(ckpts, baseline, algo):
    from engine import LLM

    eagle3 = algo == "EAGLE3"
    path = ckpts["root"] / algo.lower()
    w = save_head(path, eagle3, seed=5)
    llm = LLM(ckpts["target"], speculative_algorithm=algo,
              speculative_draft_model_path=str(path), speculative_num_steps=3, **KW)
    llm.scheduler.check_kv = True
    prop = llm.scheduler.spec.proposer
    first: dict[str, list[int]] = {}
    orig = prop.propose_reqs

    def spy(reqs, ks):
        out = orig(reqs, ks)
        for r, d in zip(reqs, out):
            if d:
                first.setdefault(r.rid, [r.fill_ids, d])
        return out

    prop.propose_reqs = spy
    assert _run(llm) == baseline
    st = llm.scheduler.stats
    assert st["spec_verify_reqs"] > 0 and st["spec_proposed_tokens"] > 0
    _check_released(llm)

    # the first proposal for a request equals a plain torch head over the HF target's states
    hf = ckpts["hf"]
    L = hf.config.num_hidden_layers
    fill, drafts = first["offline-0"]  # the prompt, and what the target emitted until then
    ids = torch.tensor([fill[:-1]])
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
        hidden = torch.cat([hs[2][0], hs[L // 2][0], hs[L - 3][0]], -1) if eagle3 \
            else hs[L][0]
        want = ref_head_next(w, eagle3, hidden, torch.tensor(fill[1:]),
                             hf.model.embed_tokens.weight, hf.lm_head.weight)
    assert drafts[0] == want


def test_eagle_checkpoint_errors_name_the_flag(ckpts, tmp_path):
    from engine import LLM

    w = save_head(tmp_path, True, seed=1)
    from safetensors.torch import save_file

    del w["midlayer.hidden_norm.weight"]
    save_file(w, f"{tmp_path}/model.safetensors")
    with pytest.raises(ValueError, match="--speculative-draft-model-path .* lacks "
                                         "midlayer.hidden_norm.weight"):
        LLM(ckpts["target"], speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(tmp_path), **KW)


@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE3"])
def test_model_proposers_with_preemption_radix_cache_stops_and_sampling(ckpts, baseline, algo):
    """A pool small enough to preempt, batches above --speculative-max-batch-size (plain
    decode steps in between), page size 2, a radix-cache hit, a stop string inside a run,
    and seeded sampling: the greedy output stays the target's, the KV adds up."""
    from engine import LLM

    path = ckpts["draft"]
    if algo == "EAGLE3":
        path = ckpts["root"] / "eagle3_rest"
        save_head(path, True, seed=8)
    kw = {**KW, "max_total_tokens": 80, "page_size": 2}
    llm = LLM(ckpts["target"], speculative_algorithm=algo, speculative_draft_model_path=str(path),
              speculative_num_steps=2, speculative_max_batch_size=2, **kw)
    sched = llm.scheduler
    sched.check_kv = True
    step = sched.step

    def checked_step():  # the draft pool's accounting after every step too
        out = step()
        sched.spec.proposer.check()
        return out

    sched.step = checked_step
    assert _run(llm) == baseline
    st = llm.scheduler.stats
    assert st["preemptions"] > 0 and st["spec_verify_reqs"] > 0
    again = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0,
                                                    ignore_eos=True))[0]
    assert again.num_cached_tokens > 0 and again.token_ids == baseline[1]
    text = llm.tokenizer.decode(baseline[0])
    stop = text[9:11]
    o = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
    assert o.finish_reason == "stop" and o.text == text[:text.index(stop)]
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    a, b = llm.generate([PROMPTS[2], PROMPTS[2]], sp)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    _check_released(llm)


def test_start_up_errors_name_the_flags(ckpts, tmp_path):
    from engine import LLM
    from engine.args import ServerArgs
    from engine.loader.loader import config_dir
    from engine.scheduler.build import check_environment

    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="--speculative-draft-model-path .*nowhere"):
        check_environment(ServerArgs(model_path=ckpts["target"], device="cpu",
                                     speculative_algorithm="STANDALONE",
                                     speculative_draft_model_path=missing))
    # a path that exists but holds no model: refused before any process starts (the
    # engine process died in the draft's loader, after loading the target, with a traceback)
    readme, empty = tmp_path / "README.md", tmp_path / "empty"
    readme.write_text("not a model")
    empty.mkdir()
    for bad, why in ((readme, "not a .gguf or .json"), (empty, "nothing loadable")):
        with pytest.raises(ValueError, match=f"--speculative-draft-model-path .*{why}"):
            check_environment(ServerArgs(model_path=ckpts["target"], device="cpu",
                                         speculative_algorithm="STANDALONE",
                                         speculative_draft_model_path=str(bad)))
    save_head(tmp_path, True, seed=2)
    with pytest.raises(ValueError, match="--speculative-algorithm EAGLE3: .* at least 3 layers"):
        LLM(config_dir("llama-tiny"), load_format="dummy", device="cpu", max_total_tokens=256,
            speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path))


def test_eagle3_dummy_head_from_a_config(ckpts, tmp_path):
    """--load-format dummy draws a random head for a bare config (the benchmarks'
    published-shape heads); the greedy output is still the target's."""
    from engine import LLM

    cfg = _llama_config(1)
    cfg.architectures, cfg.draft_vocab_size = ["LlamaForCausalLMEagle3"], DRAFT_VOCAB
    cfg.save_pretrained(tmp_path)
    kw = {**KW, "load_format": "dummy"}
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(ckpts["target"], **kw).generate(PROMPTS[:2], sp)
    spec = LLM(ckpts["target"], speculative_algorithm="EAGLE3",
               speculative_draft_model_path=str(tmp_path / "config.json"), **kw)
    got = spec.generate(PROMPTS[:2], sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.scheduler.stats["spec_proposed_tokens"] > 0


def test_bench_speculative_runs_a_draft_model(ckpts, tmp_path):
    """bench.bench_speculative with STANDALONE (the target as its own draft): one row, the
    greedy outputs identical (float32: the bench stops otherwise), drafts accepted."""
    import json

    from bench.bench_speculative import main

    out = tmp_path / "rows.jsonl"
    main(["--model-path", ckpts["target"], "--algorithm", "STANDALONE", "--draft-model-path",
          ckpts["target"], "--num-steps", "3", "--batch-sizes", "1", "--workloads", "copy",
          "--max-tokens", "8", "--result-jsonl", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["identical_outputs"] == rows[0]["requests"] == 3
    assert rows[0]["num_draft_tokens"] == 3 and rows[0]["mean_accept_length"] > 2
    # the round's phases: the draft model's forwards and the verify forward both cost time
    r = rows[0]
    assert r["verify_steps"] > 0 and r["draft_ms"] > 0 and r["verify_ms"] > 0
    assert r["round_cost_in_plain_steps"] == pytest.approx(
        (r["draft_ms"] + r["verify_ms"]) / r["plain_step_ms"])


def save_knowing_pair(root) -> tuple[str, str]:
    """A target whose attention and MLP outputs are zero, so it predicts from the current
    token alone (its logits are lm_head(norm(embed(t))), norms of weight 1), and an EAGLE
    head that passes embed(token j + 1) through (fc = [I | 0.1 I], zero o_proj and
    down_proj), so it predicts the target's next token but for the target state mixed in.
    Returns the two directories."""
    from moe_helpers import save_random
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(_llama_config(2)).eval()
    save_random(hf, root / "t", seed=4, scale=0.3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
    hf.save_pretrained(root / "t")
    w = _head_tensors(False, seed=6)
    eye = torch.eye(H)
    w["fc.weight"] = torch.cat([eye, 0.1 * eye], dim=1)
    w["fc.bias"] = torch.zeros(H)
    w["layers.0.self_attn.o_proj.weight"].zero_()
    w["layers.0.mlp.down_proj.weight"].zero_()
    head = root / "head"
    _llama_config(1).save_pretrained(head)
    save_file({k: v.contiguous() for k, v in w.items()}, f"{head}/model.safetensors")
    return str(root / "t"), str(head)


def test_eagle_head_that_knows_the_target_gets_drafts_accepted(tmp_path):
    """The pair of ``save_knowing_pair``: verify steps see none, some and all drafts
    accepted (all of them with 0 instead of 0.1), and the greedy output is the target's."""
    from engine import LLM

    target, head = save_knowing_pair(tmp_path)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(target, **KW).generate(PROMPTS, sp)]
    llm = LLM(target, speculative_algorithm="EAGLE", speculative_draft_model_path=head,
              speculative_num_steps=3, **KW)
    llm.scheduler.check_kv = True
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == want
    st = llm.scheduler.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"], st
    lengths = st["spec_accept_lengths"]
    assert lengths[0] and lengths[3] and (lengths[1] or lengths[2])  # none, all, some
    _check_released(llm)


def test_standalone_draft_with_a_shorter_context(ckpts, baseline, tmp_path):
    """A draft model of 32 positions: requests past them stop drafting, nothing breaks."""
    from moe_helpers import save_random
    from transformers import LlamaForCausalLM

    from engine import LLM

    cfg = _llama_config(1)
    cfg.max_position_embeddings = 32
    torch.manual_seed(0)
    save_random(LlamaForCausalLM(cfg).eval(), tmp_path, seed=12, scale=0.3)
    llm = LLM(ckpts["target"], speculative_algorithm="STANDALONE",
              speculative_draft_model_path=str(tmp_path), speculative_num_steps=3, **KW)
    assert llm.scheduler.spec.proposer.runner.max_context_len == 32
    assert _run(llm) == baseline
    assert llm.scheduler.stats["spec_proposed_tokens"] > 0
    _check_released(llm)


def test_a_failing_draft_forward_costs_drafts_not_the_engine(ckpts, baseline, monkeypatch):
    from engine import LLM

    llm = LLM(ckpts["target"], speculative_algorithm="STANDALONE",
              speculative_draft_model_path=ckpts["draft"], speculative_num_steps=2, **KW)
    prop = llm.scheduler.spec.proposer
    calls = []

    def broken(batch, seqs, hidden):
        calls.append(len(seqs))
        raise RuntimeError("device error")

    monkeypatch.setattr(prop, "forward", broken)
    assert _run(llm) == baseline
    assert calls and llm.scheduler.stats["spec_proposed_tokens"] == 0
    _check_released(llm)


def test_draft_pool_makes_room_by_dropping_idle_requests(ckpts):
    """The draft pool holds --speculative-max-batch-size requests of the whole context; a
    request outside the step being drafted loses its draft state when room is short. The
    drafts are the draft model's own greedy continuation (HF transformers)."""
    from transformers import LlamaForCausalLM

    from engine import LLM
    from engine.scheduler.request import Req

    llm = LLM(ckpts["target"], speculative_algorithm="STANDALONE",
              speculative_draft_model_path=ckpts["draft"], speculative_num_steps=2,
              speculative_max_batch_size=1, context_length=64, **KW)
    prop = llm.scheduler.spec.proposer
    assert prop.kv.pool.capacity_tokens == 64 + 2 + 1
    hf = LlamaForCausalLM.from_pretrained(ckpts["draft"]).eval()
    reqs = []
    for i, start in enumerate((3, 60)):
        r = Req(f"r{i}", list(range(start, start + 50)), SamplingParams(max_tokens=4))
        r.req_pool_idx = i  # as if admitted (a released request has None)
        reqs.append(r)
        got = prop.propose_reqs([r], [2])[0]
        with torch.no_grad():
            want = hf.generate(torch.tensor([r.origin_input_ids]), max_new_tokens=2,
                               do_sample=False)[0, 50:].tolist()
        assert got == want
        assert list(prop.seqs) == [r.rid]  # the other one made room
        prop.check()
