"""Quantized linear layers: which scheme a model uses, and the hooks the loader calls.

FP8 W8A8 (:mod:`engine.layers.quantization.fp8`), AWQ and GPTQ 4-bit weights
(:mod:`engine.layers.quantization.int4`: ``quant_method: awq`` GEMM layout, ``gptq`` 4-bit
without act-order, compressed-tensors ``pack-quantized`` 4-bit groups, or ``--quantization
awq|gptq`` to quantize float weights at load) and GGUF
blocks (:mod:`engine.layers.quantization.gguf`, planned by the GGUF loader). FP8 comes from
the checkpoint's ``config.json`` ``quantization_config`` or from ``--quantization fp8``:

- ``quant_method: "compressed-tensors"`` (llm-compressor's FP8 models): every
  ``config_groups`` entry must target ``Linear`` with ``weights`` ``{type: float,
  num_bits: 8, strategy: channel|tensor}``; ``input_activations`` may be dynamic, static or
  absent; ``ignore`` lists modules kept in the run dtype (``lm_head``, ``re:`` regexes);
- ``quant_method: "fp8"`` with ``activation_scheme: dynamic|static`` (``weight_scale`` per
  tensor or per channel), or with ``weight_block_size: [bn, bk]`` (block-wise FP8:
  ``weight_scale_inv`` per block, :mod:`engine.layers.quantization.fp8_block`; with
  ``--load-format dummy`` the dummy float weights are quantized per block);
- ``--quantization fp8`` on a float checkpoint (safetensors, GGUF, dummy): every linear
  weight is quantized per output channel while it loads.

Static ``input_scale`` tensors are skipped: activations are always quantized per token at
run time (at least as accurate as one static scale, and one formula on every path). The
config is parsed here by hand; the ``compressed-tensors`` package is not needed.

The loader builds the model inside :func:`quantization_scope`, so each ``LinearBase``
(:mod:`engine.layers.linear`) picks up the scheme's quant method when it is constructed;
then :func:`apply_ignore` returns the ignored layers to the run dtype, the model's
``load_weights`` fills them, and :func:`process_weights_after_loading` checks the scales and
picks each layer's matmul path. Embeddings, norms and the LM head are never quantized.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging

import torch
from torch import nn

from engine.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from engine.layers.quantization.fp8_block import Fp8BlockLinearMethod
from engine.layers.quantization.int4 import Int4Config
from engine.layers.quantization.int4_config import (
    _refuse,
    ct_groups,
    parse_awq,
    parse_compressed_int4,
    parse_gptq,
)

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("fp8", "gguf", "awq", "gptq")

_ACTIVE: contextvars.ContextVar[Fp8LinearMethod | Fp8BlockLinearMethod | None] = contextvars.ContextVar(
    "ferry_quant_method", default=None)

__all__ = ["Fp8BlockLinearMethod", "Fp8Config", "Fp8LinearMethod", "Int4Config", "QUANTIZATION_METHODS",
           "apply_ignore", "current_linear_method", "get_quant_config", "process_weights_after_loading",
           "quantization_scope"]


def _as_dict(qc) -> dict:
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    return dict(vars(qc))


def _block_size(qc: dict) -> tuple[int, int] | None:
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(f"FP8 weight_block_size {block!r} (expected [rows, columns], two "
                      "positive integers)")
    return int(block[0]), int(block[1])


def _parse_fp8(qc: dict) -> Fp8Config:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse(f"FP8 activation_scheme {scheme!r} (expected dynamic or static)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"FP8 fmt {fmt!r}: only e4m3 weights are supported")
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    return Fp8Config(True, "fp8", scheme, list(ignore), _block_size(qc))


def _parse_compressed_tensors(qc: dict) -> Fp8Config | Int4Config:
    if not qc.get("config_groups"):
        raise _refuse("compressed-tensors without config_groups")
    fmt = qc.get("format")
    if fmt == "pack-quantized":
        return parse_compressed_int4(qc)
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r}; ferry loads float-quantized "
                      "(FP8) and pack-quantized (4-bit) checkpoints")
    schemes = set()
    for what, g, w in ct_groups(qc, "", "float", 8,
                                "FP8 weights (type float, num_bits 8) only"):
        strategy = w.get("strategy")
        if strategy == "block" or w.get("block_structure"):
            raise _refuse(f"{what}: block-wise FP8 weights (block_structure "
                          f"{w.get('block_structure')}) are not supported")
        if strategy not in ("channel", "tensor"):
            raise _refuse(f"{what}: weight strategy {strategy!r} (supported: channel, "
                          "tensor)")
        a = g.get("input_activations")
        if a:
            if a.get("type") != "float" or a.get("num_bits") != 8:
                raise _refuse(f"{what} has {a.get('type')} {a.get('num_bits')}-bit "
                              "activations; ferry quantizes activations to FP8")
            schemes.add("dynamic" if a.get("dynamic") else "static")
        else:
            schemes.add("none")
    if qc.get("kv_cache_scheme"):
        logger.warning("the checkpoint's kv_cache_scheme is ignored (its k/v scales are "
                       "skipped); --kv-cache-dtype picks the KV cache format")
    return Fp8Config(True, "compressed-tensors", "/".join(sorted(schemes)),
                     list(qc.get("ignore") or []))


def get_quant_config(hf_config, quantization: str | None = None,
                     load_format: str = "auto") -> Fp8Config | Int4Config | None:
    """The quantization scheme of a model, or None for a plain float model.

    Args:
        hf_config: the HF config (its ``quantization_config``, or its ``text_config``'s).
        quantization: ``--quantization`` (None, ``"fp8"``, ``"awq"`` or ``"gptq"``: quantize
            a float checkpoint at load; a quantized checkpoint's own scheme wins, and another
            one named here is an error).
        load_format: with ``dummy``, a quantized checkpoint config means weights of that
            scheme quantized from the dummy float weights; with ``gguf`` (whose tensors the
            loader dequantizes) a ``quantization_config`` is ignored, as is transformers'
            ``quant_method: gguf``.
    Raises:
        ValueError: an unknown ``--quantization`` value, or a checkpoint scheme ferry cannot
            load (a malformed FP8 weight_block_size, 8-bit integer or act-order GPTQ weights, another
            quant_method), naming it; ``--quantization awq|gptq`` on a checkpoint quantized
            another way.
    """
    if quantization not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"--quantization {quantization!r} is not supported; choose "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None and getattr(hf_config, "text_config", None) is not None:
        qc = getattr(hf_config.text_config, "quantization_config", None)
    if qc:
        qc = _as_dict(qc)
        method = getattr(qc.get("quant_method"), "value", qc.get("quant_method"))
        if method == "gguf" or load_format == "gguf":
            qc = None  # transformers' marker of a GGUF file: ferry dequantizes GGUF itself
        elif method == "mxfp4":
            # gpt-oss's MXFP4 experts: the family keeps them (engine.models.gpt_oss reads
            # the config); its linear layers are float
            qc = None
    if qc:
        if method == "fp8":
            cfg = _parse_fp8(qc)
        elif method == "compressed-tensors":
            cfg = _parse_compressed_tensors(qc)
        elif method == "awq":
            cfg = parse_awq(qc)
        elif method == "gptq":
            cfg = parse_gptq(qc)
        else:
            raise _refuse(f"quant_method {method!r}; ferry loads FP8 checkpoints "
                          "(quant_method 'fp8', or 'compressed-tensors' with FP8 weights), "
                          "AWQ ('awq') and GPTQ ('gptq')")
        if quantization in ("awq", "gptq") and getattr(cfg, "method", None) != quantization:
            raise ValueError(f"--quantization {quantization}: the checkpoint is already "
                             f"quantized (quantization_config quant_method {method!r})")
    elif quantization == "gguf":
        raise ValueError("--quantization gguf keeps a GGUF file's blocks; the model at hand "
                         f"is {load_format}")
    elif quantization == "fp8":
        cfg = Fp8Config(False, "--quantization fp8")
    elif quantization in ("awq", "gptq"):
        cfg = Int4Config(quantization, checkpoint=False, source=f"--quantization {quantization}")
    else:
        return None
    if isinstance(cfg, Int4Config):
        if load_format == "dummy" and cfg.checkpoint:
            cfg = dataclasses.replace(cfg, checkpoint=False)
    elif cfg.checkpoint_fp8 and load_format == "dummy":
        cfg = dataclasses.replace(cfg, checkpoint_fp8=False)
    return cfg


@contextlib.contextmanager
def quantization_scope(config: Fp8Config | Int4Config | None):
    """Within this block, every ``LinearBase`` constructed uses ``config``'s quant method
    (none when ``config`` is None)."""
    token = _ACTIVE.set(None if config is None else config.linear_method())
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_linear_method() -> Fp8LinearMethod | Fp8BlockLinearMethod | None:
    """The quant method of the enclosing :func:`quantization_scope`, or None."""
    return _ACTIVE.get()


def apply_ignore(model: nn.Module, config: Fp8Config | Int4Config, dtype: torch.dtype) -> int:
    """Return the linear layers that ``config.ignore`` names to the run dtype ``dtype``.

    A fused layer (``model.stacked_params``: ``(fused, part, shard)``) is ignored when all of
    its HF parts are. Returns the number of layers returned to ``dtype``.

    Raises:
        ValueError: the ignore list names only some parts of one fused layer.
    """
    if not config.ignore:
        return 0
    stacked = getattr(model, "stacked_params", ())
    n = 0
    for name, module in model.named_modules():
        if getattr(module, "quant_method", None) is None:
            continue
        parent, _, leaf = name.rpartition(".")
        parts = [f"{parent}.{part}" if parent else part
                 for fused, part, _ in stacked if fused == leaf] or [name]
        flags = [config.is_ignored(p) for p in parts]
        if all(flags):
            module.drop_quantization(dtype)
            n += 1
        elif any(flags):
            raise ValueError(f"the checkpoint's ignore list keeps only some of {parts} "
                             f"unquantized; ferry fuses them into {name}")
    if n:
        logger.info("%d linear layers stay in %s (the checkpoint's ignore list)", n,
                    str(dtype).removeprefix("torch."))
    return n


def process_weights_after_loading(model: nn.Module, device_type: str) -> int:
    """Call every quantized layer's (and block-FP8 experts') ``process_weights_after_loading``
    (scale checks, the matmul path for ``device_type``). Returns the number of quantized
    layers."""
    n = 0
    for name, module in model.named_modules():
        # a quantized linear layer's quant method, or block-FP8 experts' state
        # (engine.layers.moe_fp8)
        method = getattr(module, "quant_method", None) or getattr(module, "fp8_experts", None)
        if method is not None:
            method.process_weights_after_loading(module, device_type, name)
            n += 1
    return n
