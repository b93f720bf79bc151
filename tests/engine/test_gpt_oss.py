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
from parity_helpers import (
    NEW_TOKENS,
    SP,
    assert_batch_and_alone_match_hf,
    assert_prefix_hits_match_hf,
    hf_references,
    parity_llm,
    seeded_prompts,
)

from engine.layers.moe import FusedMoE
from engine.llm import LLM
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

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
    ref = hf_references(hf, seeded_prompts())
    with parity_llm(path, chunked_prefill_size=16) as llm:
        yield request.param, hf, llm, ref


def test_batch_alone_and_chunked_match_hf(served):
    """Prompts of 5, 13 and 40 tokens (the 40 crosses two 16-token prefill chunks)."""
    case, hf, llm, ref = served
    experts = [m for m in llm.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all((m.w13_weight.dtype == torch.uint8) == (case == "mxfp4")
                           for m in experts)
    assert_batch_and_alone_match_hf(llm, seeded_prompts(), ref, case)


def test_prefix_cache_hit_matches_hf(served):
    case, hf, llm, ref = served
    assert_prefix_hits_match_hf(llm, hf, seeded_prompts()[2], ref[2], case)


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
