"""Grammar-constrained decoding on the real model (SmolLM2-135M, CPU): every output parses
and validates (``jsonschema``, ``re.fullmatch``, a hand-written check of the EBNF), greedy
and seeded, alone and batched with free requests (which must not change), with overlap
scheduling forced on, logprobs, stop strings and the grammar queue."""

import json
import re

import jsonschema
import pytest

from bench.grammar.grammar_cases import EBNF, REGEX, SCHEMAS
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Describe a person, their colours and mood as JSON."
FREE = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(embedded_llm):
    """The session's LLM on the embedded model (tests/engine/conftest.py)."""
    return embedded_llm


def _chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)


def _check_json(name: str, out) -> None:
    assert out.finish_reason == "stop", (name, out.text)
    jsonschema.validate(json.loads(out.text), SCHEMAS[name])


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7), (1.0, 12345)])
def test_json_schemas_regex_and_ebnf_validate(llm, temperature, seed):
    sps = [SamplingParams(max_tokens=120, temperature=temperature, seed=seed,
                          json_schema=json.dumps(s)) for s in SCHEMAS.values()]
    sps.append(SamplingParams(max_tokens=40, temperature=temperature, seed=seed, regex=REGEX))
    sps.append(SamplingParams(max_tokens=40, temperature=temperature, seed=seed, ebnf=EBNF))
    prompts = [_chat(llm, PROMPT)] * len(SCHEMAS) + [_chat(llm, "A phone number?"),
                                                     _chat(llm, "Is water wet?")]
    outs = llm.generate(prompts, sps)
    for name, out in zip(SCHEMAS, outs):
        _check_json(name, out)
    assert re.fullmatch(REGEX, outs[-2].text), outs[-2].text
    assert outs[-2].finish_reason == "stop"
    assert outs[-1].text in ("The answer is yes.", "The answer is no."), outs[-1].text


def test_free_requests_are_unaffected_and_overlap_works(llm):
    free = [SamplingParams(max_tokens=24, temperature=0.0),
            SamplingParams(max_tokens=24, temperature=1.0, seed=3)]
    alone = llm.generate(FREE, free)
    con = SamplingParams(max_tokens=120, temperature=1.0, seed=5,
                         json_schema=json.dumps(SCHEMAS["nested"]))
    for overlap in (False, True):
        llm.scheduler.overlap = overlap  # the CPU runs without overlap; force its code path
        try:
            mixed = llm.generate([_chat(llm, PROMPT), FREE[0], _chat(llm, PROMPT), FREE[1]],
                                 [con, free[0], SamplingParams(**{**_fields(con), "seed": 6}),
                                  free[1]])
        finally:
            llm.scheduler.overlap = False
        assert [mixed[1].token_ids, mixed[3].token_ids] == [a.token_ids for a in alone]
        _check_json("nested", mixed[0])
        _check_json("nested", mixed[2])


def _fields(sp: SamplingParams) -> dict:
    import msgspec

    return msgspec.structs.asdict(sp)


def test_seeded_constrained_output_is_reproducible_with_logprobs(llm):
    sp = SamplingParams(max_tokens=60, temperature=1.0, seed=99, logprobs=2,
                        json_schema=json.dumps(SCHEMAS["enum_bounds"]))
    a, b = llm.generate([_chat(llm, PROMPT)] * 2, [sp, sp])
    assert a.token_ids == b.token_ids
    _check_json("enum_bounds", a)
    assert len(a.logprobs) == len(a.token_ids)
    assert all(lp <= 0.0 and len(top) == 2 for lp, top in a.logprobs)


def test_stop_string_ends_a_constrained_request(llm):
    out = llm.generate(_chat(llm, "A phone number?"),
                       SamplingParams(max_tokens=40, temperature=0.0, regex=REGEX, stop=["-"]))[0]
    assert out.finish_reason == "stop" and out.matched_stop == "-"
    assert re.fullmatch(r"\d{3}", out.text), out.text


def test_a_bad_grammar_aborts_only_its_request(llm):
    outs = llm.generate([FREE[0], FREE[0]], [
        SamplingParams(max_tokens=4, temperature=0.0, regex="(["),
        SamplingParams(max_tokens=4, temperature=0.0)])
    assert outs[0].finish_reason == "abort" and outs[1].finish_reason == "length"
    assert not llm.scheduler.grammars.pending and not llm.scheduler.reqs
