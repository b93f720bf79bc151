"""The scheduler's admission holds as many sequences as the KV pools allow, with one pool for
every layer and with the windowed pool (engine/kv/windowed.py), counted by
``bench/bench_capacity.py`` (the GPU stage ``gemma-capacity`` runs it on Gemma-3-27B).

A tiny Gemma 3 (dummy fp32 weights on the CPU: six layers, layers 2 and 5 global, windows
of 8 tokens) runs requests of L prompt tokens and M output tokens. The expected count is
worked out by hand from the pool sizes:

- full-attention pool of F tokens (page size 1): the N-th request is admitted whenever
  N (L + M) + (N - 1) <= F (each running request holds at most L + M with what admission
  keeps for its output, plus one token of decode reserve), and the (N + 1)-th never is
  when (N + 1) L > F (its prompt does not fit); the sizes below make both bounds meet;
- windowed pool of S slots: a decoding request keeps W + 1 of them (its window and the
  token being written), and a prompt prefilled in one chunk of L >= W tokens needs L
  slots while it is prefilled: the pool holds 1 + (S - L - 1) // (W + 1) such requests
  (one page of slack for the newcomer).
"""

import json

import pytest

#: Gemma 3 text, tiny: the tests' gemma_helpers shape with a longer context
TINY_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "max_position_embeddings": 4096, "sliding_window": 8,
               "query_pre_attn_scalar": 24, "num_hidden_layers": 6,
               "sliding_window_pattern": 3, "rope_local_base_freq": 100.0,
               "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
W = 8
L, M = 320, 24  # prompt and output tokens of each request


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-tiny")
    (path / "config.json").write_text(json.dumps(TINY_GEMMA3))
    return str(path)


def _llm(path, chunk: int = 1024, **kw):
    from engine.llm import LLM

    llm = LLM(path, load_format="dummy", device="cpu", dtype="float32", cpu_threads=1,
              chunked_prefill_size=chunk, **kw)
    llm.scheduler.check_kv = True  # both pools' page accounting after every step
    return llm


def _full_pool_count(f: int) -> int:
    """Sequences of L + M the full-attention pool of ``f`` tokens holds (see the module
    doc); asserts the two bounds meet."""
    n = (f + 1) // (L + M + 1)
    assert (n + 1) * L > f, "the sizes leave the count open: pick another pool size"
    return n


@pytest.mark.parametrize("ratio,total", [(0, 4150), (0.5, 2767)])
def test_admission_fills_the_full_attention_pool(tiny_gemma3, ratio, total):
    """One pool of 4,150 tokens, and a windowed split whose full-attention layers get the
    same 4,150 (the windowed pool is ample): 12 requests of 320 + 24 each way."""
    from bench.bench_capacity import run_capacity

    llm = _llm(tiny_gemma3, swa_full_tokens_ratio=ratio, max_total_tokens=total)
    f = llm.runner.max_total_tokens
    assert f == 4150 and (llm.runner.swa_pool is not None) == (ratio > 0)
    res = run_capacity(llm, 16, L, M, decode_steps=3)
    assert _full_pool_count(f) == 12
    assert res["peak_running"] == 12 and res["waiting"] == 4
    assert res["finished_early"] == res["preemptions"] == res["admitting_steps"] == 0
    assert res["min_running"] == res["max_running"] == 12 and res["decode_steps"] == 3
    assert res["decode_tok_s"] > 0 and res["kv_tokens"] == f
    # every request aborted, every page back (the check ran after each step)
    assert llm.scheduler.kv.used_tokens() == 0 and not llm.scheduler.has_work()
    llm.shutdown()


def test_admission_fills_the_windowed_pool(tiny_gemma3):
    """A windowed pool of 449 slots beside a full-attention pool of 7,500 tokens: the
    windowed one bounds the count (15 requests of 320 + 64), and admission reaches what it
    holds. (It used to keep a window beside a last chunk and the full pool's decode
    reserve in the windowed pool as well: 13 here.) One prompt per step (chunks of L): a
    newcomer holds its L slots until its first decode gives back what lies behind its
    window, so requests join every other step."""
    from bench.bench_capacity import run_capacity

    llm = _llm(tiny_gemma3, chunk=L, swa_full_tokens_ratio=0.06, max_total_tokens=2800)
    s, f = llm.runner.swa_total_tokens, llm.runner.max_total_tokens
    assert llm.runner.swa_pool.window == W and (s, f) == (449, 7500)
    want = 1 + (s - L - 1) // (W + 1)
    assert want == 15 and want * (L + 64 + 1) <= f  # the full pool is not the bound
    res = run_capacity(llm, want + 4, L, 64, decode_steps=3)
    assert res["peak_running"] == want and res["waiting"] == 4
    assert res["finished_early"] == res["preemptions"] == 0
    llm.shutdown()


def test_bench_capacity_command_line(tiny_gemma3, tmp_path, capsys):
    """``python -m bench.bench_capacity`` as the GPU stage runs it (its flags, the printed
    lines, the JSON line), on the tiny model."""
    from bench.bench_capacity import main

    out = tmp_path / "capacity.jsonl"
    main(["--model-path", tiny_gemma3, "--load-format", "dummy", "--device", "cpu",
          "--dtype", "float32", "--cpu-threads", "1", "--max-total-tokens", "2767",
          "--swa-full-tokens-ratio", "0.5", "--chunked-prefill-size", "1024",
          "--num-prompts", "14", "--input-len", str(L), "--output-len", str(M),
          "--decode-steps", "2", "--result-jsonl", str(out)])
    res = json.loads(out.read_text())
    assert (res["peak_running"], res["waiting"], res["decode_steps"]) == (12, 2, 2)
    assert res["swa_kv_tokens"] > 0 and res["swa_full_tokens_ratio"] == 0.5
    text = capsys.readouterr().out
    assert "12 running, 2 waiting" in text and "bound by the pools" in text
