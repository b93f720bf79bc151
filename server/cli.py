"""The ``ferry`` command line: ``ferry serve`` and the benchmark / parity subcommands.

``ferry serve [flags]`` (or ``python -m server [flags]``) starts the OpenAI-compatible
server; its flags come from ``ServerArgs`` (engine/args/). The other subcommands import
their module lazily and call its ``main(argv)``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from typing import NoReturn

#: subcommand -> (module with main(argv), one-line description)
SUBCOMMANDS = {
    "bench-latency": ("bench.bench_latency", "latency of one static batch (prefill + decode)"),
    "bench-offline": ("bench.bench_offline", "offline throughput of the engine (no HTTP)"),
    "bench-serving": ("bench.serving.bench_serving", "load test of a running server over HTTP"),
    "bench-grammar": ("bench.grammar.bench_grammar", "cost of grammar-constrained decoding and compiles"),
    "parity": ("bench.parity", "greedy outputs and logits on two devices (e.g. cpu,cuda)"),
    "quant-parity": ("bench.quant_parity", "FP8 vs float: greedy agreement and next-token KL"),
}

USAGE = """usage: ferry <command> [options]

commands:
  serve           start the OpenAI-compatible HTTP server (ferry serve --help)
{extra}

examples:
  ferry serve                                  # embedded SmolLM2-135M-Instruct on 127.0.0.1:30000
  ferry serve --model-path /models/Llama-3.2-1B-Instruct --device cuda --port 8000
  ferry bench-latency --help
"""


#: ``ServerArgs`` fields only the HTTP server reads: the bench and parity subcommands run
#: the engine in-process and do not offer them as flags
SERVER_ONLY_FIELDS = frozenset({
    "host", "port", "api_key", "max_request_bytes", "max_n", "shutdown_timeout",
    "header_timeout", "body_read_timeout", "startup_timeout", "tool_call_parser",
    "reasoning_parser", "allowed_origins", "allowed_headers", "allowed_methods",
    "log_requests", "served_model_name", "allowed_local_media_path", "allowed_media_domains",
    "limit_mm_per_prompt", "max_image_bytes", "max_image_pixels", "media_fetch_timeout"})


class _EngineFlags:
    """Forwards ``add_argument`` to ``target`` except for the SERVER_ONLY_FIELDS flags."""

    def __init__(self, target):
        self.target = target

    def add_argument(self, flag: str, **kw):
        if flag.removeprefix("--").replace("-", "_") in SERVER_ONLY_FIELDS:
            return None
        return self.target.add_argument(flag, **kw)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``ServerArgs``' engine flags (not the HTTP server's, SERVER_ONLY_FIELDS) to
    ``parser`` in an "engine options" group; ``ServerArgs.from_cli_args`` fills the
    rest with their defaults. For the bench and parity subcommands."""
    from engine.args import ServerArgs

    group = parser.add_argument_group("engine options (as for ferry serve)")
    ServerArgs.add_cli_args(_EngineFlags(group))
    return parser


def _usage() -> str:
    extra = "\n".join(f"  {name:<15} {desc}" for name, (_, desc) in SUBCOMMANDS.items())
    return USAGE.format(extra=extra)


def serve_parser() -> argparse.ArgumentParser:
    """The ``ferry serve`` argument parser (flags generated from ``ServerArgs``)."""
    from engine.args import ServerArgs

    parser = _ServeParser(prog="ferry serve", description=SERVE_DESCRIPTION,
                          formatter_class=_HelpFormatter)
    return ServerArgs.add_cli_args(parser)


#: ``ferry serve --help``'s text above the flags: every route of server/app.py (a test
#: compares the two)
SERVE_DESCRIPTION = """\
Start ferry's OpenAI-compatible server. Routes (docs/usage.md#endpoints):
  POST /v1/chat/completions, /v1/completions, /v1/responses
  GET  /v1/responses/{response_id}, /v1/responses/{response_id}/input_items
  DELETE /v1/responses/{response_id}; POST /v1/responses/{response_id}/cancel
  POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API)
  POST /v1/embeddings, /v1/rerank, /rerank, /v1/score (embedding and scoring models)
  POST /v1/tokenize, /v1/detokenize (also /tokenize, /detokenize)
  GET  /v1/models, /v1/models/{model_id}
  GET  /health, /server_info, /metrics
  GET  /health_generate, /get_server_info, /model_info, /get_model_info, /get_load (SGLang's)
  POST /invocations; GET, POST /ping; GET /version, /load (vLLM's)
  POST /flush_cache
  POST /load_lora_adapter, /unload_lora_adapter (SGLang's; vLLM's: /v1/load_lora_adapter,
       /v1/unload_lora_adapter)
  GET  /openapi.json, /docs"""


class _ServeParser(argparse.ArgumentParser):
    """argparse whose usage errors print the message first, then a one-line usage (argparse
    prints the whole flag synopsis, ~40 lines, before the message, which buried it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"usage: {self.prog} [options]  ({self.prog} --help lists every flag)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` unless the help already says what the default is, or there is
    none to show (None, False)."""

    def _fill_text(self, text, width, indent):
        return "\n".join(indent + line for line in text.splitlines())  # kept as written

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False):
            return text
        return super()._get_help_string(action)


def serve(argv: list[str]) -> int:
    """Parse ``ferry serve`` flags, run the server; returns the exit code.

    A flag out of its bounds (checked by ``ServerArgs``) is a usage error: the message on
    stderr and ``SystemExit(2)``, as argparse does for its own errors.
    """
    from engine.args import ServerArgs
    from server.http.cors import cors_options

    parser = serve_parser()
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)  # checks every bound and choice
        cors_options(args)  # --allowed-origins entries
    except ValueError as exc:
        parser.error(str(exc))  # usage + "ferry serve: error: ...", exit code 2
    from engine.executor.preflight import check_start_up, one_line
    from engine.scheduler.build import check_environment
    from server.app import model_name_of
    from server.openai.lora import check_adapter_names

    try:
        check_environment(args)  # device, attention backend, model path: before any child
        check_adapter_names(args, model_name_of(args))  # --lora-paths names like the base's
        check_start_up(args, given_fields(argv))  # adapters, the model's config and classes
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        parser.error(one_line(str(exc)))

    from server.launch import launch_server

    return launch_server(args)


def given_fields(argv: list[str]) -> frozenset[str]:
    """The ``ServerArgs`` fields given on the ``ferry serve`` command line (parsed again with
    no defaults, so a flag given with its default value counts as given)."""
    parser = serve_parser()
    for action in parser._actions:  # argparse has no public way to drop every default
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv)))


def exit_now(code: int) -> NoReturn:
    """End a ``ferry serve`` process with ``code`` once :func:`serve` returned: logs and
    standard streams flushed, then ``os._exit``. By then the server has stopped its children,
    removed its IPC directories and logged its last line; the interpreter's teardown (torch's
    and transformers' modules unloaded one by one) only cost ~1 s of CPU, several seconds on
    a busy machine, before the exit status was known."""
    import logging
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing to flush
            stream.flush()
    os._exit(code)


def run_subcommand(name: str, argv: list[str]) -> int:
    """Import the subcommand's module and run its ``main(argv)``; returns the exit code."""
    module_name = SUBCOMMANDS[name][0]
    # as for the server's processes (server/launch.py): idle OpenMP threads sleep, so a
    # benchmark beside another busy process measures what a server there would do; set
    # before the module imports torch (OpenMP reads it when it loads)
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"ferry {name}: cannot import {module_name} ({exc}); this part of ferry is "
              "not installed or not written yet", file=sys.stderr)
        return 2
    main = getattr(module, "main", None)
    if main is None:
        print(f"ferry {name}: {module_name} has no main(argv)", file=sys.stderr)
        return 2
    rc = main(argv)
    return rc if isinstance(rc, int) else 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``ferry`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(_usage(), file=sys.stderr)
        sys.exit(2)
    cmd, rest = argv[0], argv[1:]
    if cmd in ("-h", "--help", "help"):
        print(_usage())
        sys.exit(0)
    if cmd == "serve":
        exit_now(serve(rest))
    if cmd in SUBCOMMANDS:
        sys.exit(run_subcommand(cmd, rest))
    print(f"ferry: unknown command '{cmd}'\n\n{_usage()}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
