"""Every message that crosses a process boundary, and nothing else.

Messages are ``msgspec.Struct``s encoded with msgpack (never pickle). Names end in ``Req``
(toward the engine) or ``Out`` (away from it). Each carries ``rid`` or ``rids``.

Sockets (ZMQ PUSH/PULL over ipc:// in a private 0700 temp dir):
  server --(EngineReq)--> engine --(BatchTokenIdOut)--> detokenizer --(BatchStrOut)--> server
  engine and detokenizer also push control messages (ReadyOut, ErrorOut, ...) to the server.
"""

from __future__ import annotations

import msgspec

from engine.sampling.params import SamplingParams


class _Msg(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    pass


# ---- toward the engine -------------------------------------------------------------------

class ImageData(msgspec.Struct, kw_only=True):
    """One image of a request, processed by the server (``server/media/``): what the model
    worker needs to compute its embeddings (``engine/mm_inputs.py`` checks and unpacks it).

    ``pixel_values``: the image processor's patches, float32 little-endian bytes of shape
    ``pixel_shape`` ``[patches, C * temporal_patch * patch * patch]`` (Gemma 3: ``[patches,
    C * patch * patch]``); ``grid_thw``: the patch grid (t, h, w); ``merge``: the spatial
    merge factor (Gemma 3: the projector's pooling kernel); ``content_hash``: a 64-bit
    hash of the pixels and grid (the prefix cache keys the image's tokens by it);
    ``offset``/``length``: the span of prompt tokens its embeddings fill.
    """

    pixel_values: bytes
    pixel_shape: list[int]
    grid_thw: list[int]
    merge: int
    content_hash: int
    offset: int
    length: int


class TokenizedGenerateReq(_Msg):
    """A tokenized request. ``input_ids``: prompt token ids, int, length >= 1; ``images``:
    its images (prompt order; their tokens are image-pad ids in ``input_ids``)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    arrival_time: float = 0.0  # time.time() when the HTTP request arrived (0: unknown)
    lora_name: str | None = None  # the LoRA adapter it runs on (None: the base model)
    # a pooling request (an embedding or a score, to a pooling engine): prefill only,
    # answered with ``PooledOut`` instead of tokens
    pooling: bool = False
    images: list[ImageData] = []


class AbortReq(_Msg):
    """Drop a request (client gone or shutdown); the engine frees its KV at the next step."""

    rid: str


class GetServerInfoReq(_Msg):
    """Ask the engine for its pool and queue figures; answered with ``ServerInfoOut``."""

    rid: str


class FlushCacheReq(_Msg):
    """Empty the radix prefix cache; answered with ``FlushCacheOut``."""

    rid: str


class LoadLoRAReq(_Msg):
    """Load a peft LoRA adapter directory under a name; answered with ``LoRAOut``."""

    rid: str
    lora_name: str
    lora_path: str


class UnloadLoRAReq(_Msg):
    """Forget a LoRA adapter (its running requests finish on it); answered with
    ``LoRAOut``."""

    rid: str
    lora_name: str


# ---- away from the engine ----------------------------------------------------------------

class BatchTokenIdOut(_Msg):
    """New tokens of one scheduler step, engine -> detokenizer. One entry per rid.

    ``finished_reasons[i]`` is None while the request runs, else a dict
    ``{"type": "stop"|"length"|"abort", "matched": str|int|None, "message": str|None}``.
    Per-request detokenization settings travel with each entry so the detokenizer needs no
    other channel.
    """

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    stop_strs: list[list[str]]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    # logprobs of the new tokens: per rid a list (one per new token) of
    # (chosen_logprob, [[token_id, logprob], ...top-k]) or None when not asked for
    logprobs: list[list | None] = []
    # per rid, on its first output: per prompt token None (the first) or (chosen_logprob,
    # [[token_id, logprob], ...top-k], rank of the prompt token in the vocabulary)
    prompt_logprobs: list[list | None] = []
    # prompt tokens found in the prefix cache at admission; -1 before admission or with the
    # cache off
    cached_tokens: list[int] = []
    # the request's min_tokens: a stop string only counts where it ends in the text of
    # generated token min_tokens or later (as the engine checks it)
    min_tokens: list[int] = []
    # the request's stop_regex patterns (engine/sampling/stops.py)
    stop_regex: list[list[str]] = []
    # seconds from the scheduler's receipt to the request's first admission into a batch
    # (Req.queue_time); -1 while it has not been admitted
    queue_time_s: list[float] = []


class BatchStrOut(_Msg):
    """Text deltas, detokenizer -> server. One entry per rid."""

    rids: list[str]
    texts: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[list | None] = []
    prompt_logprobs: list[list | None] = []
    cached_tokens: list[int] = []
    queue_time_s: list[float] = []  # as in BatchTokenIdOut


class PooledOut(_Msg):
    """Answers of pooling requests, engine -> server (no detokenizer). One entry per rid:
    ``outputs[i]`` float32 values as floats (an embedding ``[hidden]``, or ``[score]``),
    ``prompt_tokens[i]`` its prompt's length, ``cached_tokens[i]`` the prompt tokens found in
    the prefix cache (-1: the cache is off)."""

    rids: list[str]
    outputs: list[list[float]]
    prompt_tokens: list[int]
    cached_tokens: list[int] = []


class ReadyOut(_Msg):
    """Sent once by each child after start-up, before the server listens."""

    rid: str  # the child's name: "engine" or "detokenizer"
    max_total_tokens: int = 0
    swa_total_tokens: int = 0  # the windowed layers' pool (engine/kv/windowed.py); 0: none
    max_context_len: int = 0
    max_running_requests: int = 0
    vocab_size: int = 0
    device: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""
    model: str = ""
    architecture: str = ""  # the model's (``ModelConfig.architecture``): family defaults
    tp_size: int = 1
    # LoRA (--lora-paths / --enable-lora): whether adapters can be served, and the loaded
    # ones (name -> path)
    lora_enabled: bool = False
    lora_adapters: dict[str, str] = {}
    # a pooling engine's ``PoolingSpec.describe()`` ({"task", "pooling", "normalize",
    # "matryoshka", "matryoshka_dims", "num_labels"}); {} for a generation engine
    pooling: dict = {}


class ErrorOut(_Msg):
    """A request the engine rejected or failed; ``status`` is the HTTP status to answer."""

    rid: str
    message: str
    status: int = 400
    param: str | None = None
    code: str | None = None


class ServerInfoOut(_Msg):
    """Engine figures: KV pool tokens used (held by requests) and free (allocatable,
    evictable prefix-cache tokens included), running/waiting requests."""

    rid: str
    kv_used_tokens: int
    kv_free_tokens: int
    kv_total_tokens: int
    num_running: int
    num_waiting: int
    stats: dict = {}
    # radix prefix cache: tokens the tree holds, and those of them no request is using
    cached_tokens: int = 0
    evictable_tokens: int = 0
    # {"tp_size", "backend", "ranks": [{"rank", "weight_bytes", "kv_bytes"}, ...]}
    tensor_parallel: dict = {}
    # speculative decoding: {"algorithm", "num_draft_tokens", "max_batch_size",
    # "mean_accept_length"}; {} when off (its counters are in ``stats``)
    speculative: dict = {}


class FlushCacheOut(_Msg):
    """Answer to ``FlushCacheReq``: refused (``success`` False) while requests run."""

    rid: str
    success: bool
    message: str = ""


class LoRAOut(_Msg):
    """Answer to ``LoadLoRAReq`` / ``UnloadLoRAReq``: on failure ``status`` (400 a bad
    adapter, 404 an unknown name) and ``param``; ``adapters`` the loaded ones afterwards."""

    rid: str
    success: bool
    message: str = ""
    status: int = 200
    param: str | None = None
    adapters: dict[str, str] = {}


class StatsOut(_Msg):
    """Periodic engine step statistics for /metrics."""

    rid: str = "stats"
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0


EngineReq = (TokenizedGenerateReq | AbortReq | GetServerInfoReq | FlushCacheReq | LoadLoRAReq
             | UnloadLoRAReq)
DetokReq = BatchTokenIdOut
ServerBound = (BatchStrOut | ReadyOut | ErrorOut | ServerInfoOut | StatsOut | FlushCacheOut
               | LoRAOut | PooledOut)
AnyMsg = EngineReq | BatchTokenIdOut | ServerBound
