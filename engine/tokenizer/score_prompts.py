"""The token ids a scoring model reads for a (query, document) pair.

- a cross-encoder (``classify``): the tokenizer's own pair encoding,
  ``tokenizer(query, document)`` (BERT-style ``[CLS] q [SEP] d [SEP]``; a Qwen or Llama
  tokenizer concatenates the two), as sentence-transformers' ``CrossEncoder`` feeds it;
- a yes/no reranker (``yes_no``, Qwen3-Reranker): the prompt of its model card, a system
  turn asking for "yes" or "no", the user turn ``<Instruct>: ...\\n<Query>: ...\\n<Document>:
  ...`` and an opened assistant turn with an empty think block; the score is P(yes) at its
  last token.

The server's ``/v1/rerank`` and ``/v1/score`` and the offline ``LLM.score`` both build their
prompts here.
"""

from __future__ import annotations

#: the instruction Qwen3-Reranker's model card uses when none is given
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

_SYSTEM = ("Judge whether the Document meets the requirements based on the Query and the "
           'Instruct provided. Note that the answer can only be "yes" or "no".')
YES_NO_PREFIX = f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n"
YES_NO_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def yes_no_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """Qwen3-Reranker's prompt text for one pair (``instruction`` None: the default)."""
    return (f"{YES_NO_PREFIX}<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n"
            f"<Query>: {query}\n<Document>: {document}{YES_NO_SUFFIX}")


def score_prompt_ids(tokenizer, task: str, query: str, document: str,
                     instruction: str | None = None) -> list[int]:
    """Token ids of one (query, document) pair for a ``classify`` or ``yes_no`` model.

    Raises:
        ValueError: another task (an embedder scores nothing).
    """
    if task == "yes_no":  # the card's way: prefix, pair and suffix tokenized apart
        def enc(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        body = (f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
                f"<Document>: {document}")
        return enc(YES_NO_PREFIX) + enc(body) + enc(YES_NO_SUFFIX)
    if task == "classify":
        return list(tokenizer(query, document)["input_ids"])
    raise ValueError(f"a {task!r} model does not score pairs")
