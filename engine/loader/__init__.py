"""Loading a model: finding its files, reading its config, and its weights from HF
safetensors, GGUF (``gguf.py``) or a seeded dummy (``loader.py``)."""
