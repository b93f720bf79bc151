"""Offline generation on the real model (SmolLM2-135M GGUF, fp32, CPU) against HF transformers.

The reference is HF ``generate`` (greedy, fp32, the same GGUF). ferry runs all prompts
together through its continuous-batching scheduler.
"""

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colours of the rainbow: red,",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Translate to French: 'Good morning, how are you today? I hope you slept well.'",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his daughter. Every morning they walked together to the river, where",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm(embedded_llm):
    """The session's LLM on the embedded model (tests/engine/conftest.py; 512-token chunks)."""
    return embedded_llm


@pytest.fixture(scope="module")
def hf_model(hf_embedded_model):
    """HF's fp32 model of the same GGUF, built once per session (tests/conftest.py)."""
    return hf_embedded_model


@pytest.fixture(scope="module")
def hf_reference(llm, hf_model):
    """HF greedy token ids for each prompt, one prompt at a time (no padding effects).

    ferry's batch output serves as a draft that HF checks in one forward pass of prompt +
    draft (HF's argmax after each prefix), as speculative decoding does: the longest
    prefix HF agrees with is kept, HF's own token replaces the first one it does not, and HF
    ``generate`` makes the rest. The result is HF's greedy output whatever the draft; when
    the draft is right it costs one forward instead of NEW_TOKENS decode steps (~2 s a
    prompt on the CPU)."""
    from engine import SamplingParams

    drafts = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                  ignore_eos=True))
    return [_hf_greedy(hf_model, llm.tokenizer(p).input_ids, d.token_ids)
            for p, d in zip(PROMPTS, drafts)]


def _hf_greedy(model, ids: list[int], draft: list[int]) -> list[int]:
    """HF's NEW_TOKENS greedy tokens after the prompt ``ids``, ``draft`` checked first."""
    draft = list(draft[:NEW_TOKENS])
    with torch.no_grad():
        best = model(torch.tensor([ids + draft])).logits[0, len(ids) - 1:].argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    out = draft[:n] + [best[n]] if n < NEW_TOKENS else draft
    if len(out) < NEW_TOKENS:
        prefix = torch.tensor([ids + out])
        with torch.no_grad():
            g = model.generate(prefix, max_new_tokens=NEW_TOKENS - len(out), do_sample=False,
                               eos_token_id=None, pad_token_id=0,
                               attention_mask=torch.ones_like(prefix))
        out += g[0, prefix.shape[1]:].tolist()
    return out


def test_the_model_runner_has_what_step_runner_names(llm):
    """The scheduler and SpecWorker read a runner only through ``StepRunner``: the real
    runner has each of its members as a plain attribute or method."""
    from engine.executor.step_runner import StepRunner
    from engine.layers.quantization.wq import CPU_KERNEL_MAX_M

    members = set(StepRunner.__annotations__) | {
        n for n, v in vars(StepRunner).items() if callable(v) and not n.startswith("_")}
    assert [n for n in sorted(members) if not hasattr(llm.runner, n)] == []
    assert llm.runner.tp_size == 1 and llm.runner.max_verify_rows == CPU_KERNEL_MAX_M


def test_greedy_batch_matches_hf(llm, hf_reference):
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    for p, o, ref in zip(PROMPTS, outs, hf_reference):
        assert o.token_ids == ref, f"prompt {p!r}: ferry {o.token_ids} != HF {ref}"
        assert o.finish_reason == "length"
        assert o.text == llm.tokenizer.decode(ref, skip_special_tokens=True)


def test_alone_equals_batch_and_chunked_prefill(llm, hf_reference):
    """Each prompt alone, and with a tiny chunk size, gives the batch's tokens."""
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i in (0, 7):
        alone = llm.generate([PROMPTS[i]], sp)[0]
        assert alone.token_ids == hf_reference[i]
    old = llm.scheduler.chunk_size
    llm.scheduler.chunk_size = 7  # long prompts prefill in many chunks, mixed with decodes
    try:
        outs = llm.generate(PROMPTS, sp)
    finally:
        llm.scheduler.chunk_size = old
    assert [o.token_ids for o in outs] == hf_reference


def test_preemption_under_a_full_pool_keeps_outputs():
    """A pool too small for all requests at once: requests wait and get preempted, and every
    output still equals HF's."""
    from engine import LLM, SamplingParams

    small = LLM(model_path=None, device="cpu", max_total_tokens=160, page_size=4,
                chunked_prefill_size=64)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:6]
    full = small.generate(prompts, sp)
    assert small.scheduler.stats["preemptions"] > 0 or small.runner.kv_pool.capacity_tokens >= sum(
        len(o.prompt_token_ids) + 24 for o in full)
    # a preempted request recomputes its prompt, which the prompt_tokens stat counts once
    assert small.scheduler.stats["prompt_tokens"] <= sum(len(o.prompt_token_ids) for o in full)
    for p, o in zip(prompts, full):
        alone = small.generate([p], sp)[0]
        assert o.token_ids == alone.token_ids
    assert small.scheduler.kv.used_tokens() == 0


def test_stop_and_eos(llm, hf_reference):
    from engine import SamplingParams

    ref = hf_reference[1]
    ref_text = llm.tokenizer.decode(ref, skip_special_tokens=True)
    stop = ref_text.strip().split()[1] if len(ref_text.split()) > 1 else ref_text[-3:]
    o = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                   stop=[stop]))[0]
    assert o.finish_reason == "stop" and o.matched_stop == stop
    assert o.text == ref_text[: ref_text.find(stop)]
    # the model's EOS (<|im_end|>) ends a chat answer with finish_reason stop
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                             add_generation_prompt=True, tokenize=False)
    o = llm.generate([chat], SamplingParams(max_tokens=200, temperature=0))[0]
    assert o.finish_reason == "stop" and o.matched_stop in llm.scheduler.eos_ids
    assert llm.scheduler.kv.used_tokens() == 0


def test_logprobs_and_prompt_logprobs_match_hf(llm, hf_model):
    """Generated-token and prompt-token logprobs (log-softmax of the raw logits) vs HF."""
    from engine import SamplingParams

    prompt = PROMPTS[6]
    ids = llm.tokenizer(prompt).input_ids
    old = llm.scheduler.chunk_size
    llm.scheduler.chunk_size = 8  # the prompt's logprobs arrive over several chunks
    try:
        o = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=3,
                                                   prompt_logprobs=2, ignore_eos=True))[0]
    finally:
        llm.scheduler.chunk_size = old
    full = torch.tensor([ids + o.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(full).logits[0].double(), dim=-1)
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
    for j in range(1, len(ids)):
        lp, top, rank = o.prompt_logprobs[j]
        assert abs(lp - ref[j - 1, ids[j]].item()) < 1e-3
        # the prompt token's rank in the whole vocabulary (fp32 vs HF's fp64: ties at 1e-4)
        row = ref[j - 1]
        assert int((row > lp + 1e-4).sum()) + 1 <= rank <= int((row > lp - 1e-4).sum()) + 1
        ref_top = torch.topk(ref[j - 1], 2)
        assert [t[0] for t in top] == ref_top.indices.tolist()
    assert len(o.logprobs) == len(o.token_ids) == 5
    for k, (lp, top) in enumerate(o.logprobs):
        row = ref[len(ids) - 1 + k]
        assert abs(lp - row[o.token_ids[k]].item()) < 1e-3
        assert top[0][0] == o.token_ids[k]  # greedy: the chosen token is the top one
        assert len(top) == 3 and abs(top[1][1] - torch.topk(row, 3).values[1].item()) < 1e-3


def test_penalties_with_overlap_match_without(llm):
    """Penalties need the real generated ids: with overlap on, the in-flight step is read back
    after the next forward is launched and before it is sampled; the tokens must equal the
    non-overlapped run's (the CPU runs without overlap, so its code path is forced)."""
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=0.8,
                        presence_penalty=0.5, repetition_penalty=1.3)
    outs = {}
    for overlap in (False, True):
        llm.scheduler.overlap = overlap
        try:
            outs[overlap] = [o.token_ids for o in llm.generate(PROMPTS[:3], sp)]
        finally:
            llm.scheduler.overlap = False
    assert outs[True] == outs[False]
    assert llm.scheduler.kv.used_tokens() == 0
