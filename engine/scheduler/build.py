"""Build an engine from ``ServerArgs``: the one path for the engine process and ``LLM``.

``build_engine`` loads the model runner (weights, KV pool), the tokenizer, the EOS ids and
the ``Scheduler``. The engine process (``EngineLoop._start``) adds its GPU warm-up; the
offline ``LLM`` drives the scheduler directly.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from engine.args import ServerArgs
from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger("ferry.engine")


@dataclass
class Engine:
    """What ``build_engine`` returns.

    Attributes:
        runner: the ``ModelRunner`` (model, KV pool, attention backend on one device).
        tokenizer: a transformers tokenizer, or None (dummy weights without tokenizer
            files: token-id prompts only, no stop strings).
        scheduler: the ``Scheduler`` over ``runner``.
        vocab_size: the model's vocabulary size (token ids are in ``[0, vocab_size)``).
        max_context_len: the usable context (tokens, prompt plus completion): the model's
            context capped by the KV pool.
    """

    runner: Any
    tokenizer: Any
    scheduler: Scheduler
    vocab_size: int
    max_context_len: int


def load_engine_tokenizer(args: ServerArgs):
    """The tokenizer of ``args`` (``--tokenizer-path``, else the model's).

    Returns:
        a transformers tokenizer, or None when ``--load-format dummy`` finds no tokenizer
        (random weights are driven with token ids; a warning is logged).
    Raises:
        whatever ``load_tokenizer`` raises (FileNotFoundError, ValueError, OSError...) when
        the weights are real: a real model without a tokenizer is a configuration error.
    """
    from engine.tokenizer.tokenizer import load_tokenizer

    try:
        return load_tokenizer(args.tokenizer_path or args.model_path)
    except Exception as exc:
        if args.load_format != "dummy":
            raise
        logger.warning("no tokenizer for the dummy weights (%s); token-id prompts only, "
                       "stop strings are disabled", exc)
        return None


def check_environment(args: ServerArgs) -> None:
    """The checks that need this machine, before any process starts: the device exists, the
    attention backend is known and runs on it, and the model path resolves (to weights,
    unless ``--load-format dummy``).

    Raises:
        ValueError, FileNotFoundError: with a message naming the flag or the path.
    """
    from engine import device as dev
    from engine.attention import resolve_attention_backend
    from engine.executor.tp_worker import check_tensor_parallel
    from engine.loader.loader import resolve_model_path

    device_type = dev.resolve_device(args.device)
    resolve_attention_backend(args.attention_backend, device_type)
    if args.load_format != "dummy" or args.model_path:
        source = resolve_model_path(args.model_path)
        if source.kind == "config" and args.load_format != "dummy":
            # else the engine process dies in the loader with a traceback, after the server
            # warned about borrowing the default tokenizer for the config's vocabulary
            raise ValueError(f"{args.model_path} is a model config without weights (no "
                             "*.safetensors, no .gguf file): pass --load-format dummy for "
                             "random weights, or point --model-path at a checkpoint")
    draft = args.speculative_draft_model_path
    if draft and not os.path.exists(draft):
        raise FileNotFoundError(f"--speculative-draft-model-path {draft}: no such file or "
                                "directory")
    if draft:
        try:  # a path with no model in it, before the engine process loads the target
            resolve_model_path(draft)
        except ValueError as exc:
            raise ValueError(f"--speculative-draft-model-path {draft}: {exc}") from None
    if args.tp_size > 1 or args.nnodes > 1:
        check_tensor_parallel(args, device_type)


def build_engine(args: ServerArgs) -> Engine:
    """Load the model and build the scheduler for ``args``.

    Args:
        args: the server arguments (device, model, KV pool and batching limits).
    Returns:
        an ``Engine`` (runner, tokenizer, scheduler, vocab_size, max_context_len).
    Raises:
        ValueError, FileNotFoundError, OSError: an unsupported or missing model, or a real
            model without a tokenizer (see ``load_engine_tokenizer``).
    """
    from engine import device as dev
    from engine.executor.model_runner import ModelRunner
    from engine.tokenizer.tokenizer import eos_token_ids

    threads = dev.cpu_thread_count(args.cpu_threads)
    dev.set_cpu_threads(threads)
    logger.info("engine: %d intra-op CPU thread%s (--cpu-threads; OMP_WAIT_POLICY=%s)",
                threads, "" if threads == 1 else "s",
                os.environ.get("OMP_WAIT_POLICY", "the OpenMP default"))
    runner = ModelRunner(args)
    tokenizer = load_engine_tokenizer(args)
    scheduler = Scheduler(args, runner, tokenizer, eos_token_ids(runner.config, tokenizer))
    if scheduler.recurrent_state and not args.disable_radix_cache:
        snaps = scheduler.kv.snapshots
        logger.info("prefix cache: %s", "off (--max-state-snapshots 0: the linear-attention "
                    "layers' states are reused only from snapshots)" if snaps is None else
                    f"on, page size {args.page_size}, schedule policy {args.schedule_policy}; "
                    f"a prefix is reused where one of the {snaps.num_snapshots} snapshots of "
                    "the linear-attention layers' states ends it (taken at prefill chunk ends, "
                    "branching points and request ends on page boundaries)")
    else:
        logger.info("prefix cache: %s", "off (--disable-radix-cache)"
                    if args.disable_radix_cache else
                    f"on, page size {args.page_size}, schedule policy {args.schedule_policy}")
    if runner.pooling is not None:
        p = runner.pooling
        logger.info("pooling model: %s%s; every request is one prefill (no decode, no "
                    "sampling), run eagerly (no graphs); prefix cache %s", p.task,
                    f", {p.pooling} pooling{', normalised' if p.normalize else ''}"
                    if p.task == "embed" else "", "on" if scheduler.kv.enabled else "off")
    if scheduler.spec is not None:
        logger.info("speculative decoding: %s, %d draft tokens, in decode steps of up to %d "
                    "requests (verify steps are not overlapped)",
                    args.speculative_algorithm, scheduler.spec.k, scheduler.spec.max_bs)
    return Engine(runner=runner, tokenizer=tokenizer, scheduler=scheduler,
                  vocab_size=runner.model_config.vocab_size,
                  max_context_len=runner.max_context_len)
