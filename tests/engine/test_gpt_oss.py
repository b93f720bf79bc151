"""gpt-oss served by ferry vs HF transformers (tiny random checkpoints, float32 on the CPU).

Two checkpoints of three layers (sliding window 4, shorter than the prompts, on layers 0 and
2; sinks drawn N(0, 1); every bias, the router's included, perturbed; ``swiglu_limit`` 1 so
that the clamp bites; YaRN with factor 4): one with float experts as HF saves them, one with
MXFP4 experts (``*_blocks``/``*_scales``, quantized here; the HF reference holds the
dequantized values). Greedy tokens equal HF ``generate``'s and log-probs within 1e-3 over 12
steps, in a batch of different lengths, alone (prefix-cache miss), with the cache hit, and
across a chunked-prefill boundary; TP=2 and EP=2 vs TP=1 (gloo) on the MXFP4 checkpoint; the dummy
loader on the shipped configs' shape (small) and a harmony-style chat template through the
transformers tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from gptoss_helpers import gptoss_config, save_tiny_gptoss

from engine.layers.moe import FusedMoE
from engine.llm import LLM
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
LOGPROB_TOL = 1e-3
SP = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 13, 40)]


def _hf_generate(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]
    return toks, lps


def _assert_matches(out, ref, what: str) -> None:
    toks, lps = ref
    assert out.token_ids == toks, f"{what}: ferry {out.token_ids} != HF {toks}"
    worst = max(abs(a[0] - b) for a, b in zip(out.logprobs, lps))
    assert worst < LOGPROB_TOL, f"{what}: log-prob differs from HF by {worst:.2e}"


@pytest.fixture(scope="module", params=["float", "mxfp4", "mxfp4_dequantize"])
def served(request, tmp_path_factory):
    """float experts; MXFP4 experts kept in 4 bits; MXFP4 tensors with
    ``quantization_config.dequantize: true`` (float experts, dequantized at load)."""
    path = tmp_path_factory.mktemp(f"gptoss_{request.param}")
    hf = save_tiny_gptoss(path, mxfp4=request.param != "float")
    if request.param == "mxfp4_dequantize":
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"]["dequantize"] = True
        (path / "config.json").write_text(json.dumps(cfg))
    ref = [_hf_generate(hf, p) for p in _prompts()]
    llm = LLM(str(path), dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=4096,
              chunked_prefill_size=16)
    yield request.param, hf, llm, ref
    llm.shutdown()


def test_batch_alone_and_chunked_match_hf(served):
    """Prompts of 5, 13 and 40 tokens (the 40 crosses two 16-token prefill chunks)."""
    case, hf, llm, ref = served
    experts = [m for m in llm.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all((m.w13_weight.dtype == torch.uint8) == (case == "mxfp4")
                           for m in experts)
    prompts = _prompts()
    batch = llm.generate(prompts, SP)
    for i, (out, r) in enumerate(zip(batch, ref)):
        _assert_matches(out, r, f"{case} prompt {i} in a batch")
    for i, p in enumerate(prompts):
        assert llm.scheduler.flush_cache()
        alone = llm.generate([p], SP)[0]
        assert alone.num_cached_tokens == 0
        _assert_matches(alone, ref[i], f"{case} prompt {i} alone")


def test_prefix_cache_hit_matches_hf(served):
    case, hf, llm, ref = served
    long = _prompts()[2]
    assert llm.scheduler.flush_cache()
    assert llm.generate([long], SP)[0].num_cached_tokens == 0
    again = llm.generate([long], SP)[0]
    assert again.num_cached_tokens >= 32
    _assert_matches(again, ref[2], f"{case} cached prompt")
    shared = long[:32] + [9, 8, 7, 6, 5]
    out = llm.generate([shared], SP)[0]
    assert out.num_cached_tokens >= 24
    _assert_matches(out, _hf_generate(hf, shared), f"{case} shared prefix")


def _run_tp(path: str, tp: int, **kw):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    prompt = [(7 * i + 3) % 250 + 3 for i in range(40)]
    with LLM(path, tp_size=tp, cpu_threads=1, dtype="float32", device="cpu", seed=3,
             **kw) as llm:
        outs = llm.generate([prompt, [11, 12, 13]], sp)
    lps = [lp for o in outs for tok_lp, top in o.logprobs for lp in [tok_lp, *(v for _, v in top)]]
    return [o.token_ids for o in outs], lps


def test_tp2_and_ep2_match_tp1_mxfp4(tmp_path):
    """4 heads, 2 KV heads and I = 64 (two MXFP4 groups) split over 2 ranks: sinks by
    head, the down blocks by group, the down bias on rank 0; then expert parallelism
    (``--ep-size 2``: 4 of the 8 experts whole on each rank, its own down biases)."""
    save_tiny_gptoss(tmp_path, mxfp4=True)
    ref_toks, ref_lps = _run_tp(str(tmp_path), 1)
    for ep in (1, 2):
        toks, lps = _run_tp(str(tmp_path), 2, ep_size=ep)
        assert toks == ref_toks, f"ep {ep}"
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4, f"ep {ep}"


def test_dummy_mxfp4_weights_are_sane(tmp_path):
    """--load-format dummy on an MXFP4 config: uint8 blocks, scales a few below 127, finite
    log-probs; the expert bytes are 4.25 bits a weight (plus the biases)."""
    cfg = gptoss_config().to_dict()
    cfg.pop("attn_implementation", None)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    cfg["architectures"] = ["GptOssForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with LLM(str(tmp_path), load_format="dummy", dtype="float32", device="cpu",
             cpu_threads=1) as llm:
        m = next(m for m in llm.runner.model.modules() if isinstance(m, FusedMoE))
        assert 118 <= int(m.w13_scales.min()) and int(m.w13_scales.max()) <= 124
        weights = m.num_local_experts * 3 * m.hidden_size * m.intermediate_size
        biases = (m.w13_bias.numel() + m.w2_bias.numel()) * 4
        assert m.expert_bytes() == weights * 4.25 / 8 + biases
        out = llm.generate([[5, 6, 7, 8, 9, 10]], SP)[0]
    assert len(out.token_ids) == NEW_TOKENS
    assert all(torch.isfinite(torch.tensor(lp[0])) for lp in out.logprobs)


HARMONY = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
           "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_chat_template_through_transformers_tokenizer(tmp_path):
    """A harmony-shaped template saved with the tiny checkpoint's tokenizer renders through
    ferry's chat tokenizer (transformers' ``apply_chat_template``)."""
    from transformers import AutoTokenizer

    from server.chat_template import ChatTokenizer

    save_tiny_gptoss(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.chat_template = HARMONY
    tok.save_pretrained(tmp_path)
    chat = ChatTokenizer(SimpleNamespace(tool_call_parser="auto"))
    chat.set_tokenizer(AutoTokenizer.from_pretrained(tmp_path))
    ids = asyncio.run(chat.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert chat.tokenizer.decode(ids) == "<|start|>user<|message|>hi<|end|><|start|>assistant"
