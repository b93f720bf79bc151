"""Images together with the other features on the tiny random Qwen2.5-VL checkpoint
(``vl_helpers``; float32, CPU, the offline ``LLM``): a JSON-schema constraint (the
``response_format`` one, and the schemas the server builds for ``tool_choice`` "required"
and a named function, ``server/tools/plan.py``) gives output that parses and validates while
the image still reaches the model; NGRAM speculative decoding gives the greedy tokens of a
plain run (its verify step at the images' M-RoPE positions, ``VerifyReq.mm``), as a decode
and as an extend verify; stop strings end the text; ``n`` requests with one image agree; a
peft LoRA adapter on the language layers answers an image prompt as peft does.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("PIL")
jsonschema = pytest.importorskip("jsonschema")

from parity_helpers import parity_llm  # noqa: E402
from vl_helpers import IMAGE_TOKEN_ID, image_processor, images, save_tiny  # noqa: E402

from engine.sampling.params import SamplingParams  # noqa: E402
from server.media.process import ImageProcessor  # noqa: E402
from server.tools.plan import calls_schema, params_schema  # noqa: E402

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "colour": {"enum": ["red", "blue", "green"]}, "sure": {"type": "boolean"}},
    "required": ["colour", "sure"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "paint", "parameters": {
    "type": "object", "properties": {"shade": {"enum": ["dark", "light"]},
                                     "glossy": {"type": "boolean"}},
    "required": ["shade", "glossy"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """The checkpoint's path and per image name ``(ids, images)`` of one chat prompt."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("qwen2_5_vl_features")
    save_tiny(path)
    tok = AutoTokenizer.from_pretrained(path)
    content = [{"type": "text", "text": "What is this? "}, {"type": "image"},
               {"type": "text", "text": " Say."}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    proc = ImageProcessor(image_processor(), IMAGE_TOKEN_ID)
    return str(path), {k: proc.process(ids, [v]) for k, v in images().items()}


@pytest.fixture(scope="module")
def llm(prompts):
    with parity_llm(prompts[0], max_total_tokens=2048) as engine:
        yield engine


def _gen(llm, case, **kw):
    return llm.generate([case[0]], SamplingParams(temperature=0, **kw), images=[case[1]])[0]


@pytest.mark.parametrize("schema", [SCHEMA, calls_schema([TOOL], False),
                                    params_schema(TOOL)],
                         ids=["response_format", "tool_choice_required", "named_function"])
def test_json_schema_with_an_image(prompts, llm, schema):
    outs = {}
    for name in ("red", "blue"):
        out = _gen(llm, prompts[1][name], max_tokens=80, json_schema=json.dumps(schema),
                   logprobs=0)
        jsonschema.validate(json.loads(out.text), schema)
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == prompts[1][name][1][0].length
        outs[name] = out
    if "items" in schema:  # tool_choice "required": one call of the function
        call = json.loads(outs["red"].text)[0]
        assert call["name"] == "paint"
        jsonschema.validate(call["parameters"], params_schema(TOOL))
    # the image reaches the model: the same constrained tokens are scored differently
    red, blue = ([lp for lp, _ in outs[k].logprobs] for k in ("red", "blue"))
    assert red != blue


def test_images_change_free_text(prompts, llm):
    red, blue = (_gen(llm, prompts[1][k], max_tokens=8, ignore_eos=True)
                 for k in ("red", "blue"))
    assert red.token_ids != blue.token_ids


@pytest.mark.parametrize("verify", ["decode", "extend"])
def test_ngram_speculation_with_images_is_greedy(prompts, llm, verify, monkeypatch):
    """NGRAM verified at the images' M-RoPE positions gives the plain run's tokens, for one
    and two requests; then drafts that are the plain run's next tokens but the last (wrong)
    must be accepted up to it (rows past the first at their positions too)."""
    from engine.speculative import worker

    # a share of 0 makes every verify an extend; a large one a decode of k + 1 rows
    monkeypatch.setattr(worker, "VERIFY_AS_DECODE_KV_SHARE", 1e9 if verify == "decode" else 0)
    cases = [prompts[1][k] for k in ("gradient", "tall")]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate([c[0] for c in cases], sp,
                                               images=[c[1] for c in cases])]
    truth = {len(c[0]): p for c, p in zip(cases, plain)}

    def oracle(reqs, ks):
        out = []
        for r, k in zip(reqs, ks):
            n = len(r.output_ids)
            d = list(truth[len(r.origin_input_ids)][n:n + k])
            out.append(d[:-1] + [(d[-1] + 1) % 264] if len(d) > 1 else d)
        return out

    with parity_llm(prompts[0], max_total_tokens=2048, speculative_algorithm="NGRAM") as spec:
        for one, ref in zip(cases, plain):
            assert spec.generate([one[0]], sp, images=[one[1]])[0].token_ids == ref
        both = spec.generate([c[0] for c in cases], sp, images=[c[1] for c in cases])
        assert [o.token_ids for o in both] == plain
        spec.scheduler.spec.reset_stats()
        monkeypatch.setattr(spec.scheduler.spec.proposer, "propose_reqs", oracle)
        both = spec.generate([c[0] for c in cases], sp, images=[c[1] for c in cases])
        stats = spec.scheduler.spec.stats
    assert [o.token_ids for o in both] == plain
    assert stats["spec_accepted_tokens"] > 20, stats


def test_stop_strings_and_n_with_an_image(prompts, llm):
    case = prompts[1]["gradient"]
    free = _gen(llm, case, max_tokens=12, ignore_eos=True)
    stop = free.text[4:6]
    cut = _gen(llm, case, max_tokens=12, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.matched_stop == stop
    assert cut.text == free.text[:free.text.index(stop)]
    many = llm.generate([case[0]] * 3, SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True),
                        images=[case[1]] * 3)  # what the server's n = 3 fans out
    assert all(o.token_ids == free.token_ids for o in many)


def test_lora_with_an_image_matches_peft(prompts, tmp_path):
    """A peft adapter on the language layers (transformers 5 names them
    ``model.language_model.layers.*``) changes the answer to an image prompt as peft does;
    the base model's answer stays the base one."""
    pytest.importorskip("peft")
    import torch
    from parity_helpers import SP, assert_matches_hf, hf_greedy
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(prompts[0], dtype=torch.float32)
    pm = get_peft_model(hf.eval(), LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                                              target_modules=["q_proj", "v_proj", "o_proj"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(1.2 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    pm.eval().save_pretrained(tmp_path / "adapter")
    ids, ims = prompts[1]["red"]
    pixels = image_processor()(images=[images()["red"]], return_tensors="pt")
    kw = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
              mm_token_type_ids=(torch.tensor([ids]) == IMAGE_TOKEN_ID).int())
    ref = hf_greedy(pm, ids, **kw)
    with pm.disable_adapter():
        base = hf_greedy(pm, ids, **kw)
    assert ref[0] != base[0]
    with parity_llm(prompts[0], max_total_tokens=2048,
                    lora_paths=[f"a={tmp_path / 'adapter'}"]) as engine:
        with_lora, plain = (engine.generate([ids], SP, images=[ims], lora=lora)[0]
                            for lora in ("a", None))
        assert_matches_hf(with_lora, ref, "LoRA with an image")
        assert_matches_hf(plain, base, "base beside a LoRA")


def test_lora_on_the_vision_tower_is_refused(prompts, tmp_path):
    """``gate_proj`` names the tower's MLPs too: such an adapter is refused in one line."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    from engine.lora.adapter import LoRAError

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(prompts[0])
    get_peft_model(hf, LoraConfig(r=4, target_modules=["gate_proj"])).save_pretrained(
        tmp_path / "adapter")
    with pytest.raises(LoRAError, match="visual.*: a vision-tower adapter"):
        parity_llm(prompts[0], lora_paths=[f"a={tmp_path / 'adapter'}"])
