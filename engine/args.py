"""``ServerArgs``: every knob of ferry in one frozen dataclass.

The argparse parser is generated from the fields: the flag is the field name with dashes,
the help text is the field's ``metadata["help"]``, and ``choices`` come from
``metadata["choices"]``. Booleans become ``--flag`` switches. ``__post_init__`` checks the
choices and the bounds ``metadata["ge" | "gt" | "le"]``, so ``LLM(...)`` (which bypasses
argparse) and ``ferry serve`` reject the same values with the same message.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import re
from dataclasses import dataclass, field
from typing import Any, get_type_hints

#: --speculative-algorithm's choices (SGLang's names)
SPECULATIVE_ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "STANDALONE", "MTP", "NEXTN")
SPECULATIVE_BUILT = ("NGRAM", "EAGLE", "EAGLE3", "STANDALONE", "MTP")
#: SGLang's other names of an algorithm (``ServerArgs`` keeps the name on the right)
SPECULATIVE_ALIASES = {"NEXTN": "MTP"}
#: the algorithms whose drafts come from a model (a draft forward per draft token)
SPECULATIVE_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "MTP")
#: the algorithms that need --speculative-draft-model-path (MTP reads the target's own
#: checkpoint unless one is given)
SPECULATIVE_DRAFT_PATH_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
#: --speculative-num-draft-tokens when not given
DEFAULT_NUM_DRAFT_TOKENS = 4
#: --max-lora-rank without --lora-paths to take it from
DEFAULT_MAX_LORA_RANK = 16
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


def _f(default: Any, help: str, choices: tuple | None = None, **kw) -> Any:
    """A field with its CLI help, its ``choices`` and further metadata in ``kw``: the bounds
    ``ge``, ``gt`` and ``le`` that ``ServerArgs.__post_init__`` checks."""
    md = {"help": help}
    if choices:
        md["choices"] = choices
    md.update(kw)
    return field(default=default, metadata=md)


#: ``--max-request-bytes`` by default (a text model; see :func:`request_body_limit`)
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ServerArgs:
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
                                                "(default: 2048, as vLLM's CPU and GPU defaults)",
                                            ge=1)
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
    # speculative decoding (SGLang's flag names; engine/speculative/)
    speculative_algorithm: str | None = _f(
        None, "speculative decoding: NGRAM (draft tokens copied from the request's own prompt "
              "and output, no draft model), EAGLE / EAGLE3 (a draft head over the target's "
              "hidden states), STANDALONE (a smaller model with the same vocabulary) or MTP (the "
              "target checkpoint's own multi-token-prediction layer: DeepSeek-V3, "
              "Qwen3-Next / Qwen3.5; NEXTN is an alias); unset: off", SPECULATIVE_ALGORITHMS)
    speculative_num_draft_tokens: int | None = _f(
        None, "draft tokens proposed per request and step; one verify forward scores them "
              f"all (default: {DEFAULT_NUM_DRAFT_TOKENS}; EAGLE/EAGLE3/STANDALONE: "
              "--speculative-num-steps, or that plus 1 as SGLang counts the verified token)",
        ge=1, le=64)
    speculative_num_steps: int | None = _f(
        None, "EAGLE/EAGLE3/STANDALONE/MTP: draft forwards per step, one draft token each (a "
              "chain; default: --speculative-num-draft-tokens, else "
              f"{DEFAULT_NUM_DRAFT_TOKENS})", ge=1, le=64)
    speculative_eagle_topk: int | None = _f(
        None, "EAGLE/EAGLE3/MTP: candidates per draft step (1 = a chain, the only shape "
              "built)",
        ge=1, le=64)
    speculative_draft_model_path: str | None = _f(
        None, "EAGLE, EAGLE3, STANDALONE: the draft model's checkpoint; MTP: a checkpoint "
              "holding the MTP layer's tensors under the target's names (default: the "
              "target's own)")
    speculative_ngram_min_match_window_size: int = _f(
        1, "NGRAM: shortest suffix of the request matched against its earlier tokens", ge=1)
    speculative_ngram_max_match_window_size: int = _f(
        12, "NGRAM: longest suffix matched (the longest window with a match wins; its most "
            "recent match is copied)", ge=1)
    speculative_max_batch_size: int = _f(
        8, "speculate only in decode steps of at most this many requests (larger batches "
           "are compute-bound: a step decodes one token per request)", ge=1)
    # LoRA adapters (SGLang's flag names; engine/lora/)
    lora_paths: tuple[str, ...] | None = _f(
        None, "LoRA adapters (peft directories) to serve: name=path (SGLang's form) or a path "
              "(named after its directory); a request picks one with model 'name' or "
              "'<served model>:name'")
    enable_lora: bool = _f(False, "serve LoRA adapters even without --lora-paths (they come "
                                  "later through POST /load_lora_adapter)")
    max_loras_per_batch: int = _f(8, "LoRA: most distinct adapters in one step (the device "
                                     "slots of every layer)", ge=1, le=64)
    max_loaded_loras: int | None = _f(
        None, "LoRA: most adapters loaded at once (host memory, counting an unloaded one "
              "until the requests on it end; beyond --max-loras-per-batch the least recently "
              "used leave the device; default: no limit)", ge=1)
    max_lora_rank: int | None = _f(
        None, "LoRA: largest adapter rank (the slots' size; default: the largest of "
              f"--lora-paths, else {DEFAULT_MAX_LORA_RANK})", ge=1, le=512)
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
    # image input (server/media/): where images may come from and how big they may be
    allowed_local_media_path: str | None = _f(
        None, "directory under which file:// image URLs may be read (default: none may)")
    allowed_media_domains: tuple[str, ...] | None = _f(
        None, "host names whose http(s) image URLs the server may fetch (default: none; "
              "'*' for any)")
    limit_mm_per_prompt: str = _f("image=4", "most images per prompt, as image=N (or JSON "
                                             "{\"image\": N})")
    max_image_bytes: int = _f(20 << 20, "most bytes of one image (encoded, as sent or "
                                        "fetched)", ge=1)
    max_image_pixels: int = _f(40_000_000, "most pixels (width x height) of one decoded "
                                           "image", ge=1)
    media_fetch_timeout: float = _f(10.0, "seconds an http(s) image may take to download",
                                    gt=0)
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
            base = _base_type(typ)
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
        alias = SPECULATIVE_ALIASES.get(self.speculative_algorithm)
        if alias is not None:  # SGLang's NEXTN is ferry's MTP
            object.__setattr__(self, "speculative_algorithm", alias)
        """Check every field against its ``metadata``: ``choices``, and the bounds ``ge``,
        ``gt``, ``le`` (None passes where None is the default). ``ferry serve`` turns the
        error into a usage error (exit code 2); ``LLM(...)`` raises it.

        Raises:
            ValueError: naming the flag, e.g. ``--max-running-requests must be >= 1, got 0``.
        """
        for f in dataclasses.fields(self):
            v, md = getattr(self, f.name), f.metadata
            if v is None and f.default is None:
                continue
            if error := _field_error(v, md):
                raise ValueError(f"--{f.name.replace('_', '-')} {error}, got {v!r}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"--ep-size {self.ep_size} must be 1 or equal to --tp-size "
                             f"{self.tp_size} (the experts are partitioned over the "
                             "tensor-parallel ranks)")
        if error := _speculative_error(self):
            raise ValueError(error)
        if error := _lora_error(self):
            raise ValueError(error)
        try:
            image_limit(self.limit_mm_per_prompt)
        except ValueError as exc:
            raise ValueError(f"--limit-mm-per-prompt {exc}") from None


def request_body_limit(args: ServerArgs, takes_images: bool) -> int:
    """The request-body limit the server applies, in bytes: ``--max-request-bytes``; for a
    model that takes images and the flag at its default, at least what the allowed images
    need as base64 data URLs (4/3 of ``--max-image-bytes`` each, ``--limit-mm-per-prompt``
    of them) plus 1 MiB for the rest of the request (vLLM and SGLang set no limit)."""
    if not takes_images or args.max_request_bytes != DEFAULT_MAX_REQUEST_BYTES:
        return args.max_request_bytes
    need = image_limit(args.limit_mm_per_prompt) * (args.max_image_bytes * 4 // 3 + 4) + (1 << 20)
    return max(args.max_request_bytes, need)


def image_limit(spec: str) -> int:
    """The images per prompt that ``--limit-mm-per-prompt`` allows (``image=N`` or JSON
    ``{"image": N}``; other modalities are refused).

    Raises:
        ValueError: a malformed value, another modality, a negative count."""
    import json

    spec = spec.strip()
    try:
        pairs = json.loads(spec) if spec.startswith("{") else dict(
            (k.strip(), int(v)) for k, v in (p.split("=", 1) for p in spec.split(",") if p))
    except (ValueError, TypeError):
        raise ValueError(f"must be image=N or {{\"image\": N}}, got {spec!r}") from None
    if not isinstance(pairs, dict) or set(pairs) - {"image"} or \
            not all(isinstance(v, int) and v >= 0 for v in pairs.values()):
        raise ValueError(f"takes image=N (N >= 0; only images are read), got {spec!r}")
    return int(pairs.get("image", 0))


def prefill_budget(args: ServerArgs, device_type: str) -> int:
    """Prompt tokens one step may prefill, over all its requests: --chunked-prefill-size (or
    the device default) capped by --max-prefill-tokens; at least 1."""
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


def num_draft_tokens(args: ServerArgs) -> int:
    """Draft tokens per request and speculative step (0 when speculation is off): a model
    proposer's chain is ``--speculative-num-steps`` long (one token per draft forward)."""
    if not args.speculative_algorithm:
        return 0
    if args.speculative_algorithm in SPECULATIVE_MODEL_ALGORITHMS and args.speculative_num_steps:
        return args.speculative_num_steps
    return args.speculative_num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS


def _speculative_error(a: ServerArgs) -> str | None:
    """What is wrong with the combination of --speculative-* flags, or None."""
    algo = a.speculative_algorithm
    if algo is None:
        given = [f for f in ("speculative_num_draft_tokens", "speculative_num_steps",
                             "speculative_eagle_topk", "speculative_draft_model_path")
                 if getattr(a, f) is not None]
        if given:
            return (f"--{given[0].replace('_', '-')} needs --speculative-algorithm "
                    f"(one of {', '.join(SPECULATIVE_ALGORITHMS)})")
        return None
    if algo in SPECULATIVE_DRAFT_PATH_ALGORITHMS and not a.speculative_draft_model_path:
        return f"--speculative-algorithm {algo} needs --speculative-draft-model-path"
    if algo == "NGRAM" and a.speculative_draft_model_path:
        return ("--speculative-draft-model-path is not used by --speculative-algorithm NGRAM "
                "(it drafts from the request's own tokens)")
    if algo not in ("EAGLE", "EAGLE3", "MTP") and a.speculative_eagle_topk not in (None, 1):
        return f"--speculative-eagle-topk applies to EAGLE and EAGLE3 (and MTP), not to {algo}"
    if a.speculative_eagle_topk not in (None, 1):
        return ("--speculative-eagle-topk above 1 (a draft tree) is not built: ferry's EAGLE "
                "drafts a chain (--speculative-eagle-topk 1)")
    if algo == "NGRAM" and a.speculative_num_steps is not None:
        return ("--speculative-num-steps is not used by --speculative-algorithm NGRAM (it "
                "proposes --speculative-num-draft-tokens per step without a draft forward)")
    steps, drafts = a.speculative_num_steps, a.speculative_num_draft_tokens
    if steps is not None and drafts is not None and drafts not in (steps, steps + 1):
        return (f"--speculative-num-draft-tokens {drafts} does not fit --speculative-num-steps "
                f"{steps}: a chain of {steps} draft forwards proposes {steps} tokens (pass "
                f"{steps}, or {steps + 1} counting the verified token as SGLang does)")
    if algo in SPECULATIVE_MODEL_ALGORITHMS and (a.tp_size > 1 or a.nnodes > 1):
        return (f"--speculative-algorithm {algo} with --tp-size {a.tp_size} is not built: "
                "the draft model runs on rank 0 only (use NGRAM, or --tp-size 1)")
    if a.speculative_ngram_min_match_window_size > a.speculative_ngram_max_match_window_size:
        return ("--speculative-ngram-min-match-window-size must be <= "
                "--speculative-ngram-max-match-window-size, got "
                f"{a.speculative_ngram_min_match_window_size} > "
                f"{a.speculative_ngram_max_match_window_size}")
    if algo not in SPECULATIVE_BUILT:
        return (f"--speculative-algorithm {algo} is not implemented yet (built: "
                f"{', '.join(SPECULATIVE_BUILT)})")
    return None


#: bound key in a field's metadata -> (its sign in messages, the check)
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le)}


def _field_error(v: Any, md) -> str | None:
    """What is wrong with value ``v`` of a field with metadata ``md``, or None."""
    if "choices" in md and v not in md["choices"]:
        return "must be one of " + ", ".join(map(repr, md["choices"]))
    bounds = [k for k in _BOUNDS if k in md]
    if not bounds:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "must be a number"
    failed = [k for k in bounds if not _BOUNDS[k][1](v, md[k])]  # NaN fails every bound
    if not failed:
        return None
    lo = "ge" if "ge" in md else "gt" if "gt" in md else None
    if lo and "le" in md:
        return f"must be in {'[' if lo == 'ge' else '('}{md[lo]}, {md['le']}]"
    return f"must be {_BOUNDS[failed[0]][0]} {md[failed[0]]}"


def _base_type(typ) -> type:
    args = getattr(typ, "__args__", None)
    if args:
        non_none = [a for a in args if a is not type(None)]
        return non_none[0]
    return typ


def lora_enabled(args: ServerArgs) -> bool:
    """Whether the engine serves LoRA adapters (--lora-paths or --enable-lora)."""
    return bool(args.lora_paths) or args.enable_lora


#: a LoRA adapter's name: 1..256 of these (no ':', SGLang's "base:name" separator; nothing
#: a URL path, a log line or a metric label would escape)
MAX_ADAPTER_NAME_LEN, ADAPTER_NAME_CHARS = 256, "ASCII letters, digits, '.', '_' and '-'"


def adapter_name_error(name: str) -> str | None:
    """What is wrong with a LoRA adapter name (``--lora-paths``, ``lora_name``), or None:
    empty, over ``MAX_ADAPTER_NAME_LEN`` characters, or one outside ``ADAPTER_NAME_CHARS``."""
    shown = name if len(name) <= 64 else name[:64] + "..."
    if len(name) > MAX_ADAPTER_NAME_LEN:
        return (f"the LoRA adapter name {shown!r} has {len(name)} characters, more than "
                f"{MAX_ADAPTER_NAME_LEN}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        return f"the LoRA adapter name {shown!r} must be 1 or more {ADAPTER_NAME_CHARS}"
    return None


def lora_path_items(paths) -> list[tuple[str, str]]:
    """``--lora-paths`` as ``(name, path)``: ``name=path``, or a path named after its last
    directory (SGLang's forms).

    Raises:
        ValueError: naming --lora-paths, for an empty name or path, a name with ':', a
            name ``adapter_name_error`` refuses or a name given twice.
    """
    out: list[tuple[str, str]] = []
    for item in paths or ():
        name, eq, path = item.partition("=")
        if not eq:
            path = item
            name = item.rstrip("/").rpartition("/")[2]
        if not name or not path or ":" in name:
            raise ValueError(f"--lora-paths {item!r}: expected name=path or a directory, with "
                             "a name without ':'")
        if (bad := adapter_name_error(name)) is not None:
            raise ValueError(f"--lora-paths {item[:300]!r}: {bad} (give name=path)")
        if name in dict(out):
            raise ValueError(f"--lora-paths: the adapter name {name!r} is given twice")
        out.append((name, path))
    return out


def _lora_error(a: ServerArgs) -> str | None:
    """What is wrong with the --lora-* flags, or None."""
    if not lora_enabled(a):
        given = [f for f in ("max_loaded_loras", "max_lora_rank") if getattr(a, f) is not None]
        if given:
            return f"--{given[0].replace('_', '-')} needs --lora-paths or --enable-lora"
        return None
    try:
        items = lora_path_items(a.lora_paths)
    except ValueError as e:
        return str(e)
    if a.max_loaded_loras is not None and len(items) > a.max_loaded_loras:
        return (f"--lora-paths gives {len(items)} adapters, more than --max-loaded-loras "
                f"{a.max_loaded_loras}")
    if a.speculative_algorithm:
        return ("--lora-paths/--enable-lora with --speculative-algorithm is not built (verify "
                "steps do not apply adapters yet)")
    return None

