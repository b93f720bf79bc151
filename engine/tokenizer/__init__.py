"""Text <-> token ids: the tokenizer loader (``tokenizer.py``, also for GGUF files) and the
incremental, UTF-8-safe detokenizer process (``detokenizer.py``)."""
