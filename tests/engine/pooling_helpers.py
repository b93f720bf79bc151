"""Tiny random pooling checkpoints for the tests (fp32, Qwen3, hidden 64, 2 layers), saved
with ``save_pretrained`` beside the character-level tokenizer of ``moe_helpers``:

- an embedder: a ``Qwen3Model`` (architecture ``Qwen3Model``, un-prefixed tensor names) with
  a sentence-transformers ``modules.json`` and ``1_Pooling/config.json`` (last token,
  normalised, as Qwen3-Embedding ships; or mean / CLS pooling);
- a cross-encoder: a ``Qwen3ForSequenceClassification`` with one label;
- a yes/no reranker: a ``Qwen3ForCausalLM`` whose tokenizer has ``yes`` and ``no`` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from moe_helpers import save_char_tokenizer

CONFIG = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 512, "num_hidden_layers": 2,
          "attn_implementation": "eager", "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0, "tie_word_embeddings": False}

POOLING_KEYS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                "cls": "pooling_mode_cls_token"}


def _randomise(hf, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def write_sentence_transformers(path, pooling: str = "last", normalize: bool = True) -> None:
    """sentence-transformers' ``modules.json`` (Transformer, Pooling[, Normalize])."""
    path = Path(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    cfg = {"word_embedding_dimension": CONFIG["hidden_size"]}
    cfg.update({key: name == pooling for name, key in POOLING_KEYS.items()})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


def save_embedder(path, pooling: str = "last", normalize: bool = True):
    """A random ``Qwen3Model`` saved with its sentence-transformers files; returns it."""
    import transformers as T

    torch.manual_seed(0)
    hf = T.Qwen3Model(T.Qwen3Config(**CONFIG)).eval()
    _randomise(hf)
    hf.save_pretrained(path)
    save_char_tokenizer(path)
    write_sentence_transformers(path, pooling, normalize)
    return hf


def save_cross_encoder(path):
    """A random one-label ``Qwen3ForSequenceClassification``; returns it."""
    import transformers as T

    torch.manual_seed(0)
    hf = T.Qwen3ForSequenceClassification(T.Qwen3Config(**CONFIG, num_labels=1)).eval()
    _randomise(hf, seed=11)
    hf.save_pretrained(path)
    save_char_tokenizer(path)
    return hf


def save_yes_no_reranker(path):
    """A random ``Qwen3ForCausalLM`` whose tokenizer knows ``yes`` and ``no``; returns it."""
    import transformers as T
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    hf = T.Qwen3ForCausalLM(T.Qwen3Config(**CONFIG)).eval()
    _randomise(hf, seed=13)
    hf.save_pretrained(path)
    save_char_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    # two words of the vocabulary's own: the character pre-tokenizer never produces them,
    # so the reranker's yes/no ids are exactly these
    vocab = tok.get_vocab()
    spare = sorted(set(range(256)) - set(vocab.values()))
    data = json.loads(Path(path, "tokenizer.json").read_text())
    if len(spare) >= 2:
        data["model"]["vocab"].update({"no": spare[0], "yes": spare[1]})
    else:  # the vocabulary is full: take over two rare characters
        rare = sorted(vocab, key=vocab.get)[-2:]
        for word, old in zip(("no", "yes"), rare):
            data["model"]["vocab"][word] = data["model"]["vocab"].pop(old)
    Path(path, "tokenizer.json").write_text(json.dumps(data))
    return hf
