"""LoRA test fixtures: a tiny seeded random HF Llama saved as safetensors (with a character
tokenizer), peft adapters made on it (seeded, nonzero lora_B), and the transformers + peft
greedy reference (tokens and the chosen tokens' log-probs)."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 256
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_llama(path, seed: int = 3, layers: int = 2, hidden: int = 64):
    """A seeded random fp32 HF Llama (4 heads, 2 KV heads) saved with the char tokenizer."""
    import transformers as T
    from moe_helpers import save_char_tokenizer

    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                        max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                        pad_token_id=0, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    hf = T.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    hf.save_pretrained(path)
    save_char_tokenizer(path)
    return hf


def save_adapter(base_path, path, seed: int, r: int, targets: list[str], alpha: float = 16,
                 rslora: bool = False, scale: float = 0.3):
    """A peft LoRA adapter on ``base_path`` with seeded random A and B (B nonzero, so the
    greedy answer changes); returns the peft model (eval) for the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                     init_lora_weights=False, lora_dropout=0.0)
    pm = get_peft_model(base, cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * 4)
    pm.save_pretrained(path)
    return pm


def edit_config(path, **changes) -> None:
    """Rewrite fields of an adapter's adapter_config.json."""
    f = os.path.join(path, "adapter_config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(f, "w") as fh:
        json.dump(cfg, fh)


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens of an HF (or peft) model and each one's log-prob (fp32)."""
    ids = list(prompt)
    toks, lps = [], []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
        ids.append(t)
    return toks, lps


def save_base_and_two_adapters(root) -> dict:
    """The tiny Llama saved under ``root/base`` with two seeded peft adapters: ``a1`` (rank
    8, every projection) and ``a2`` (rank 16, q/v/down, rsLoRA); returns the models
    ``{"base" | "a1" | "a2": model}`` (transformers + peft, eval) for the references."""
    hf = save_llama(root / "base")
    a1 = save_adapter(root / "base", root / "a1", seed=1, r=8, targets=ALL_MODULES)
    a2 = save_adapter(root / "base", root / "a2", seed=2, r=16,
                      targets=["q_proj", "v_proj", "down_proj"], rslora=True)
    return {"base": hf, "a1": a1, "a2": a2}


def references(models: dict, prompts: list[list[int]], n: int) -> dict:
    """``{name: [greedy_reference(model, prompt, n) for each prompt]}`` of each model."""
    return {k: [greedy_reference(m, p, n) for p in prompts] for k, m in models.items()}


def check_choice(choice: dict, ref: tuple[list[int], list[float]], what: str) -> None:
    """A completion choice (``return_token_ids``, ``logprobs: 0``) against a greedy reference:
    the same tokens, log-probs within 1e-3."""
    toks, lps = ref
    assert choice["token_ids"] == toks, f"{what}: tokens differ from transformers + peft"
    got = choice["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3, f"{what}: log-probs differ"
