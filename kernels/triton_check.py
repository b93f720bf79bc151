"""Which Triton is installed: the check behind the XPU image's and ``make install``'s guard.

triton-xpu (formerly pytorch-triton-xpu, the Intel GPU build that each torch XPU release
pins) and the CUDA/ROCm ``triton`` install the same Python package, ``triton/``. Whichever
is installed last overwrites the other's files and leaves the rest in place, so a check of
distribution names (``pip show triton``) is wrong both ways: it cannot tell an overlaid
install from a clean one, and once PyTorch publishes the XPU build as ``triton==X+xpu``
(proposed in pytorch#186209) it would take the XPU build itself for the CUDA one. This
checks what the package contains instead:

- the ``triton/`` that ``import triton`` would load has ``backends/intel`` (the Intel
  backend of triton-xpu);
- exactly one installed distribution owns ``triton/__init__.py`` (two or more: a later
  install overlaid an earlier one, whatever their names).

``python -m kernels.triton_check`` exits 0 when both hold, else 1 with the reasons;
``--owners`` prints the distributions that own ``triton/__init__.py``, one per line, which
the image and the Makefile uninstall before reinstalling triton-xpu. It never imports
``triton`` (an overlaid package may not import) and needs no GPU.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.metadata as md
import os
import sys


def triton_dir(path: list[str] | None = None) -> str | None:
    """The directory of the ``triton`` package that an import would load, or None."""
    spec = importlib.machinery.PathFinder.find_spec("triton", path)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def owners(path: list[str] | None = None) -> list[str]:
    """The installed distributions (by name) whose files include ``triton/__init__.py``."""
    names = set()
    for d in md.distributions(**({"path": path} if path is not None else {})):
        if any(str(f).replace(os.sep, "/") == "triton/__init__.py" for f in d.files or []):
            names.add(d.metadata["Name"])
    return sorted(names)


def problems(path: list[str] | None = None, backend: str = "intel") -> list[str]:
    """Why the installed Triton is not a clean build with ``backends/<backend>`` (empty: it
    is)."""
    out = []
    where = triton_dir(path)
    if where is None:
        return ["no triton package is installed"]
    if not os.path.isdir(os.path.join(where, "backends", backend)):
        have = sorted(os.listdir(os.path.join(where, "backends"))) \
            if os.path.isdir(os.path.join(where, "backends")) else []
        out.append(f"{where} has no backends/{backend} (backends: {', '.join(have) or 'none'})"
                   f": this is not the {backend} build")
    own = owners(path)
    if len(own) > 1:
        out.append(f"triton/ is installed by {len(own)} distributions ({', '.join(own)}): the "
                   "last one overlaid the others' files")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.triton_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--owners", action="store_true",
                   help="print the distributions that own triton/__init__.py")
    p.add_argument("--backend", default="intel", help="the backends/ folder required")
    ns = p.parse_args(argv)
    if ns.owners:
        print("\n".join(owners()))
        return 0
    found = problems(backend=ns.backend)
    for line in found:
        print(f"triton_check: {line}", file=sys.stderr)
    if not found:
        print(f"triton_check: {triton_dir()} ({', '.join(owners())}) has backends/"
              f"{ns.backend}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
