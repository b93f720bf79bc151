"""The HTTP request models carry every ``SamplingParams`` field under its own name, so adding
a sampling parameter touches only engine/sampling/ (docs/architecture.md's recipe)."""

import msgspec
import pytest
from pydantic import ValidationError, create_model

from engine.sampling.params import SamplingParams
from server.openai.protocol import (
    ENGINE_DERIVED,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    engine_sampling_fields,
)


class _Grown(SamplingParams, kw_only=True, omit_defaults=True):
    """SamplingParams with a parameter the request models do not declare."""

    typical_p: float = 1.0
    bad_words: list[str] = []


def test_a_new_engine_field_becomes_a_strict_request_field():
    extra = engine_sampling_fields(_Grown, _SamplingFields.model_fields)
    base = engine_sampling_fields(SamplingParams, _SamplingFields.model_fields)
    assert set(extra) - set(base) == {"typical_p", "bad_words"}
    model = create_model("Grown", __base__=_SamplingFields, **extra)
    r = model.model_validate({"typical_p": 0.5, "bad_words": ["x"]})
    assert r.typical_p == 0.5 and r.bad_words == ["x"]
    assert model.model_validate({}).bad_words == [] and model().bad_words is not \
        model().bad_words  # a fresh default each time
    with pytest.raises(ValidationError):
        model.model_validate({"typical_p": "0.5"})  # strict: no str -> float


@pytest.mark.parametrize("cls,body", [
    (CompletionRequest, {"prompt": "hi"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_every_sampling_field_reaches_the_engine(cls, body):
    values = {"min_tokens": 3, "temperature": 0.3, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
              "seed": 11, "stop": ["a", "b"], "stop_token_ids": [5], "ignore_eos": True,
              "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
              "logit_bias": {"9": 1.5}, "skip_special_tokens": False,
              "spaces_between_special_tokens": False, "stop_regex": [r"\d{3}"],
              # constraints (one at a time is verify's rule, not the model's)
              "json_schema": '{"type": "object"}', "regex": "[a-z]+", "ebnf": 'root ::= "a"'}
    fields = {f.name for f in msgspec.structs.fields(SamplingParams)}
    assert set(values) == fields - ENGINE_DERIVED  # this test covers every field
    sp = cls.model_validate(dict(body, **values)).sampling_params(max_tokens=4)
    got = {k: getattr(sp, k) for k in values}
    assert got == dict(values, logit_bias={9: 1.5})
    assert sp.max_tokens == 4
