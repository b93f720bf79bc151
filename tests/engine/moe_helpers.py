"""Tiny random MoE checkpoints for the tests: HF models of Qwen3-MoE, Qwen2-MoE, Mixtral and
OLMoE built from small configs (E=8 experts, top-2, hidden 64), saved with
``save_pretrained`` (the Hub's per-expert safetensors layout) beside a character-level
tokenizer with a chat template (so a server can answer chat completions)."""

from __future__ import annotations

import string

import torch

COMMON = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512, "num_hidden_layers": 2,
          "attn_implementation": "eager", "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0, "tie_word_embeddings": False}
MOE = {"num_experts": 8, "num_experts_per_tok": 2}


def config_of(case: str):
    import transformers as T

    if case == "qwen3_moe":        # per-head q/k norm, head_dim 32 != 64 / 4, renormalised
        return T.Qwen3MoeConfig(**COMMON, **MOE, intermediate_size=96, head_dim=32,
                                moe_intermediate_size=32, norm_topk_prob=True)
    if case == "qwen3_moe_dense":  # layer 1 of 3 dense; top-k weights not renormalised
        return T.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, **MOE,
                                intermediate_size=96, moe_intermediate_size=32,
                                mlp_only_layers=[1], norm_topk_prob=False)
    if case == "qwen2_moe":        # q/k/v bias, gated shared expert, norm_topk_prob False
        return T.Qwen2MoeConfig(**COMMON, **MOE, intermediate_size=96,
                                moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if case == "qwen2_moe_step2":  # decoder_sparse_step 2: layers 0 and 2 dense, 1 and 3 MoE
        return T.Qwen2MoeConfig(**{**COMMON, "num_hidden_layers": 4,
                                   "tie_word_embeddings": True}, **MOE,
                                intermediate_size=96, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, decoder_sparse_step=2,
                                norm_topk_prob=True)
    if case == "mixtral":
        return T.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8,
                               num_experts_per_tok=2)
    if case == "olmoe":            # q/k norm over the whole projections
        return T.OlmoeConfig(**COMMON, **MOE, intermediate_size=32)
    raise KeyError(case)


CASES = ["qwen3_moe", "qwen3_moe_dense", "qwen2_moe", "qwen2_moe_step2", "mixtral", "olmoe"]


def save_tiny(case: str, path) -> torch.nn.Module:
    """Build, randomise (seeded) and save the HF model of ``case``; returns it (eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config_of(case), dtype=torch.float32).eval()
    return save_random(hf, path)


def save_random(hf, path, seed: int = 99, scale: float = 0.1) -> torch.nn.Module:
    """Draw ``hf``'s weights (seeded: norms 1 + 0.1 N(0, 1), the rest ``scale`` N(0, 1)),
    save it with the character tokenizer beside it; returns it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)
    hf.save_pretrained(path)
    save_char_tokenizer(path)
    return hf


def save_char_tokenizer(path) -> None:
    """A 256-token character-level tokenizer (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2) with a
    plain chat template, saved to ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in string.printable + "".join(chr(i) for i in range(0xA1, 0x180)):
        if len(vocab) < 256 and c not in "\x0b\x0c":
            vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(path)
