"""The house rules of the code (docs/architecture.md, "rooms by responsibility") hold in
engine/, server/ and kernels/, read from the source with ``ast``:

- no module over 600 lines;
- no function or method over 80 lines (``def`` line to last line, nested functions counted in
  their parent too); Triton kernels (decorated ``@triton.jit`` / ``@jit``) are exempt;
- no class built on a mixin (a base class whose name ends in ``Mixin``): compose objects;
- the scheduler and the speculative worker read their runner through the ``StepRunner``
  protocol (engine/executor/step_runner.py), never by ``getattr(runner, ...)``.

Each failure lists every offender (path, name, size) and prints them too, so a run with
``-s`` or ``-rx`` shows what is left to split.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "kernels")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80



def _modules() -> list[tuple[str, str, ast.Module]]:
    """(path relative to the repository, source, parsed tree) of every module checked."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            src = path.read_text()
            out.append((str(path.relative_to(ROOT)), src, ast.parse(src, filename=str(path))))
    return out


def _is_jit(decorator: ast.expr) -> bool:
    """``@triton.jit``, ``@jit``, or either called with options (``@triton.jit(...)``)."""
    if isinstance(decorator, ast.Call):
        decorator = decorator.func
    return (isinstance(decorator, ast.Name) and decorator.id == "jit") or \
        (isinstance(decorator, ast.Attribute) and decorator.attr == "jit")


def _base_name(base: ast.expr) -> str:
    if isinstance(base, ast.Subscript):  # Generic[...]-style bases
        base = base.value
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    return ""


def _walk_defs(node: ast.AST, prefix: str = ""):
    """Yield ``(qualified name, node)`` for every function and class under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + child.name
            yield name, child
            yield from _walk_defs(child, name + ".")
        else:
            yield from _walk_defs(child, prefix)


def _report(offenders: list[str], rule: str) -> str:
    text = f"{len(offenders)} offender(s) of the rule '{rule}':\n  " + "\n  ".join(offenders)
    print(text)
    return text


def long_modules() -> list[str]:
    return [f"{path}: {n} lines" for path, src, _ in _modules()
            if (n := len(src.splitlines())) > MAX_MODULE_LINES]


def long_functions() -> list[str]:
    out = []
    for path, _, tree in _modules():
        for name, node in _walk_defs(tree):
            if isinstance(node, ast.ClassDef) or any(_is_jit(d) for d in node.decorator_list):
                continue
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno} {name}: {n} lines")
    return out


def mixin_classes() -> list[str]:
    out = []
    for path, _, tree in _modules():
        for name, node in _walk_defs(tree):
            if isinstance(node, ast.ClassDef):
                mixins = [b for b in map(_base_name, node.bases) if b.endswith("Mixin")]
                if mixins:
                    out.append(f"{path}:{node.lineno} {name}({', '.join(mixins)})")
    return out


def test_no_module_over_600_lines():
    offenders = long_modules()
    assert offenders == [], _report(offenders, f"no module over {MAX_MODULE_LINES} lines")


def test_no_function_over_80_lines():
    offenders = long_functions()
    assert offenders == [], _report(
        offenders, f"no function over {MAX_FUNCTION_LINES} lines (Triton kernels excepted)")


def test_no_class_built_on_a_mixin():
    offenders = mixin_classes()
    assert offenders == [], _report(offenders, "no class built on a mixin (compose objects)")


def runner_getattrs() -> list[str]:
    """``getattr(runner, ...)`` / ``getattr(self.runner, ...)`` in the scheduler's rooms."""
    out = []
    for path, _, tree in _modules():
        if not (path.startswith("engine/scheduler/") or path == "engine/speculative/worker.py"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "getattr" and node.args \
                    and "runner" in ast.unparse(node.args[0]):
                out.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return out


def test_the_scheduler_reads_its_runner_through_the_protocol():
    offenders = runner_getattrs()
    assert offenders == [], _report(offenders, "StepRunner attributes, not getattr(runner, ...)")


def test_the_rules_see_what_they_check():
    """The checks are not vacuous: they parse the packages and would catch an offender."""
    assert len(_modules()) > 100
    tree = ast.parse("class A(base.FooMixin, B):\n"
                     "    def f(self):\n" + "        x = 1\n" * MAX_FUNCTION_LINES +
                     "@triton.jit\ndef k():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    defs = dict(_walk_defs(tree))
    assert set(defs) == {"A", "A.f", "k"}
    assert [_base_name(b) for b in defs["A"].bases] == ["FooMixin", "B"]
    assert _is_jit(defs["k"].decorator_list[0]) and not defs["A.f"].decorator_list
    assert defs["A.f"].end_lineno - defs["A.f"].lineno + 1 == MAX_FUNCTION_LINES + 1
