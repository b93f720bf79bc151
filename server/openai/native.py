"""What SGLang's own routes answer, for the routers in front of SGLang and their health checks.

sglang-router (and vllm-router, its fork) registers a worker by asking ``GET /server_info``
and ``GET /model_info`` (``/get_model_info`` on older versions): the model's id in the
router is ``served_model_name`` from the first, else ``model_path``; the router then tries
to load a tokenizer from ``tokenizer_path`` or ``model_path`` (a warning when it cannot: its
HTTP mode routes on the request text and needs none). Its ``/get_model_info``,
``/get_server_info``, ``/get_loads`` and ``/flush_cache`` forward to the workers' routes of
those names; ``--health-check-endpoint /health_generate`` checks that a worker still
generates. ferry answers all of them (``server/app.py`` routes them here).

ferry does not build SGLang's native ``POST /generate``: the routers' policies, cache_aware
included, route the OpenAI routes on their own (on the request text), and their health checks
use ``/health`` or ``/health_generate``.
"""

from __future__ import annotations

import asyncio
import uuid

from engine import io_struct as io
from engine.args import prefill_budget
from engine.sampling.params import SamplingParams
from server.http.errors import APIError, unavailable
from server.tokenizer_manager import TokenizerManager


def model_info(args, model_name: str) -> dict:
    """``GET /model_info`` (also ``/get_model_info``), in SGLang's shape.

    ``model_path`` and ``tokenizer_path`` are ``--model-path`` and ``--tokenizer-path`` as
    given (the served model name for the embedded model, which has no path of its own).
    """
    path = args.model_path or model_name
    return {"model_path": path, "tokenizer_path": args.tokenizer_path or path,
            "served_model_name": model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": None,
            "has_image_understanding": False, "has_audio_understanding": False}


def router_facts(args, ready: io.ReadyOut | None) -> dict:
    """The keys of SGLang's ``/server_info`` that its routers read besides the model's:
    the parallel sizes (one data-parallel rank per ferry server) and the batch limits
    (``chunked_prefill_size``: the effective prefill chunk in tokens, ``prefill_budget``)."""
    device = ready.device if ready else args.device
    return {"tp_size": ready.tp_size if ready else args.tp_size, "dp_size": 1,
            "disaggregation_mode": "null", "max_prefill_tokens": args.max_prefill_tokens,
            "chunked_prefill_size": prefill_budget(args, device),
            "max_running_requests": ready.max_running_requests if ready
            else args.max_running_requests}


def load_of(infos: list[tuple[int, io.ServerInfoOut]]) -> list[dict]:
    """``GET /get_load``, in SGLang's shape: one entry per data-parallel rank (each
    ``--dp-size`` replica that answered, ``(index, ServerInfoOut)``): requests running plus
    waiting, those waiting, and the KV tokens requests hold."""
    return [{"dp_rank": rank, "num_reqs": info.num_running + info.num_waiting,
             "num_waiting_reqs": info.num_waiting, "num_tokens": info.kv_used_tokens}
            for rank, info in infos]


async def generate_one_token(tm: TokenizerManager, timeout_s: float) -> None:
    """Run a one-token greedy request through the engine (``/health_generate``); on a
    pooling engine (embeddings, scores), a one-token pooling request.

    Raises:
        APIError: 503 when it does not finish within ``timeout_s`` (a busy server queues it
            behind the others), or the engine's error.
    """
    rid = f"health-{uuid.uuid4().hex}"
    ready = tm.engine_ready  # a pooling engine runs the prompt's prefill (no token)
    gen = tm.generate([(rid, [0], SamplingParams(max_tokens=1, temperature=0.0))], False,
                      pooling=bool(ready is not None and ready.pooling))
    try:
        async with asyncio.timeout(timeout_s):
            async for _ in gen:
                pass
    except TimeoutError:
        raise unavailable(f"no token generated within {timeout_s:g} s") from None
    except APIError as err:
        raise unavailable(f"the engine did not generate: {err.message}") from None
    finally:
        await gen.aclose()
