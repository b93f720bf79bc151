"""``kernels/triton_check.py``, the triton-xpu guard of the XPU image and ``make install``:
keyed on what the installed ``triton/`` contains and on how many distributions own it, not
on their names. Fake site directories stand in for an XPU install; the real venv has the
CUDA/ROCm build."""

from __future__ import annotations

import pytest

from kernels import triton_check as tc


def _site(tmp_path, backends, dists):
    site = tmp_path / "site"
    for b in backends:
        (site / "triton" / "backends" / b).mkdir(parents=True)
    (site / "triton").mkdir(parents=True, exist_ok=True)
    (site / "triton" / "__init__.py").write_text("")
    for name, version in dists:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text("triton/__init__.py,,0\ntriton/backends/__init__.py,,0\n")
    return [str(site)]


def test_clean_xpu_build_passes(tmp_path):
    path = _site(tmp_path, ["intel"], [("triton-xpu", "3.7.2")])
    assert tc.problems(path) == [] and tc.owners(path) == ["triton-xpu"]


def test_renamed_xpu_build_still_passes(tmp_path):
    """pytorch#186209's proposal: the XPU build as ``triton==X+xpu``. A name-based guard
    would uninstall it; this one sees the Intel backend and a single owner."""
    path = _site(tmp_path, ["intel"], [("triton", "3.7.2+xpu")])
    assert tc.problems(path) == []


def test_overlaid_install_fails_even_with_the_intel_backend_left(tmp_path):
    # plain triton installed after triton-xpu: backends/intel is still there, but the
    # package's other files are the CUDA build's
    path = _site(tmp_path, ["intel", "nvidia", "amd"], [("triton-xpu", "3.7.2"),
                                                       ("triton", "3.5.0")])
    (msg,) = tc.problems(path)
    assert "2 distributions (triton, triton-xpu)" in msg
    assert tc.owners(path) == ["triton", "triton-xpu"]


def test_cuda_build_fails_the_intel_check(tmp_path):
    path = _site(tmp_path, ["nvidia", "amd"], [("triton", "3.5.0")])
    (msg,) = tc.problems(path)
    assert "no backends/intel (backends: amd, nvidia)" in msg
    assert tc.problems(path, backend="nvidia") == []


def test_no_triton(tmp_path):
    assert tc.problems([str(tmp_path)]) == ["no triton package is installed"]


def test_cli_on_this_venv(capsys):
    """This venv has the CUDA/ROCm build: the guard says so and names the owner."""
    assert tc.main([]) == 1
    assert "has no backends/intel" in capsys.readouterr().err
    assert tc.main(["--owners"]) == 0
    assert capsys.readouterr().out.split() == tc.owners()
    if tc.owners() == ["triton"]:
        assert tc.main(["--backend", "nvidia"]) == 0


@pytest.mark.parametrize("argv", [["--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit):
        tc.main(argv)
    assert "backends/intel" in capsys.readouterr().out
