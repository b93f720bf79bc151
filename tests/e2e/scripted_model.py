"""A tiny Llama checkpoint whose greedy output is known exactly: ``save_scripted``.

One layer with its attention and MLP output projections zeroed, so the last hidden state is
the token's embedding; embeddings are one-hot, so after the final RMSNorm token ``i``'s
hidden state is ``sqrt(H) * e_i`` and the LM head's column ``i`` is token ``i``'s logits.
Each token's logits peak at its successor in ``SCRIPT`` (10), with a second choice (5) where
``SECOND`` names one: a constraint that masks the first choice gets the second. Every other
token is followed by EOS.

The tokenizer is character-level with added (non-special) tokens for the script's pieces;
its chat template writes the messages' contents and ends with ``A:``, whose successor starts
the script, so every chat request's greedy answer is::

    <think>ponder</think>Sure<tool_call>{"name": "get", "arguments": {"q": 1}}</tool_call>

(then EOS), and under a JSON constraint after the thinking ``<think>ponder</think>{"ok":
true}``.
"""

from __future__ import annotations

import string

CALL = '{"name": "get", "arguments": {"q": 1}}'
JSON_ANSWER = '{"ok": true}'
ADDED = ["A:", "<think>", "ponder", "</think>", "Sure", "<tool_call>", CALL, "</tool_call>",
         JSON_ANSWER]
#: token -> its successor (greedy); the last one's successor is EOS
SCRIPT = ["A:", "<think>", "ponder", "</think>", "Sure", "<tool_call>", CALL, "</tool_call>"]
#: token -> the second choice
SECOND = {"</think>": JSON_ANSWER}
HIDDEN = 128


def _tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in string.printable:
        if c not in "\x0b\x0c":
            vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}A:{% endif %}")
    return fast


def save_scripted(path) -> dict[str, int]:
    """Save the checkpoint and its tokenizer to ``path``; returns the added tokens' ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    vocab = len(tok)
    assert vocab <= HIDDEN
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(cfg).eval()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ADDED}
    logits = torch.zeros(vocab, vocab)                     # [current token, next token]
    logits[:, 2] = 10.0                                    # EOS by default
    for a, b in zip(SCRIPT, SCRIPT[1:] + ["</s>"], strict=True):
        logits[ids[a]] = 0.0
        logits[ids[a], tok.convert_tokens_to_ids(b)] = 10.0
    for a, b in SECOND.items():
        logits[ids[a], ids[b]] = 5.0
    logits[ids[JSON_ANSWER]] = 0.0
    logits[ids[JSON_ANSWER], 2] = 10.0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        # hidden of token i after the norm: sqrt(HIDDEN) * e_i
        model.lm_head.weight[:, :vocab] = logits.T / HIDDEN ** 0.5
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return ids
