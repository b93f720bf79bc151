"""Pooling models through the offline ``LLM`` against HF transformers on the same random
weights (fp32, CPU): embeddings (last-token, mean and CLS pooling, read from a
sentence-transformers ``modules.json``), a ``Qwen3ForSequenceClassification`` cross-encoder
and a Qwen3-Reranker-style yes/no reranker; batched equals alone, token ids equal text,
chunked prefill and the radix cache change nothing, and each engine refuses the other kind
of request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pooling_helpers import (  # noqa: E402
    save_cross_encoder,
    save_embedder,
    save_yes_no_reranker,
    write_sentence_transformers,
)

from engine.llm import LLM  # noqa: E402
from engine.tokenizer.score_prompts import yes_no_prompt  # noqa: E402
from engine.validation import RequestError  # noqa: E402

TEXTS = ["Hello, embeddings!", "a", "The quick brown fox jumps over the lazy dog. " * 3,
         "ferry pools the last token"]
ARGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embed")
    hf = save_embedder(path)
    return path, hf


def _hf_pool(hf, tok, text: str, pooling: str, normalize: bool) -> torch.Tensor:
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        h = hf(input_ids=ids).last_hidden_state[0]
    x = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    return torch.nn.functional.normalize(x, dim=-1) if normalize else x


def _cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item()


def test_last_token_embeddings_match_hf_batched_alone_and_token_ids(embedder):
    path, hf = embedder
    llm = LLM(str(path), **ARGS)
    assert llm.runner.pooling.task == "embed" and llm.runner.pooling.pooling == "last"
    steps = llm.scheduler.stats["steps"]
    batched = llm.embed(TEXTS)
    assert llm.scheduler.stats["steps"] == steps + 1  # one prefill step, no decode step
    for text, vec in zip(TEXTS, batched):
        ref = _hf_pool(hf, llm.tokenizer, text, "last", True)
        assert len(vec) == 64 and _cos(vec, ref) >= 0.9999
        assert abs(torch.tensor(vec).norm().item() - 1.0) < 1e-5
        alone = llm.embed(text)[0]
        assert torch.allclose(torch.tensor(alone), torch.tensor(vec), atol=1e-5)
        by_ids = llm.embed([llm.tokenizer.encode(text)])[0]
        assert torch.allclose(torch.tensor(by_ids), torch.tensor(vec), atol=1e-5)
    # the radix cache serves the repeated prompts above (last-token pooling keeps it on)
    assert llm.scheduler.kv.enabled and llm.scheduler.stats["prefix_cache_hits"] > 0
    with pytest.raises(RequestError, match="does not generate"):
        llm.generate("hi")
    with pytest.raises(RequestError, match="no scoring model"):
        llm.score("q", "d")


@pytest.mark.parametrize("pooling,normalize", [("mean", False), ("cls", True)])
def test_mean_and_cls_pooling_in_chunks(embedder, tmp_path, pooling, normalize):
    import shutil

    path, hf = embedder
    copy = tmp_path / "st"
    shutil.copytree(path, copy)
    write_sentence_transformers(copy, pooling, normalize)
    llm = LLM(str(copy), **ARGS, chunked_prefill_size=16)  # the long text takes 9 chunks
    assert llm.runner.pooling.pooling == pooling and not llm.scheduler.kv.enabled
    for text, vec in zip(TEXTS, llm.embed(TEXTS)):
        ref = _hf_pool(hf, llm.tokenizer, text, pooling, normalize)
        assert _cos(vec, ref) >= 0.9999
        assert torch.allclose(torch.tensor(vec), ref, atol=1e-4, rtol=1e-4)


PAIRS = [("what is ferry?", "an inference server"), ("what is ferry?", "a boat"),
         ("capital of France", "Paris is the capital of France.")]


def test_cross_encoder_scores_are_sigmoid_of_hf_logits(tmp_path):
    hf = save_cross_encoder(tmp_path)
    llm = LLM(str(tmp_path), **ARGS)
    assert llm.runner.pooling.task == "classify"
    got = llm.score(PAIRS[0][0], [d for _, d in PAIRS[:2]])
    got += llm.score([PAIRS[2][0]], [PAIRS[2][1]])
    for (q, d), score in zip(PAIRS, got):
        ids = torch.tensor([llm.tokenizer(q, d)["input_ids"]])
        with torch.no_grad():
            logit = hf(input_ids=ids).logits[0, 0]
        assert score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    with pytest.raises(RequestError, match="no embedding model"):
        llm.embed("x")


def test_yes_no_reranker_is_p_yes_of_hf_logits(tmp_path):
    hf = save_yes_no_reranker(tmp_path)
    llm = LLM(str(tmp_path), **ARGS, yes_no_reranker=True)
    no, yes = llm.runner.pooling.yes_no_ids
    assert llm.tokenizer.convert_tokens_to_ids(["no", "yes"]) == [no, yes]
    got = llm.score(PAIRS[0][0], [d for _, d in PAIRS[:2]], instruction="Find the answer")
    again = llm.score(PAIRS[0][0], [d for _, d in PAIRS[:2]], instruction="Find the answer")
    assert again == pytest.approx(got, abs=1e-6)  # the second pass hits the radix cache
    assert llm.scheduler.stats["prefix_cache_hits"] > 0
    for (q, d), score in zip(PAIRS, got):
        text = yes_no_prompt(q, d, "Find the answer")
        ids = torch.tensor([llm.tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            last = hf(input_ids=ids).logits[0, -1]
        p_yes = torch.exp(last[yes]) / (torch.exp(last[yes]) + torch.exp(last[no]))
        assert score == pytest.approx(p_yes.item(), abs=1e-5)


def test_a_generation_engine_refuses_pooling(tmp_path):
    save_yes_no_reranker(tmp_path)
    llm = LLM(str(tmp_path), **ARGS)  # no flag: a causal LM generates
    assert llm.runner.pooling is None
    with pytest.raises(RequestError, match="no embedding model"):
        llm.embed("x")
    assert len(llm.generate("hi")[0].token_ids) >= 1
