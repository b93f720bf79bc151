"""``ServerArgs``: every knob of ferry in one frozen dataclass.

The argparse parser is generated from the fields: the flag is the field name with dashes,
the help text is the field's ``metadata["help"]``, and ``choices`` come from
``metadata["choices"]``. Booleans become ``--flag`` switches. ``__post_init__`` checks the
choices and the bounds ``metadata["ge" | "gt" | "le"]``, so ``LLM(...)`` (which bypasses
argparse) and ``ferry serve`` reject the same values with the same message.

Self-contained groups of flags are dataclasses of their own, with their checks and helpers:
speculative decoding (``engine/args/speculative.py``), LoRA (``engine/args/lora.py``) and
image input (``engine/args/media.py``); ``ServerArgs`` takes their fields flat, in place
(``engine/args/fields.py``: ``take_fields``, and the field machinery), so every flag,
keyword and attribute is ``ServerArgs``'s own. This module re-exports their names.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, get_type_hints

from engine.args.fields import base_type, field_error, take_fields
from engine.args.fields import flag as _f
from engine.args.lora import (
    ADAPTER_NAME_CHARS,
    DEFAULT_MAX_LORA_RANK,
    MAX_ADAPTER_NAME_LEN,
    LoraArgs,
    adapter_name_error,
    lora_enabled,
    lora_error,
    lora_path_items,
)
from engine.args.media import MediaArgs, image_limit, media_error
from engine.args.speculative import (
    DEFAULT_NUM_DRAFT_TOKENS,
    SPECULATIVE_ALGORITHMS,
    SPECULATIVE_ALIASES,
    SPECULATIVE_BUILT,
    SPECULATIVE_MODEL_ALGORITHMS,
    SpeculativeArgs,
    num_draft_tokens,
    speculative_error,
)

__all__ = ["ADAPTER_NAME_CHARS", "DEFAULT_MAX_LORA_RANK", "DEFAULT_MAX_REQUEST_BYTES",
           "DEFAULT_NUM_DRAFT_TOKENS", "MAX_ADAPTER_NAME_LEN", "REASONING_PARSERS",
           "SPECULATIVE_ALGORITHMS", "SPECULATIVE_BUILT", "SPECULATIVE_MODEL_ALGORITHMS",
           "TOOL_CALL_PARSERS", "LoraArgs", "MediaArgs", "ServerArgs", "SpeculativeArgs",
           "adapter_name_error", "chat_template_text", "default_chunked_prefill",
           "ignored_flag_notes", "image_limit", "lora_enabled",
           "lora_path_items", "num_draft_tokens", "prefill_budget", "request_body_limit"]

#: --tool-call-parser's choices: auto, SGLang's names, then vLLM's (and SGLang's other)
#: names as aliases (server/parsers/tool_registry.py holds the parsers; a test keeps the two
#: lists equal)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3", "mistral", "pythonic", "qwen3_coder",
                     "deepseekv3", "deepseekv31", "kimi_k2", "glm45", "gpt-oss", "qwen25",
                     "qwen", "llama3_json", "llama4_pythonic", "deepseek_v3", "deepseek_v31",
                     "glm", "openai", "qwen3_xml")
#: --reasoning-parser's choices, likewise (server/parsers/reasoning.py)
REASONING_PARSERS = ("auto", "deepseek-r1", "deepseek-v3", "qwen3", "qwen3-thinking", "glm45",
                     "kimi", "kimi_k2", "gpt-oss", "deepseek_r1", "deepseek_v3",
                     "openai_gptoss")


#: ``--max-request-bytes`` by default (a text model; see :func:`request_body_limit`)
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
@take_fields(MediaArgs, before="log_requests")
@take_fields(SpeculativeArgs, LoraArgs, before="host")
class ServerArgs:
    """Every flag of ``ferry serve`` and keyword of ``LLM(...)`` (module docstring); the
    speculative, LoRA and image groups' fields are declared in their modules."""

    # model
    model_path: str | None = _f(None, "HF directory, .gguf file or directory holding one; "
                                      "empty means the embedded SmolLM2-135M-Instruct")
    tokenizer_path: str | None = _f(None, "tokenizer directory (default: from the model)")
    served_model_name: str | None = _f(None, "model name reported by /v1/models")
    load_format: str = _f("auto", "how to load weights", ("auto", "safetensors", "gguf", "dummy"))
    seed: int = _f(0, "seed for dummy weights and for unseeded sampling")
    # pooling models (engine/layers/pooler.py): prefill only, a vector or a score per prompt
    is_embedding: bool = _f(False, "serve the model for pooling, not generation: "
                                   "/v1/embeddings for an embedder, /v1/rerank and /v1/score "
                                   "for a *ForSequenceClassification cross-encoder (detected "
                                   "without the flag from a *Model or "
                                   "*ForSequenceClassification architecture, or a "
                                   "sentence-transformers modules.json)")
    yes_no_reranker: bool = _f(False, "serve a causal LM as a Qwen3-Reranker-style reranker: "
                                      "score = P(yes) over {no, yes} at the last token of the "
                                      "model's yes/no prompt (/v1/rerank, /v1/score)")
    enable_matryoshka: bool = _f(False, "the embedder allows /v1/embeddings' dimensions "
                                        "(Matryoshka truncation; also read from config.json's "
                                        "is_matryoshka or matryoshka_dimensions)")
    context_length: int | None = _f(None, "override the model's max context length (tokens)",
                                    ge=1)
    max_model_len: int | None = _f(None, "vLLM's name of --context-length (the same setting; "
                                         "giving both with different values is an error)",
                                   ge=1)
    chat_template: str | None = _f(None, "Jinja chat template used instead of the tokenizer's: "
                                         "a file path, or the template text itself (vLLM's and "
                                         "SGLang's flag)")
    trust_remote_code: bool = _f(False, "accepted for vLLM/SGLang command lines; does nothing: "
                                        "ferry runs no model code from checkpoints (its own "
                                        "model classes load them)")
    # device
    device: str = _f("auto", "compute device", ("auto", "cuda", "xpu", "cpu"))
    dtype: str = _f("auto", "weight and activation dtype (auto: bf16 on GPUs, fp32 on CPU)",
                    ("auto", "bfloat16", "float16", "float32"))
    attention_backend: str | None = _f(
        None, "attention kernels, a name of engine/attention's registry: triton (default on "
              "cuda/xpu) or torch_native (the torch reference, default on the CPU)")
    # memory and batching
    mem_fraction_static: float = _f(0.85, "fraction of device memory for weights + KV cache",
                                    gt=0, le=1)
    max_total_tokens: int | None = _f(None, "KV pool size in tokens (overrides the fraction)",
                                      ge=1)
    max_running_requests: int = _f(256, "most requests decoding at once", ge=1)
    max_queued_requests: int = _f(1024, "most requests waiting; beyond it new ones get 503",
                                  ge=1)
    chunked_prefill_size: int | None = _f(None, "most prompt tokens prefilled in one step "
                                                "(default: 2048, as vLLM's CPU and GPU "
                                                "defaults); -1: no chunking below "
                                                "--max-prefill-tokens (a step then prefills up "
                                                "to that many, SGLang's -1)",
                                            ge=1, allow={-1: "no chunking"})
    max_prefill_tokens: int = _f(16384, "most prompt tokens of one step over all its requests "
                                        "(caps --chunked-prefill-size)", ge=1)
    page_size: int = _f(1, "KV cache page size in tokens", ge=1)
    swa_full_tokens_ratio: float = _f(
        0.0, "a model with sliding-window layers: > 0 puts their K/V in a pool of their own "
             "with this many slots per full-attention slot (the memory splits by bytes per "
             "token; a request keeps about a window of them: ~2.8x the sequences of a "
             "Gemma-3-27B at 8k-32k with 0.25), at the cost of prefix reuse once a cached "
             "request decoded past its window; 0 (default): one pool for every layer",
        ge=0)
    disable_radix_cache: bool = _f(False, "do not reuse the KV of cached prompt prefixes "
                                          "(the radix prefix cache)")
    max_state_snapshots: int | None = _f(
        None, "a model with linear-attention layers (Qwen3-Next, Qwen3.5): snapshots of "
              "their states that the prefix cache keeps (a prefix is reused only where one "
              "exists); default: what a tenth of the KV cache's memory holds, at most 4 per "
              "running request; 0 turns prefix reuse off for such a model", ge=0)
    schedule_policy: str = _f("lpm", "waiting-queue order: lpm (longest cached prefix first; "
                                     "FCFS beyond 128 waiting; a request waiting 5 s goes "
                                     "first) or fcfs", ("lpm", "fcfs"))
    kv_cache_dtype: str = _f("auto", "KV cache dtype: auto (the model dtype), or fp8_e4m3 "
                                     "(alias fp8) / fp8_e5m2: one byte per value, cast "
                                     "without a scale", ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"))
    disable_cuda_graph: bool = _f(False, "run decode eagerly (no CUDA/XPU graphs)")
    enable_xpu_graph: bool = _f(False, "XPU: capture decode and piecewise graphs (off by "
                                       "default on every torch until shown right on Intel "
                                       "hardware: SYCL graphs are not stable, vllm#38193; a "
                                       "replay that disagrees with eager or raises turns them "
                                       "off; ignored off XPU)")
    cuda_graph_max_bs: int = _f(256, "GPU only: largest batch size captured in a decode graph",
                                ge=1)
    disable_piecewise_graph: bool = _f(False, "GPU only: run prefill and mixed steps eagerly "
                                              "(no piecewise graphs around their attention)")
    piecewise_graph_max_tokens: int | None = _f(
        None, "GPU only: largest prefill/mixed step (tokens) run through piecewise graphs "
              "(default: the prefill chunk + 256; larger steps run eagerly)", ge=1)
    decode_attention_waves: int | None = _f(
        None, "decode attention: split the KV until each SM (Xe core) gets this many programs "
              "(more splits hide memory latency; default per device: 1 on CUDA, 4 on XPU)",
        ge=1)
    cpu_threads: int | None = _f(None, "intra-op threads of the engine process (default: "
                                       "$OMP_NUM_THREADS if set, else the cores this process "
                                       "may run on)", ge=1)
    tp_size: int = _f(1, "tensor-parallel size: ranks that each hold 1/N of the weights "
                      "(one process per rank; NCCL on CUDA, XCCL on XPU, gloo on the CPU)", ge=1)
    ep_size: int = _f(1, "expert-parallel size (MoE models): 1, or equal to --tp-size to "
                      "partition each MoE layer's experts over the tensor-parallel ranks "
                      "(E/N whole experts per rank; attention stays tensor-parallel). A "
                      "model without MoE layers ignores it", ge=1)
    nnodes: int = _f(1, "nodes the tensor-parallel ranks span (tp-size must be a multiple)",
                     ge=1)
    node_rank: int = _f(0, "this node's index: 0 runs the HTTP server and the scheduler, "
                        "others run only model workers", ge=0)
    dist_init_addr: str | None = _f(None, "host:port of rank 0's torch.distributed rendezvous "
                                    "(required with --nnodes > 1; default: a free local port)")
    dp_size: int = _f(1, "data-parallel size: engine replicas behind the one HTTP server, each "
                      "with its own engine and detokenizer processes (on GPUs tp-size devices "
                      "each, on the CPU a share of the cores)", ge=1, le=64)
    load_balance_method: str = _f("prefix_affinity", "--dp-size: how a request picks its "
                                  "replica: the one that was sent its longest token prefix "
                                  "(unless much busier than the least loaded), round robin, or "
                                  "the fewest requests in flight",
                                  ("prefix_affinity", "round_robin", "shortest_queue"))
    dp_balance_abs_threshold: int = _f(8, "--dp-size prefix affinity: ignore the cached prefix "
                                       "when its replica has more than this many requests in "
                                       "flight beyond the least loaded one ...", ge=0)
    dp_balance_rel_threshold: float = _f(1.5, "... and more than this many times as many",
                                         ge=1.0)
    quantization: str | None = _f(None, "quantize a bf16/fp16 checkpoint at load time: fp8 "
                                  "(e4m3 weights, per-output-channel scales; matmuls of more "
                                  "than 16 rows also quantize activations per token); awq / "
                                  "gptq (4-bit weights in groups of 128, round to nearest: "
                                  "for dummy-weight benchmarks). FP8, AWQ and GPTQ "
                                  "checkpoints are detected from their config. gguf: keep a "
                                  "GGUF file's Q4_0/Q4_1/Q8_0/Q4_K linear weights in their "
                                  "blocks on any device (the CPU does by default; other GGUF "
                                  "types, Q5_K, Q6_K, F16 ..., load dequantized)",
                                  ("fp8", "gguf", "awq", "gptq"))
    gguf_dequantize: bool = _f(False, "load a GGUF file's weights dequantized to --dtype "
                                      "instead of keeping its Q4_0/Q4_1/Q8_0/Q4_K blocks (the "
                                      "CPU's default)")
    disable_overlap_schedule: bool = _f(False, "do not overlap host scheduling with device work")
    disable_fused_ops: bool = _f(False, "run the torch references of RMSNorm, SiLU-and-mul and "
                                        "rotary instead of the fused kernels (Triton on GPUs; "
                                        "on the CPU ferry's C++ kernels, decode attention "
                                        "included)")
    # HTTP
    host: str = _f("127.0.0.1", "bind address")
    port: int = _f(30000, "HTTP port", ge=1, le=65535)
    api_key: str | None = _f(None, "require 'Authorization: Bearer KEY'")
    max_request_bytes: int = _f(DEFAULT_MAX_REQUEST_BYTES, "largest accepted request body "
                                "(bytes); for a model that takes images the default grows to "
                                "fit --limit-mm-per-prompt images of --max-image-bytes as "
                                "base64", ge=1)
    max_n: int = _f(16, "largest 'n' accepted per request", ge=1)
    responses_store_size: int = _f(1024, "most Responses API responses kept in memory for "
                                         "previous_response_id and GET /v1/responses/{id} "
                                         "(the oldest is evicted; 0: store nothing); lost at "
                                         "restart", ge=0)
    responses_store_ttl: float = _f(3600.0, "seconds a stored Responses API response lives",
                                    gt=0)
    responses_store_bytes: int = _f(
        1 << 30, "most bytes the stored Responses API responses may take, all together "
                 "(estimated from their JSON size; the oldest are evicted first; a single "
                 "response bigger than this is not stored and says \"store\": false; 0: "
                 "store nothing; default 1 GiB)", ge=0)
    grammar_compile_timeout: float = _f(10.0, "seconds a request's output constraint (JSON "
                                              "schema, regex, grammar) may take to compile; "
                                              "past it the request gets a 400", gt=0)
    shutdown_timeout: float = _f(10.0, "seconds in-flight requests may finish at shutdown",
                                 ge=0)
    header_timeout: float = _f(10.0, "seconds a connection may stay open before a request's "
                                     "headers are complete (then it is closed)", gt=0)
    body_read_timeout: float = _f(30.0, "seconds a request body may take to arrive (then 408)",
                                  gt=0)
    startup_timeout: float = _f(900.0, "seconds to wait for the engine to load and warm up",
                                gt=0)
    log_level: str = _f("info", "log level", ("debug", "info", "warning", "error"))
    tool_call_parser: str = _f("auto", "how tool calls are found in the output of tool_choice "
                                       "'auto': the model family's format, or auto (gpt-oss: "
                                       "gpt-oss; else from the chat template)",
                              TOOL_CALL_PARSERS)
    enable_auto_tool_choice: bool = _f(False, "accepted for vLLM command lines; does nothing: "
                                              "tool_choice 'auto' is always on (with "
                                              "--tool-call-parser or the detected one)")
    reasoning_parser: str | None = _f(None, "how the reasoning is told from the answer in the "
                                            "output: the model family's format, or auto (from "
                                            "the chat template); default: the family's "
                                            "(gpt-oss: gpt-oss), else not separated. "
                                            "Chat's reasoning_content, Responses' reasoning "
                                            "items, Messages' thinking blocks; structured "
                                            "output then constrains the answer only",
                                      REASONING_PARSERS)
    allowed_origins: str = _f("http://localhost:*,http://127.0.0.1:*", "CORS: comma-separated "
                              "origins allowed to call the API from a browser ('*' for any; a "
                              "port may be '*'); other origins get no CORS headers")
    allowed_headers: str = _f("*", "CORS: comma-separated request headers a browser may send "
                              "('*' for any)")
    allowed_methods: str = _f("GET,POST,OPTIONS", "CORS: comma-separated methods a browser may "
                              "use")
    log_requests: bool = _f(False, "log each request's prompt and parameters at arrival, its "
                                   "output text and a summary line (tokens, timings) at the "
                                   "end, at INFO (default: the summary only, at DEBUG)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            md = f.metadata
            typ = hints[f.name]
            if typ is bool:
                parser.add_argument(flag, action="store_true", default=f.default, help=md["help"])
                continue
            base = base_type(typ)
            kw: dict[str, Any] = {"type": base, "default": f.default, "help": md["help"]}
            if getattr(base, "__origin__", None) is tuple:  # tuple[str, ...]: one or more
                kw.update(type=base.__args__[0], nargs="+")
            if "choices" in md:
                kw["choices"] = md["choices"]
            parser.add_argument(flag, **kw)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v
                      for k, v in vars(ns).items() if k in names})

    def replace(self, **kw) -> ServerArgs:
        return dataclasses.replace(self, **kw)

    def __post_init__(self) -> None:
        """Check every field against its ``metadata``: ``choices``, and the bounds ``ge``,
        ``gt``, ``le`` (None passes where None is the default). ``ferry serve`` turns the
        error into a usage error (exit code 2); ``LLM(...)`` raises it.

        Raises:
            ValueError: naming the flag, e.g. ``--max-running-requests must be >= 1, got 0``.
        """
        alias = SPECULATIVE_ALIASES.get(self.speculative_algorithm)
        if alias is not None:  # SGLang's NEXTN is ferry's MTP
            object.__setattr__(self, "speculative_algorithm", alias)
        for f in dataclasses.fields(self):
            v, md = getattr(self, f.name), f.metadata
            if v is None and f.default is None:
                continue
            if error := field_error(v, md):
                raise ValueError(f"--{f.name.replace('_', '-')} {error}, got {v!r}")
        if self.max_model_len is not None:  # vLLM's name, folded into --context-length
            if self.context_length not in (None, self.max_model_len):
                raise ValueError(f"--max-model-len {self.max_model_len} and --context-length "
                                 f"{self.context_length} differ (they are one setting)")
            object.__setattr__(self, "context_length", self.max_model_len)
            object.__setattr__(self, "max_model_len", None)
        if self.chat_template is not None and not os.path.isfile(self.chat_template) \
                and not any(m in self.chat_template for m in ("{{", "{%")):
            raise ValueError(f"--chat-template {self.chat_template!r} is neither a file nor a "
                             "Jinja template")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"--ep-size {self.ep_size} must be 1 or equal to --tp-size "
                             f"{self.tp_size} (the experts are partitioned over the "
                             "tensor-parallel ranks)")
        for check in (speculative_error, lora_error, media_error):
            if error := check(self):
                raise ValueError(error)


def request_body_limit(args: ServerArgs, takes_images: bool) -> int:
    """The request-body limit the server applies, in bytes: ``--max-request-bytes``; for a
    model that takes images and the flag at its default, at least what the allowed images
    need as base64 data URLs (4/3 of ``--max-image-bytes`` each, ``--limit-mm-per-prompt``
    of them) plus 1 MiB for the rest of the request (vLLM and SGLang set no limit)."""
    if not takes_images or args.max_request_bytes != DEFAULT_MAX_REQUEST_BYTES:
        return args.max_request_bytes
    need = image_limit(args.limit_mm_per_prompt) * (args.max_image_bytes * 4 // 3 + 4) + (1 << 20)
    return max(args.max_request_bytes, need)


def chat_template_text(value: str) -> str:
    """The Jinja text of ``--chat-template``: the file's contents when ``value`` names a
    file, else ``value`` itself (an inline template).

    Raises:
        OSError: the file cannot be read.
    """
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def ignored_flag_notes(args: ServerArgs) -> list[str]:
    """One log line per accepted no-op flag that was given (``--trust-remote-code``,
    ``--enable-auto-tool-choice``)."""
    notes = []
    if args.trust_remote_code:
        notes.append("--trust-remote-code: ignored (ferry runs no model code from "
                     "checkpoints)")
    if args.enable_auto_tool_choice:
        notes.append("--enable-auto-tool-choice: ignored (tool_choice 'auto' is always on)")
    return notes


def prefill_budget(args: ServerArgs, device_type: str) -> int:
    """Prompt tokens one step may prefill, over all its requests: --chunked-prefill-size (or
    the device default; -1: no chunking, --max-prefill-tokens) capped by
    --max-prefill-tokens; at least 1."""
    if args.chunked_prefill_size == -1:
        return max(1, args.max_prefill_tokens)
    chunk = args.chunked_prefill_size or default_chunked_prefill(device_type)
    return max(1, min(chunk, args.max_prefill_tokens))


def default_chunked_prefill(device_type: str) -> int:
    """Prefill chunk (tokens) when --chunked-prefill-size is not given: 2048 on every device.

    On the CPU this was 256 until the prepacked GEMMs (issue 15): oneDNN's bf16 GEMM runs at
    ~250 GFLOP/s with 256 rows and ~380 with 2048 on the 2-core CI machine, and 64 x 256-token
    prompts served in 26.2 s with 2048-token chunks against 30.6 s with 256 (median TTFT
    8.6 against 11.6 s; docs/benchmarks.md). The price: a 2048-token step stalls the running
    streams for ~1.2 s in bf16 (~3 s in fp32); ``--chunked-prefill-size 256`` keeps them
    smooth."""
    del device_type
    return 2048


