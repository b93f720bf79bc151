"""``ferry serve``'s start-up checks of what the flags name, before any process starts.

``engine.scheduler.build.check_environment`` checks the machine (device, attention backend,
model path, tensor-parallel shape); :func:`check_start_up` then checks, in seconds and
without loading a weight, what would otherwise fail only inside the engine process after the
model loaded (20-60 s, a traceback, exit 1):

- LoRA flags: ``--max-loras-per-batch`` given without ``--lora-paths``/``--enable-lora``
  (``--max-loaded-loras`` and ``--max-lora-rank`` are refused by ``ServerArgs`` already);
  every ``--lora-paths`` directory: its ``adapter_config.json``, a weights file and the
  declared rank against ``--max-lora-rank`` (``engine.lora.adapter.check_adapter_dir``);
- the model: its config (``AutoConfig``) and the model class built on the ``meta`` device
  (no memory), which refuses what the constructors refuse: an unsupported architecture, an
  MoE model with ``--quantization fp8|awq|gptq`` or an FP8 checkpoint, a GGUF file of an MoE
  model, a ``--load-format`` that does not match the files, an unsupported quantization
  scheme or activation; with LoRA, a family that refuses it (Phi-3, GLM-4: fused
  checkpoint projections);
- a model with latent-attention layers (DeepSeek-V2/V3's MLA): the flags it does not run
  with yet (:func:`check_latent_attention`: LoRA, EAGLE-3; an FP8 KV cache and TP run);
- a model with linear-attention (``RECURRENT_STATE``) layers: EAGLE-3 and STANDALONE
  speculation, LoRA and device graphs are refused (:func:`check_recurrent_state_flags`);
  tensor parallelism runs (a ``--tp-size`` that does not split the linear layers' heads is
  refused by ``check_environment``'s tensor-parallel check, which asks the model class);
- ``--speculative-algorithm MTP`` (or ``NEXTN``): a model without an MTP layer in its
  checkpoint (or, with dummy weights, in its config) (:func:`check_mtp_model`);
- on XPU: a single tensor over the per-allocation limit of Intel's client GPUs
  (:data:`XPU_MAX_SINGLE_ALLOCATION`) unless ``UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1``.

Each failure is a ``ValueError`` whose message is one line naming the flag or file;
``ferry serve`` prints it as ``ferry serve: error: ...`` and exits with 2.
"""

from __future__ import annotations

import logging
import os

import torch

from engine import device as dev
from engine.args import ServerArgs, lora_enabled, lora_path_items

logger = logging.getLogger(__name__)

#: the largest single device allocation of Intel's client GPUs (Arc, integrated) unless
#: Level Zero's relaxed limits are asked for (unified-runtime#1245); the Data Center GPU Max
#: allows more, and the relaxing variable costs it nothing
XPU_MAX_SINGLE_ALLOCATION = 4 << 30
#: the environment variable that lifts it (Level Zero then builds kernels for > 4 GiB buffers)
XPU_RELAX_ENV = "UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS"
#: LoRA flags with a default that only an explicit value can contradict
_LORA_ONLY_FLAGS = ("max_loras_per_batch",)


def one_line(message: str) -> str:
    """``message`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(message.split())


def check_start_up(args: ServerArgs, given: frozenset[str] | set[str] = frozenset()) -> None:
    """Every start-up check of this module (module docstring), cheapest first.

    Args:
        args: the parsed flags.
        given: the ``ServerArgs`` field names given on the command line (a flag left at its
            default cannot be told from one given with the default value otherwise).
    Raises:
        ValueError: one line naming the flag, the file or the tensor.
    """
    check_lora_flags(args, given)
    check_adapters(args)
    device_type = dev.resolve_device(args.device)
    model = build_meta_model(args, device_type)
    if model is not None:
        check_latent_attention(args, model, device_type)
        check_recurrent_state_flags(model, args, device_type)
        check_image_model(model, args)
    if model is not None and lora_enabled(args):
        check_lora_model(model)
    if model is not None and args.speculative_algorithm in ("EAGLE", "EAGLE3", "MTP"):
        check_eagle_model(model, args.speculative_algorithm)
    if model is not None and args.speculative_algorithm == "MTP":
        check_mtp_model(model, args)
    if model is not None and device_type == "xpu":
        check_xpu_allocations(model, args.tp_size)


def check_lora_flags(args: ServerArgs, given: frozenset[str] | set[str]) -> None:
    """A LoRA-only flag given on a server without adapters.

    Raises:
        ValueError: naming the flag.
    """
    if lora_enabled(args):
        return
    for f in _LORA_ONLY_FLAGS:
        if f in given:
            raise ValueError(f"--{f.replace('_', '-')} needs --lora-paths or --enable-lora "
                             "(without adapters it would be ignored)")


def check_lora_model(model: torch.nn.Module) -> None:
    """A family whose LoRA ferry refuses (its class's ``lora_refusal``: Phi-3's and GLM-4's
    fused checkpoint projections).

    Raises:
        ValueError: one line naming the architecture and the flags.
    """
    why = getattr(type(model), "lora_refusal", None)
    if why:
        raise ValueError(f"{type(model).__name__}: {why} (--lora-paths/--enable-lora)")


def check_eagle_model(model: torch.nn.Module, algorithm: str) -> None:
    """A family that cannot feed an EAGLE head (its class's ``eagle_refusal``: Gemma 4).

    Raises:
        ValueError: one line naming the architecture and the flag.
    """
    why = getattr(type(model), "eagle_refusal", None)
    if why:
        raise ValueError(f"{type(model).__name__}: {why} (--speculative-algorithm {algorithm})")


def check_mtp_model(model: torch.nn.Module, args: ServerArgs) -> None:
    """``--speculative-algorithm MTP`` on a model whose checkpoint has no MTP layer (its
    family has none, or the checkpoint's tensors, or with dummy weights the config, do not
    declare one; ``engine/models/mtp.py``).

    Raises:
        ValueError: one line naming the architecture and the flag.
    """
    from engine.models.mtp import mtp_refusal

    path = args.speculative_draft_model_path or args.model_path
    why = mtp_refusal(type(model), model.config, path, args.load_format == "dummy")
    if why:
        raise ValueError(f"--speculative-algorithm MTP: {why}")


def check_adapters(args: ServerArgs) -> None:
    """Each ``--lora-paths`` directory, without reading its tensors.

    Raises:
        ValueError: ``--lora-paths NAME=PATH: <what is wrong>``.
    """
    from engine.lora.adapter import check_adapter_dir

    for name, path in lora_path_items(args.lora_paths or []):
        try:
            check_adapter_dir(os.path.expanduser(path), args.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"--lora-paths {name}={path}: {one_line(str(e))}") from None


def check_recurrent_state_flags(model, args: ServerArgs, device_type: str) -> None:
    """Refuse what a model with linear-attention (``RECURRENT_STATE``) layers cannot run yet:
    EAGLE-3 (its head reads layer inputs these models do not keep) and STANDALONE
    speculation (a hybrid draft model's own states are not rolled back) and LoRA.
    NGRAM, EAGLE and MTP run: the verify step leaves each state at the request's last
    accepted token (``engine/layers/gated_deltanet.py``). Decode and verify graphs run (the
    layers read their state slots from a device tensor, ``engine/executor/graph_runner.py``);
    prefill and mixed steps run eagerly (the model has no piecewise graphs).

    Raises:
        ValueError: one line naming the model class and the flag.
    """
    from engine.layer_spec import CacheKind

    specs = model.layer_specs() if hasattr(model, "layer_specs") else ()
    if not any(s.cache == CacheKind.RECURRENT_STATE for s in specs):
        return
    family = type(model).__name__
    refused = [(args.speculative_algorithm in ("EAGLE3", "STANDALONE"),
                f"--speculative-algorithm {args.speculative_algorithm}"),
               (lora_enabled(args), "LoRA (--lora-paths/--enable-lora)")]
    for bad, flag in refused:
        if bad:
            raise ValueError(f"{family} has linear-attention (recurrent-state) layers, which "
                             f"do not run with {flag} yet")


def check_image_model(model, args: ServerArgs) -> None:
    """Refuse what a model with a vision tower (``accepts_images``) cannot run yet:
    speculative decoding other than NGRAM (a draft model or head would run without the
    images' M-RoPE positions or embeddings; NGRAM's verify step takes each request's
    positions, ``VerifyReq.mm``). A model with ``images_optional`` (Gemma 3, Qwen3.5) is
    not refused: Gemma 3 needs no M-RoPE positions, and Qwen3.5 then serves text only.
    Tensor parallelism runs: every rank holds the whole vision tower and encodes the images
    rank 0 sends it (``engine/executor/tp_images.py``).

    Raises:
        ValueError: one line naming the model class and the flag.
    """
    if not getattr(model, "accepts_images", False) or getattr(model, "images_optional", False):
        return
    if args.speculative_algorithm and args.speculative_algorithm != "NGRAM":
        raise ValueError(f"{type(model).__name__} (image input) does not support "
                         f"--speculative-algorithm {args.speculative_algorithm} yet "
                         "(NGRAM runs)")


def build_meta_model(args: ServerArgs, device_type: str):
    """The model of ``args`` built on the ``meta`` device (shapes and dtypes, no memory),
    which runs the constructors' checks of the config and the quantization.

    Returns:
        the model, or None when the build failed for a reason that is not a refusal (logged;
        the engine's own load then reports it).
    Raises:
        ValueError: the config or the flags refused (unsupported architecture, MoE with a
            quantization, a format mismatch, ``--yes-no-reranker`` on a cross-encoder...),
            as one line.
    """
    from engine.loader.loader import load_model, pooling_for_args

    if args.dtype == "auto":  # the run dtype's width; the engine resolves (and logs) it
        dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
    else:
        dtype = dev.resolve_dtype(args.dtype, device_type)
    try:
        model, _ = load_model(args.model_path, args.load_format, dtype=dtype, device="meta",
                              seed=args.seed, progress=False, quantization=args.quantization,
                              gguf_dequantize=args.gguf_dequantize,
                              pooling=pooling_for_args(args))  # pooling flags refused here
    except (ValueError, OSError) as e:
        raise ValueError(one_line(str(e)) or type(e).__name__) from None
    except Exception as e:  # noqa: BLE001 - not a refusal: the engine's load has the last word
        logger.warning("start-up check: building the model's shapes failed (%s: %s); the "
                       "engine loads it anyway", type(e).__name__, one_line(str(e))[:200])
        return None
    return model


def check_latent_attention(args: ServerArgs, model: torch.nn.Module, device_type: str) -> None:
    """Refuse the flags that multi-head latent attention (DeepSeek-V2/V3's MLA layers) does
    not run with yet: LoRA, EAGLE-3 (its head reads the inputs of three layers).
    ``--tp-size`` > 1 runs (MLA splits its heads over the ranks), ``--kv-cache-dtype
    fp8_e4m3``/``fp8_e5m2`` runs (the latent pool stores FP8, ``engine/layers/mla.py``), and
    speculative decoding otherwise runs (the verify step is an extend or decode rows through
    the MLA path). Device
    graphs are not refused: decode graphs capture the Triton MLA kernels (the torch-native
    backend has no graphs: its decode runs eagerly), and the piecewise graphs, which cannot
    cut an MLA model's forward yet, are skipped at start-up (``supports_piecewise``).

    Raises:
        ValueError: one line naming the architecture and the flag.
    """
    from engine.layer_spec import AttentionKind

    specs = getattr(model, "layer_specs", lambda: [])()
    if not any(s.attention == AttentionKind.LATENT for s in specs):
        return
    arch = type(model).__name__
    refused = [(lora_enabled(args), "LoRA (--lora-paths/--enable-lora)"),
               (args.speculative_algorithm == "EAGLE3", "--speculative-algorithm EAGLE3")]
    for bad, flag in refused:
        if bad:
            raise ValueError(f"{arch} (multi-head latent attention) does not support {flag} "
                             "yet")


def check_xpu_allocations(model: torch.nn.Module, tp_size: int = 1) -> None:
    """On XPU: no tensor of ``model`` (built on ``meta``) may exceed
    :data:`XPU_MAX_SINGLE_ALLOCATION` unless ``UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1``.

    Under tensor parallelism a rank holds at least 1/``tp_size`` of a tensor, so only
    ``bytes / tp_size`` over the limit is refused (a sure failure, never a false one).

    Raises:
        ValueError: naming the tensor, its size and how to relax the limit.
    """
    if os.environ.get(XPU_RELAX_ENV, "") == "1":
        return
    name, nbytes = max(((n, t.numel() * t.element_size())
                        for n, t in [*model.named_parameters(), *model.named_buffers()]),
                       key=lambda nt: nt[1], default=("", 0))
    if nbytes // max(1, tp_size) <= XPU_MAX_SINGLE_ALLOCATION:
        return
    per_rank = f" ({nbytes / tp_size / 2**30:.1f} GiB per rank)" if tp_size > 1 else ""
    raise ValueError(
        f"{name} is {nbytes / 2**30:.1f} GiB{per_rank}, above the "
        f"{XPU_MAX_SINGLE_ALLOCATION >> 30} GiB that an Intel Arc GPU allocates at once: "
        f"set {XPU_RELAX_ENV}=1 to relax the limit (docs/deployment.md, \"Intel GPUs\"), or "
        "shrink the tensor (--tp-size, --ep-size, --quantization)")
