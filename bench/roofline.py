"""Memory-bandwidth roofline for decode.

A decode step at small batch is bound by memory bandwidth: every step reads all weights once,
plus the KV cache of every running request. So the fastest possible step is

    t_step >= (weight_bytes + kv_bytes) / bandwidth

and the best decode throughput at batch size ``bs`` is ``bs / t_step`` tok/s (the classic
roofline model, Williams et al. 2009, applied to LLM decode as in gpt-fast's "memory bandwidth
utilisation" figures).

``python -m bench.roofline --device auto`` measures the bandwidth with a large device-to-device
copy and prints it; with ``--model-path DIR`` (a config dir) it also prints the decode roofline.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import device as dev

GiB = 1 << 30


def _elapsed_s(device_type: str, fn, inner: int) -> float:
    """Seconds taken by ``inner`` calls of ``fn``: device events where the device has them,
    else a synchronised host clock."""
    ev = dev.event_class(device_type)
    if ev is not None:
        a, b = ev(enable_timing=True), ev(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    dev.synchronize(device_type)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    dev.synchronize(device_type)
    return time.perf_counter() - t0


def measure_bandwidth(device_type: str, nbytes: int = 2 * GiB, repeats: int = 5,
                      inner: int = 4, warmup: int = 2) -> float:
    """Measured device memory bandwidth in bytes/s.

    Copies one ``nbytes`` uint8 buffer into another with ``Tensor.copy_`` (``inner`` copies per
    timed run, after ``warmup`` untimed copies) and counts bytes read plus bytes written
    (``2 * nbytes`` per copy). Returns the median over ``repeats`` runs. Needs ``2 * nbytes`` of
    free device memory. Timing: device events on accelerators, ``perf_counter`` on the CPU.

    Raises:
        ValueError: ``nbytes``, ``repeats`` or ``inner`` below 1.
    """
    if nbytes < 1 or repeats < 1 or inner < 1:
        raise ValueError("nbytes, repeats and inner must be >= 1")
    times = _copy_times(device_type, nbytes, repeats, inner, warmup)
    dev.empty_cache(device_type)  # the buffers are gone; give their memory back
    return 2.0 * nbytes * inner / statistics.median(times)


def _copy_times(device_type: str, nbytes: int, repeats: int, inner: int,
                warmup: int) -> list[float]:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device_type)
    dst = torch.empty_like(src)
    for _ in range(max(warmup, 1)):
        dst.copy_(src)
    dev.synchronize(device_type)
    return [_elapsed_s(device_type, lambda: dst.copy_(src), inner) for _ in range(repeats)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters of ``model``; a tensor shared by several modules (tied input and
    output embeddings) is counted once. Works on meta-device models too (numel x element size).
    Buffers (rotary tables) are not counted."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    """Bytes of KV cache per token: K and V for every layer, ``2 * L * H_kv * D * bytes``."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def config_kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """``kv_bytes_per_token`` from an HF config (``num_hidden_layers``, ``num_key_value_heads``
    (defaults to ``num_attention_heads``), ``head_dim`` (defaults to hidden / heads))."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_bytes_per_token(config.num_hidden_layers, kv_heads, head_dim, dtype_bytes)


def decode_roofline(weight_bytes: float, kv_bytes: float, bandwidth: float,
                    batch_size: int = 1) -> tuple[float, float]:
    """Bandwidth roofline of one decode step.

    Args:
        weight_bytes: bytes of weights read per step (all of them, once).
        kv_bytes: bytes of KV cache read per step, summed over the whole batch.
        bandwidth: bytes/s (e.g. from ``measure_bandwidth``).
        batch_size: requests decoded per step.

    Returns:
        ``(seconds per step, output tok/s at batch_size)``.

    Raises:
        ValueError: ``bandwidth`` not positive, or negative byte counts.
    """
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    if weight_bytes < 0 or kv_bytes < 0:
        raise ValueError("byte counts must be non-negative")
    step = (weight_bytes + kv_bytes) / bandwidth
    return step, (batch_size / step if step > 0 else float("inf"))


def load_config(model_path: str):
    """The HF config of a local dir holding ``config.json``, or of a config ``.json`` file
    (like ``engine/configs/llama-3-8b.json``); never the hub.

    Raises:
        FileNotFoundError: ``model_path`` has no ``config.json``.
    """
    import os

    from transformers import AutoConfig

    if model_path.endswith(".json") and os.path.isfile(model_path):
        from engine.loader.loader import load_config as ferry_load_config

        return ferry_load_config(model_path)
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"{model_path}: no config.json (pass a config directory)")
    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def meta_model(model_path: str, dtype: torch.dtype):
    """Build an HF causal LM from a config dir on the meta device (no memory, no weights):
    enough for ``weight_bytes``. Returns ``(model, config)``."""
    from transformers import AutoModelForCausalLM

    config = load_config(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=dev.DEVICE_CHOICES)
    p.add_argument("--size-mib", type=int, default=None,
                   help="size of each copy buffer in MiB (default 2048 on GPUs, 256 on the CPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-path", default=None, help="config dir: also print the roofline")
    p.add_argument("--dtype", default="auto", choices=dev.DTYPE_CHOICES)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--context-len", type=int, default=0,
                   help="tokens of KV cache per request read each step")
    ns = p.parse_args(argv)
    device_type = dev.resolve_device(ns.device)
    size = (ns.size_mib if ns.size_mib else (2048 if dev.is_accelerator(device_type) else 256))
    bw = measure_bandwidth(device_type, size << 20, repeats=ns.repeats)
    print(f"device={device_type} ({dev.device_name(device_type)}) copy buffer={size} MiB "
          f"bandwidth={bw / 1e9:.1f} GB/s (read + write)")
    if ns.model_path:
        dtype = dev.resolve_dtype(ns.dtype, device_type)
        model, config = meta_model(ns.model_path, dtype)
        wb = weight_bytes(model)
        per_tok = config_kv_bytes_per_token(config, torch.finfo(dtype).bits // 8)
        print(f"weights={wb / 1e9:.4g} GB kv={per_tok} B/token")
        for bs in ns.batch_size:
            step, tok_s = decode_roofline(wb, bs * ns.context_len * per_tok, bw, bs)
            print(f"bs={bs} ctx={ns.context_len}: decode roofline {step * 1e3:.3f} ms/step, "
                  f"{tok_s:.1f} tok/s")


if __name__ == "__main__":
    main()
