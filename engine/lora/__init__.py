"""LoRA adapters (issue 29): reading peft adapters (``adapter.py``) and serving them from
device slots in mixed batches (``manager.py``). The layers' side is
``engine/layers/lora.py``, the kernels are ``kernels/lora.py``."""
