"""The CLI is generated from ServerArgs."""

import argparse
import dataclasses
import os

import pytest

import engine
from engine.args import ServerArgs


def test_every_field_has_a_flag_and_round_trips():
    p = ServerArgs.add_cli_args(argparse.ArgumentParser())
    ns = p.parse_args(["--port", "1234", "--max-total-tokens", "4096", "--device", "cpu",
                       "--disable-cuda-graph", "--api-key", "k"])
    a = ServerArgs.from_cli_args(ns)
    assert a.port == 1234 and a.max_total_tokens == 4096 and a.device == "cpu"
    assert a.disable_cuda_graph is True and a.api_key == "k"
    assert a.host == "127.0.0.1" and a.model_path is None
    flags = {s for act in p._actions for s in act.option_strings}
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in flags
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "tpu"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.port = 1


def test_prefill_budget_caps_the_chunk():
    from engine.args import ServerArgs, prefill_budget

    assert prefill_budget(ServerArgs(), "cuda") == 2048          # the GPU default chunk
    assert prefill_budget(ServerArgs(), "cpu") == 2048           # the same on the CPU
    assert prefill_budget(ServerArgs(chunked_prefill_size=4096), "cuda") == 4096
    assert prefill_budget(ServerArgs(chunked_prefill_size=4096, max_prefill_tokens=1000),
                          "cuda") == 1000
    assert prefill_budget(ServerArgs(max_prefill_tokens=1), "cpu") == 1


@pytest.mark.parametrize("flag", ["--max-running-requests", "--cuda-graph-max-bs",
                                  "--chunked-prefill-size", "--piecewise-graph-max-tokens",
                                  "--max-prefill-tokens", "--decode-attention-waves",
                                  "--max-total-tokens", "--page-size"])
def test_serve_rejects_counts_below_one(flag, capsys):
    from server.cli import serve

    for value in ("-5", "0"):
        with pytest.raises(SystemExit) as exc:
            serve([flag, value])
        assert exc.value.code == 2
        assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_serve_help_shows_each_default_once(capsys):
    from server.cli import serve_parser

    text = " ".join(serve_parser().format_help().split())
    assert "(default: from the model) (default" not in text
    assert "--kv-cache-dtype {auto,fp8,fp8_e4m3,fp8_e5m2}" in text
    assert "(default: 30000)" in text   # plain defaults are still shown


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-read-timeout",
                                  "--startup-timeout"])
def test_serve_rejects_timeouts_that_are_not_positive(flag, capsys):
    from server.cli import serve

    with pytest.raises(SystemExit) as exc:
        serve([flag, "0"])
    assert exc.value.code == 2 and f"{flag} must be > 0" in capsys.readouterr().err


# ---- bounds live in ServerArgs: LLM(...) and ferry serve get the same errors ---------------

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# (field, the last good value, the first bad value), hand-picked per bound
BOUNDARIES = [
    ("max_running_requests", 1, 0), ("max_queued_requests", 1, 0), ("max_n", 1, 0),
    ("max_request_bytes", 1, 0), ("cuda_graph_max_bs", 1, 0), ("max_prefill_tokens", 1, 0),
    ("chunked_prefill_size", 1, 0), ("piecewise_graph_max_tokens", 1, 0),
    ("decode_attention_waves", 1, 0), ("max_total_tokens", 1, -3), ("page_size", 1, 0),
    ("context_length", 1, 0), ("port", 1, 0), ("port", 65535, 65536),
    ("mem_fraction_static", 1.0, 1.01), ("mem_fraction_static", 0.01, 0.0),
    ("shutdown_timeout", 0.0, -0.5), ("header_timeout", 0.01, 0.0),
    ("body_read_timeout", 0.01, -1.0), ("startup_timeout", 0.01, 0.0),
    ("responses_store_bytes", 0, -1),
]


def test_responses_store_bytes_flag(capsys):
    """Issue 41: ``--responses-store-bytes`` bounds the Responses API's store by estimated
    size (default 1 GiB; 0 stores nothing), and ``ferry serve --help`` says so."""
    from server.cli import serve_parser

    assert ServerArgs().responses_store_bytes == 1024 ** 3
    args = serve_parser().parse_args(["--responses-store-bytes", "65536"])
    assert ServerArgs.from_cli_args(args).responses_store_bytes == 65536
    text = " ".join(serve_parser().format_help().split())
    assert "--responses-store-bytes" in text and "default 1 GiB" in text


@pytest.mark.parametrize("name,good,bad", BOUNDARIES)
def test_server_args_checks_its_bounds(name, good, bad):
    assert getattr(ServerArgs(**{name: good}), name) == good
    with pytest.raises(ValueError, match=f"^{_flag(name)} must be .*, got {bad}$"):
        ServerArgs(**{name: bad})


def test_bound_messages_name_the_flag_and_the_value():
    cases = {
        "max_running_requests": (0, "--max-running-requests must be >= 1, got 0"),
        "port": (70000, "--port must be in [1, 65535], got 70000"),
        "mem_fraction_static": (0, "--mem-fraction-static must be in (0, 1], got 0"),
        "shutdown_timeout": (-1, "--shutdown-timeout must be >= 0, got -1"),
        "startup_timeout": (0, "--startup-timeout must be > 0, got 0"),
        "max_n": ("16", "--max-n must be a number, got '16'"),    # LLM bypasses argparse
        "device": ("tpu", "--device must be one of 'auto', 'cuda', 'xpu', 'cpu', got 'tpu'"),
    }
    for name, (value, msg) in cases.items():
        with pytest.raises(ValueError) as ei:
            ServerArgs(**{name: value})
        assert str(ei.value) == msg
    for nan_field in ("mem_fraction_static", "header_timeout", "shutdown_timeout"):
        with pytest.raises(ValueError, match=_flag(nan_field)):
            ServerArgs(**{nan_field: float("nan")})
    with pytest.raises(ValueError, match="--max-running-requests"):
        ServerArgs().replace(max_running_requests=0)       # replace() checks too


def test_every_choices_field_is_checked():
    fields = [f for f in dataclasses.fields(ServerArgs) if "choices" in f.metadata]
    assert {"device", "dtype", "load_format", "kv_cache_dtype", "log_level"} <= \
        {f.name for f in fields}
    for f in fields:
        for ok in f.metadata["choices"]:
            if f.name == "speculative_algorithm" and ok != "NGRAM":
                continue  # needs a draft model: tested below
            assert getattr(ServerArgs(**{f.name: ok}), f.name) == ok
        with pytest.raises(ValueError, match=f"^{_flag(f.name)} must be one of .*'bogus'$"):
            ServerArgs(**{f.name: "bogus"})


def test_llm_gets_the_same_bound_error_before_loading_anything(monkeypatch):
    import engine.scheduler.build as build
    from engine import LLM

    def no_load(args):
        raise AssertionError("the model must not load for bad arguments")

    monkeypatch.setattr(build, "build_engine", no_load)
    with pytest.raises(ValueError) as ei:
        LLM(max_running_requests=0, device="cpu")
    assert str(ei.value) == "--max-running-requests must be >= 1, got 0"
    with pytest.raises(ValueError, match="^--dtype must be one of"):
        LLM(dtype="fp64")


@pytest.mark.parametrize("argv,msg", [
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1, got 0"),
    (["--port", "0"], "--port must be in [1, 65535], got 0"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1], got 1.5"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static must be in (0, 1], got 0.0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0, got -1.0"),
    (["--context-length", "0"], "--context-length must be >= 1, got 0"),
])
def test_serve_turns_bound_errors_into_usage_errors(argv, msg, capsys):
    from server.cli import serve

    with pytest.raises(SystemExit) as exc:
        serve(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith(f"ferry serve: error: {msg}\n")  # the message first


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu", "--attention-backend", "triton"], "needs a CUDA or XPU device"),
    (["--attention-backend", "flashinfer"], "unknown attention backend 'flashinfer'"),
    (["--model-path", "/nonexistent/model"], "/nonexistent/model"),
])
def test_serve_checks_the_machine_before_starting_anything(argv, message, capsys,
                                                           monkeypatch):
    """Errors that depend on the device or the files are usage errors too (exit 2, one line),
    raised before the engine process is spawned."""
    import server.launch
    from server.cli import serve

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(server.launch, "launch_server",
                        lambda args: pytest.fail("the server must not start"))
    with pytest.raises(SystemExit) as exc:
        serve(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["--model-path"], "argument --model-path: expected one argument"),
    (["--port", "0"], "--port must be in [1, 65535], got 0"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_serve_usage_errors_put_the_message_first(argv, message, capsys):
    """A usage error is the message on the first line and a one-line usage, not argparse's
    ~40-line flag synopsis before the message (issue 34, kind 8)."""
    from server.cli import serve

    with pytest.raises(SystemExit) as exc:
        serve(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"ferry serve: error: {message}")
    assert len(lines) == 2 and lines[1].startswith("usage: ferry serve [options]")


def test_serve_help_lists_every_route(capsys):
    """``ferry serve --help`` names every route of the app (it lacked /v1/responses and
    /flush_cache)."""
    import re

    from app_helpers import make_app

    from server.cli import SERVE_DESCRIPTION, serve_parser

    app, _ = make_app()
    routes = {r.path.replace(":path", "") for r in app.routes}
    listed = set(re.findall(r"/[\w/{}.]+", SERVE_DESCRIPTION)) - {"/usage.md"}
    assert listed == routes
    assert SERVE_DESCRIPTION.splitlines()[1] in serve_parser().format_help()


@pytest.mark.parametrize("config", ["dir", "file"])
def test_serve_refuses_a_config_without_weights(config, tmp_path, capsys, monkeypatch):
    """A config-only model (config.json and tokenizer, no weights) without ``--load-format
    dummy`` is a one-line start-up error that names the flag, before any process starts
    (it was a traceback from the engine process)."""
    import shutil

    import server.launch
    from server.cli import serve

    src = os.path.join(os.path.dirname(engine.__file__), "configs", "llama-tiny.json")
    shutil.copy(src, tmp_path / "config.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    path = str(tmp_path if config == "dir" else tmp_path / "config.json")
    monkeypatch.setattr(server.launch, "launch_server",
                        lambda args: pytest.fail("the server must not start"))
    with pytest.raises(SystemExit) as exc:
        serve(["--device", "cpu", "--model-path", path])
    assert exc.value.code == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"ferry serve: error: {path} is a model config without weights")
    assert "--load-format dummy" in first
    monkeypatch.setattr(server.launch, "launch_server", lambda args: 0)
    assert serve(["--device", "cpu", "--model-path", path, "--load-format", "dummy"]) == 0


@pytest.mark.parametrize("kw, message", [
    ({"speculative_algorithm": "EAGLE"},
     "--speculative-algorithm EAGLE needs --speculative-draft-model-path"),
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/m",
      "speculative_eagle_topk": 4}, "--speculative-eagle-topk above 1"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/m",
      "speculative_num_steps": 3, "speculative_num_draft_tokens": 6},
     "--speculative-num-draft-tokens 6 does not fit --speculative-num-steps 3"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3},
     "--speculative-num-steps is not used by --speculative-algorithm NGRAM"),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/m", "tp_size": 2},
     "--speculative-algorithm EAGLE with --tp-size 2 is not built"),
    ({"speculative_num_draft_tokens": 4}, "--speculative-num-draft-tokens needs "
                                          "--speculative-algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/m"},
     "--speculative-draft-model-path is not used by --speculative-algorithm NGRAM"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4},
     "--speculative-eagle-topk applies to EAGLE and EAGLE3"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 4,
      "speculative_ngram_max_match_window_size": 2},
     "--speculative-ngram-min-match-window-size must be <= "
     "--speculative-ngram-max-match-window-size"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0},
     "--speculative-num-draft-tokens must be in [1, 64]"),
    ({"speculative_algorithm": "MEDUSA"}, "--speculative-algorithm must be one of"),
])
def test_speculative_flags_fail_naming_the_flags(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ServerArgs(**kw)


def test_speculative_ngram_defaults():
    from engine.args import num_draft_tokens

    assert num_draft_tokens(ServerArgs()) == 0
    a = ServerArgs(speculative_algorithm="NGRAM")
    assert num_draft_tokens(a) == 4 and a.speculative_max_batch_size == 8
    assert (a.speculative_ngram_min_match_window_size,
            a.speculative_ngram_max_match_window_size) == (1, 12)
    assert num_draft_tokens(a.replace(speculative_num_draft_tokens=7)) == 7


def test_speculative_chain_length_of_a_draft_model():
    from engine.args import num_draft_tokens

    a = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/m")
    assert num_draft_tokens(a) == 4
    assert num_draft_tokens(a.replace(speculative_num_steps=3)) == 3
    # SGLang's count (the verified token included) names the same chain
    assert num_draft_tokens(a.replace(speculative_num_steps=3,
                                      speculative_num_draft_tokens=4)) == 3
    assert num_draft_tokens(a.replace(speculative_num_draft_tokens=5)) == 5


def test_serve_help_names_every_gguf_block_type_kept():
    """Issue 41 item 5g: ``ferry serve --help`` names every GGUF type whose blocks ferry keeps
    (``--quantization gguf``, ``--gguf-dequantize``); it omitted Q4_K."""
    from engine.layers.quantization.gguf import BLOCK_TYPES
    from server.cli import serve_parser

    parser = serve_parser()
    text = " ".join(parser.format_help().split())
    for flag in ("--quantization", "--gguf-dequantize"):
        (helped,) = [a.help for a in parser._actions if flag in a.option_strings]
        assert " ".join(helped.split()) in text
        for name, *_ in BLOCK_TYPES.values():
            assert name in helped, (flag, name)


def test_request_body_limit_grows_for_an_image_model_at_the_default():
    from engine.args import DEFAULT_MAX_REQUEST_BYTES, request_body_limit

    args = ServerArgs(limit_mm_per_prompt="image=2", max_image_bytes=3_000_000)
    assert request_body_limit(args, takes_images=False) == DEFAULT_MAX_REQUEST_BYTES
    # two images of 3,000,000 bytes as base64 (4,000,000 + 4 each) and 1 MiB of text
    assert request_body_limit(args, takes_images=True) == 2 * 4_000_004 + 1_048_576
    # an explicit limit is the user's
    assert request_body_limit(args.replace(max_request_bytes=1000), takes_images=True) == 1000
    small = ServerArgs(limit_mm_per_prompt="image=1", max_image_bytes=1000)
    assert request_body_limit(small, takes_images=True) == DEFAULT_MAX_REQUEST_BYTES


# ---- vLLM/SGLang flags a new user brings along ---------------------------------------------

def _parse(argv):
    from server.cli import serve_parser

    return ServerArgs.from_cli_args(serve_parser().parse_args(argv))


def test_max_model_len_is_context_length():
    assert _parse(["--max-model-len", "4096"]).context_length == 4096
    assert ServerArgs(max_model_len=512, context_length=512).context_length == 512
    a = ServerArgs(max_model_len=512)
    assert a.replace(context_length=1024).context_length == 1024   # folded: replace works
    with pytest.raises(ValueError, match="--max-model-len 512 and --context-length 1024"):
        ServerArgs(max_model_len=512, context_length=1024)
    with pytest.raises(ValueError, match="^--max-model-len must be >= 1, got 0$"):
        ServerArgs(max_model_len=0)


def test_no_op_flags_are_accepted_and_noted():
    from engine.args import ignored_flag_notes

    a = _parse(["--trust-remote-code", "--enable-auto-tool-choice"])
    assert a.trust_remote_code and a.enable_auto_tool_choice
    notes = ignored_flag_notes(a)
    assert len(notes) == 2 and "runs no model code" in notes[0]
    assert ignored_flag_notes(ServerArgs()) == []


def test_chunked_prefill_size_minus_one_turns_chunking_off(capsys):
    from engine.args import prefill_budget
    from server.cli import serve

    a = _parse(["--chunked-prefill-size", "-1"])
    assert a.chunked_prefill_size == -1
    assert prefill_budget(a, "cuda") == 16384                  # --max-prefill-tokens
    assert prefill_budget(a.replace(max_prefill_tokens=32768), "cpu") == 32768
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit) as exc:
            serve(["--chunked-prefill-size", bad])
        assert exc.value.code == 2
        assert "--chunked-prefill-size must be >= 1 (or -1: no chunking)" in \
            capsys.readouterr().err


def test_chat_template_is_a_file_or_inline_jinja(tmp_path):
    from engine.args import chat_template_text

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}!")
    assert chat_template_text(_parse(["--chat-template", str(f)]).chat_template) == \
        "{{ messages[0].content }}!"
    assert chat_template_text("{% for m in messages %}x{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="--chat-template 'nope.jinja' is neither"):
        ServerArgs(chat_template="nope.jinja")
