"""The CLI is generated from ServerArgs."""

import argparse
import dataclasses

import pytest

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
    assert prefill_budget(ServerArgs(), "cpu") == 256
    assert prefill_budget(ServerArgs(chunked_prefill_size=4096), "cuda") == 4096
    assert prefill_budget(ServerArgs(chunked_prefill_size=4096, max_prefill_tokens=1000),
                          "cuda") == 1000
    assert prefill_budget(ServerArgs(max_prefill_tokens=0), "cpu") == 1


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
