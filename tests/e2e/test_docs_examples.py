"""Every ```bash and ```python block of README.md and docs/usage.md, run against a live server
(issue 34, kind 8: the docs had drifted from the code).

- bash blocks run with ``bash -e`` from the repository root, the venv's ``bin`` first on
  ``PATH``, with ``127.0.0.1:30000`` and ``localhost:30000`` turned into the test server's
  address; python blocks run in one namespace per document, in order (as a reader pastes
  them into one session: a block may use the ``client`` an earlier one made, but an import
  it needs and no earlier block made is an error), with the same substitution.
- A block passes when it exits 0 (raises nothing) and no answer in its output is an OpenAI
  error object. Where the document shows the output, its *shape* is checked, not the model's
  text: a ```json block right after a bash block is that block's output, a comment line of
  a bash block that is a JSON object is the output of the commands above it, and
  ``print(x)  # {...}`` in a python block prints that JSON; every key of the shown objects
  must be in the real ones (``…`` and ``...`` stand for elided parts).
- A block that cannot run here (docker, a GPU, ``make serve``, other servers or flags, long
  runs) is skipped by a marker on the line(s) before it, visible in the rendered source::

      <!-- docs-test: skip (the reason) -->

  A marker without a reason, or not followed by a bash or python block, fails the
  (fast) marker test.

One server for the module (the session's shared one); the examples keep ``max_tokens`` small.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/usage.md")
RUN_LANGS = ("bash", "python")
BLOCK_TIMEOUT_S = 600.0

MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*skip\s*\((?P<reason>[^()]+)\)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
ERROR_OBJECT = re.compile(r'"error"\s*:\s*\{')
PRINT_JSON = re.compile(r"^(?P<indent>\s*)print\((?P<expr>.*)\)\s*#\s*(?P<json>\{.*\})\s*$")


@dataclass
class Block:
    """One fenced code block: where it is, its language and text, its skip reason (None:
    it runs) and the text of a ```json block that shows its output (or None)."""

    doc: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    shown_output: str | None = None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}-{self.lang}"


def parse_blocks(doc: str, text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with their markers.

    Raises:
        ValueError: a malformed ``docs-test`` marker, or one not followed by a bash or
            python block, or an unclosed fence.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    skip: tuple[int, str] | None = None
    after_bash = False  # only blank lines since the last bash block
    i = 0
    while i < len(lines):
        line = lines[i]
        if "docs-test" in line and line.lstrip().startswith("<!--"):
            m = MARKER.match(line)
            if m is None:
                raise ValueError(f"{doc}:{i + 1}: malformed marker (expected "
                                 f"'<!-- docs-test: skip (reason) -->'): {line.strip()}")
            skip = (i + 1, m["reason"].strip())
            i += 1
            continue
        f = FENCE.match(line)
        if f is None:
            if line.strip():
                if skip is not None:
                    raise ValueError(f"{doc}:{skip[0]}: a docs-test marker must be followed by "
                                     "a code block")
                after_bash = False
            i += 1
            continue
        indent, lang = f["indent"], f["lang"]
        body, j = [], i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][len(indent):] if lines[j].startswith(indent)
                        else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{doc}:{i + 1}: unclosed code block")
        code = "\n".join(body) + "\n"
        if skip is not None and lang not in RUN_LANGS:
            raise ValueError(f"{doc}:{skip[0]}: a docs-test marker before a ```{lang} block "
                             "(only bash and python blocks run)")
        if lang == "json" and after_bash and blocks[-1].lang == "bash":
            blocks[-1].shown_output = code
        blocks.append(Block(doc, i + 1, lang, code, skip[1] if skip else None))
        after_bash = lang == "bash"
        skip = None
        i = j + 1
    if skip is not None:
        raise ValueError(f"{doc}:{skip[0]}: a docs-test marker at the end of the document")
    return blocks


def doc_blocks() -> list[Block]:
    return [b for doc in DOCS for b in parse_blocks(doc, (ROOT / doc).read_text())
            if b.lang in RUN_LANGS]


# ---- shapes ---------------------------------------------------------------------------------

def loose_json(text: str):
    """``text`` as JSON with ``…``/``...`` (elisions) outside strings dropped, or None."""
    out, in_str, esc, i = [], False, False, 0
    while i < len(text):
        c = text[i]
        if in_str:
            out.append(c)
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
            i += 1
            continue
        if c == '"':
            in_str = True
            out.append(c)
        elif c == "…":
            pass
        elif text.startswith("...", i):
            i += 3
            continue
        else:
            out.append(c)
        i += 1
    s = "".join(out)
    s = re.sub(r",(\s*,)+", ",", s)
    s = re.sub(r",\s*([\]}])", r"\1", s)
    s = re.sub(r"([\[{])\s*,", r"\1", s)
    try:
        return json.loads(s)
    except ValueError:
        return None


def json_values(text: str) -> list:
    """Every JSON object or array found in ``text``, line by line (several per line when
    they are concatenated, as ``curl -s`` prints bodies without a newline)."""
    dec, out = json.JSONDecoder(), []
    for line in text.splitlines():
        line = line.removeprefix("data: ")
        i = min((k for k in (line.find("{"), line.find("[")) if k >= 0), default=-1)
        while 0 <= i < len(line):
            try:
                val, end = dec.raw_decode(line, i)
            except ValueError:
                break
            out.append(val)
            i = end
            while i < len(line) and line[i].isspace():
                i += 1
    return out


def shape_problems(shown, real, path: str = "$") -> list[str]:
    """Where ``real`` lacks the structure ``shown`` has: every key of every shown object
    (recursively; a list by its first item), not the values."""
    if isinstance(shown, dict):
        if not isinstance(real, dict):
            return [f"{path}: shown an object, got {type(real).__name__}: {real!r:.80}"]
        out = []
        for k, v in shown.items():
            if k not in real:
                out.append(f"{path}: no key {k!r} (has {sorted(real)})")
            else:
                out += shape_problems(v, real[k], f"{path}.{k}")
        return out
    if isinstance(shown, list):
        if not isinstance(real, list):
            return [f"{path}: shown a list, got {type(real).__name__}: {real!r:.80}"]
        if shown and real:
            return shape_problems(shown[0], real[0], f"{path}[0]")
    return []


def check_shape(shown_text: str, output: str, where: str) -> None:
    shown = loose_json(shown_text)
    assert shown is not None, f"{where}: the shown output is not JSON: {shown_text!r:.200}"
    values = json_values(output)
    assert values, f"{where}: no JSON in the output:\n{output[-2000:]}"
    problems = shape_problems(shown, values[-1])
    assert not problems, f"{where}: the output does not have the shown shape:\n" + "\n".join(
        problems) + f"\noutput: {output[-2000:]}"


# ---- running --------------------------------------------------------------------------------

def localize(code: str, url: str) -> str:
    host = url.removeprefix("http://")
    return code.replace("127.0.0.1:30000", host).replace("localhost:30000", host)


def bash_script(code: str) -> tuple[str, list[tuple[str, str]]]:
    """The block as a script that echoes a mark before each JSON comment, and the comments:
    ``[(mark, json_text)]``."""
    out, shown = [], []
    for line in code.splitlines():
        s = line.strip()
        if s.startswith("#") and loose_json(s.lstrip("#").strip()) is not None \
                and s.lstrip("#").strip().startswith("{"):
            mark = f"@@docs-test-mark-{len(shown)}@@"
            out.append(f"echo; echo {mark}")
            shown.append((mark, s.lstrip("#").strip()))
        out.append(line)
    return "\n".join(out) + "\n", shown


def run_bash(block: Block, url: str) -> str:
    script, shown = bash_script(localize(block.code, url))
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (f"{block.id} exited {r.returncode}\n--- stdout\n"
                               f"{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    rest = r.stdout
    for mark, text in shown:
        before, _, rest = rest.partition(mark)
        check_shape(text, before, f"{block.id} (comment {text[:40]}…)")
    if block.shown_output is not None:
        check_shape(block.shown_output, r.stdout, f"{block.id} (the ```json block after it)")
    return r.stdout


def _printed_json(value, shown_text: str) -> None:
    print(value)
    check_shape(shown_text, str(value), "print(...)  # shown JSON")


def python_source(code: str) -> str:
    """The block with ``print(x)  # {json}`` lines turned into checks of that shape."""
    out = []
    for line in code.splitlines():
        m = PRINT_JSON.match(line)
        if m and loose_json(m["json"]) is not None:
            line = f"{m['indent']}__docs_printed_json__({m['expr']}, {m['json']!r})"
        out.append(line)
    return "\n".join(out) + "\n"


class DocSession:
    """The python namespace of one document; blocks run once, in order."""

    def __init__(self, blocks: list[Block], url: str):
        self.blocks = [b for b in blocks if b.lang == "python" and b.skip is None]
        self.url = url
        self.ns: dict = {"__name__": "__docs__", "__docs_printed_json__": _printed_json}
        self.done: dict[int, str | None] = {}  # index -> None (ran) or the error

    def run_through(self, block: Block) -> str:
        """Run every earlier block not yet run, then ``block``; returns its stdout."""
        target = self.blocks.index(block)
        for k in range(target + 1):
            if k in self.done:
                continue
            b = self.blocks[k]
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf):
                    exec(compile(python_source(localize(b.code, self.url)), b.id, "exec"),
                         self.ns)
            except BaseException:  # noqa: BLE001 - reported as the block's failure
                self.done[k] = traceback.format_exc(limit=-6)
            else:
                self.done[k] = None
            if k < target and self.done[k] is not None:
                pytest.fail(f"an earlier block, {b.id}, failed:\n{self.done[k]}")
            out = buf.getvalue()
            if k == target:
                assert self.done[k] is None, f"{b.id} raised:\n{self.done[k]}\n{out[-2000:]}"
                return out
        return ""


BLOCKS = doc_blocks()


@pytest.fixture(scope="module")
def sessions(shared_server):
    made = {doc: DocSession([b for b in BLOCKS if b.doc == doc], shared_server.url)
            for doc in DOCS}
    yield made
    made.clear()  # drop the namespaces (an LLM of the offline example among them)


def test_markers_are_well_formed_and_every_block_is_run_or_skipped():
    """Parsing the documents checks the markers; a document without runnable blocks would
    mean the parser lost them."""
    for doc in DOCS:
        blocks = [b for b in BLOCKS if b.doc == doc]
        assert any(b.skip is None for b in blocks), doc
        assert all(b.skip is None or b.skip.strip() for b in blocks)
    # outputs the docs show, whose shape the runs check: ```json blocks after a bash block,
    # JSON comments in bash blocks, print(...)  # {...} in python blocks
    assert sum(b.shown_output is not None for b in BLOCKS) >= 3
    assert sum(len(bash_script(b.code)[1]) for b in BLOCKS if b.lang == "bash") >= 2
    assert any(PRINT_JSON.search(line) for b in BLOCKS if b.lang == "python"
               for line in b.code.splitlines())
    with pytest.raises(ValueError, match="malformed"):
        parse_blocks("x.md", "<!-- docs-test: skip -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="followed by a code block"):
        parse_blocks("x.md", "<!-- docs-test: skip (why) -->\ntext\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="only bash and python"):
        parse_blocks("x.md", "<!-- docs-test: skip (why) -->\n```json\n{}\n```\n")
    b = parse_blocks("x.md", "  <!-- docs-test: skip (a GPU) -->\n  ```bash\n  nvidia-smi\n"
                             "  ```\n\n```bash\ncurl x\n```\n\n```json\n{\"a\": 1}\n```\n")
    assert [(x.lang, x.skip, x.shown_output) for x in b] == [
        ("bash", "a GPU", None), ("bash", None, '{"a": 1}\n'), ("json", None, None)]
    assert b[0].code == "nvidia-smi\n"


def test_shape_checks():
    assert loose_json('{"id":"chatcmpl-…","choices":[{"a":1},…],…}') == {
        "id": "chatcmpl-…", "choices": [{"a": 1}]}
    assert loose_json('{"id":"order-1234","object":"chat.completion",...') is None
    assert loose_json('{"id":"order-1234","object":"chat.completion",...}') == {
        "id": "order-1234", "object": "chat.completion"}
    assert json_values('x-request-id: a\n{"a": 1}{"b": [2]}\ndata: {"c": 3}') == [
        {"a": 1}, {"b": [2]}, {"c": 3}]
    assert shape_problems({"a": {"b": 1}, "l": [{"c": 0}]}, {"a": {"b": 2, "z": 0},
                                                             "l": [{"c": 5}]}) == []
    assert shape_problems({"a": {"b": 1}}, {"a": {}}) and shape_problems({"l": [{}]}, {"l": 1})


@pytest.mark.slow
def test_the_ready_line_is_the_documented_one(shared_server):
    """docs/usage.md shows the start-up line; the server's has the same fields in order."""
    text = (ROOT / "docs/usage.md").read_text()
    shown = next(b.code for b in parse_blocks("docs/usage.md", text)
                 if b.code.startswith("ferry ready:"))
    real = next(line for line in shared_server.log_path.read_text().splitlines()
                if "ferry ready:" in line)
    assert re.findall(r"(\w+)=", shown) == re.findall(r"(\w+)=", real), (shown, real)


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(block: Block, shared_server, sessions):
    if block.skip is not None:
        pytest.skip(f"docs-test: skip ({block.skip})")
    if block.lang == "bash":
        out = run_bash(block, shared_server.url)
    else:
        out = sessions[block.doc].run_through(block)
    bad = [line for line in out.splitlines() if ERROR_OBJECT.search(line)]
    assert not bad, f"{block.id}: an error answer in the output:\n" + "\n".join(bad)[:3000]
