"""Every ```python block in README.md and docs/*.md runs, so the documentation cannot drift.

Each block runs on its own, as a reader would paste it: in a fresh interpreter (this venv's
python, in a subprocess), with a fresh empty temporary directory as its working directory, so that
blocks which all use `ckpts` do not see each other's steps and a snippet that registers a handler
or starts threads leaves nothing behind. A failure names the Markdown file and the line of the
block, and the traceback points at lines of the Markdown file.

Blocks that are not Python are fenced as ```text (or with no language). A Python block that cannot
run on its own (a fragment of a training loop, a launch script for several machines) is preceded,
on the line just before its fence, by a visible marker with a reason:

    <!-- not run: needs two machines -->
    ```python

Python-looking fences other than ``python``, info strings after ``python`` and markers without a
reason or without a Python block after them are refused, so that no snippet is skipped by accident.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# An opening fence: up to three spaces, three or more backticks or tildes, then the info string.
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_PYTHONISH = {"py", "py3", "python3", "pycon", "pytb", "ipython", "ipython3"}
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")
# Not-run blocks are the exception: raise this only with a reason each (see the module docstring).
MAX_NOT_RUN = 4
BLOCK_TIMEOUT_S = 300

# Runs one block in __main__ of a fresh interpreter, compiled under the Markdown file's name and
# padded so that line numbers in a traceback are the file's.
_RUNNER = """
import sys
path, line, code_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(code_file, encoding="utf-8") as f:
    code = f.read()
sys.argv = [path]
exec(compile("\\n" * (line - 1) + code, path, "exec", dont_inherit=True), {"__name__": "__main__"})
"""


class Block:
    """One fenced block: its language, where its code starts, the code, and a not-run reason."""

    def __init__(self, info: str, line: int, code: str, not_run: str | None) -> None:
        self.info = info
        self.language = info.split()[0].lower() if info else ""
        self.line = line  # 1-based line number of the block's first code line
        self.code = code
        self.not_run = not_run  # the marker's reason (possibly empty), None without a marker

    def __repr__(self) -> str:  # for assertion messages
        return f"Block({self.info!r}, line {self.line}, not_run={self.not_run!r})"


def _blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the not-run marker just above it, if any."""
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        marker = _NOT_RUN.match(lines[i - 1]) if i > 0 else None
        fence, indent = opening["fence"], len(opening["indent"])
        info = opening["info"].strip()
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = lines[i].strip()
            if closing.startswith(fence[0] * len(fence)) and not closing.strip(fence[0]):
                break
            line = lines[i]
            # Content lines lose up to the fence's own indentation, as CommonMark says.
            strip = min(indent, len(line) - len(line.lstrip(" ")))
            body.append(line[strip:])
            i += 1
        first_line = i - len(body) + 1
        not_run = marker["reason"].strip() if marker else None
        blocks.append(Block(info, first_line, "\n".join(body) + "\n", not_run))
        i += 1
    return blocks


def _markers(path: Path) -> list[int]:
    """Line numbers (1-based) of every not-run marker in a file."""
    text = path.read_text(encoding="utf-8").splitlines()
    return [n for n, line in enumerate(text, 1) if _NOT_RUN.match(line)]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _python_blocks() -> list[object]:
    params = []
    for path in DOC_FILES:
        runnable = [b for b in _blocks(path) if b.language == "python" and b.not_run is None]
        for block in runnable:
            params.append(pytest.param(path, block, id=f"{_name(path)}:{block.line}"))
    return params


def run_block(path: Path, block: Block, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run one block in a fresh interpreter with `cwd` as its working directory."""
    code_file = cwd.parent / f"{cwd.name}.snippet.py"
    code_file.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, str(path), str(block.line), str(code_file)],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,
    )


@pytest.mark.parametrize(("path", "block"), _python_blocks())
def test_snippet_runs(path: Path, block: Block, tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_block(path, block, cwd)
    if result.returncode != 0:
        pytest.fail(
            f"{_name(path)}:{block.line}: the python block starting at line {block.line} failed "
            f"(exit status {result.returncode}):\n{result.stderr[-6000:]}",
            pytrace=False,
        )


def test_the_docs_exist_and_have_snippets() -> None:
    for path in (ROOT / "README.md", ROOT / "docs" / "quickstart.md"):
        assert any(b.language == "python" and b.not_run is None for b in _blocks(path)), path
    for name in ("quickstart.md", "format.md", "concepts.md"):
        assert (ROOT / "docs" / name).is_file(), name


@pytest.mark.parametrize("path", DOC_FILES, ids=_name)
def test_no_python_block_is_skipped_by_its_fence(path: Path) -> None:
    blocks = _blocks(path)
    wrong = [b for b in blocks if b.language in _PYTHONISH]
    assert not wrong, f"{path.name}: fence these as ```python (runnable) or ```text: {wrong}"
    extra = [b for b in blocks if b.language == "python" and b.info != "python"]
    assert not extra, f"{path.name}: a python fence takes no other words (use a marker): {extra}"


@pytest.mark.parametrize("path", DOC_FILES, ids=_name)
def test_not_run_markers_have_a_reason_and_a_python_block(path: Path) -> None:
    marked = {b.line - 2: b for b in _blocks(path) if b.not_run is not None}  # the marker's line
    for line in _markers(path):
        block = marked.get(line)
        assert block is not None, f"{path.name}:{line}: a not-run marker not just above a fence"
        assert block.language == "python", f"{path.name}:{line}: marks a {block.language!r} block"
        assert block.not_run, f"{path.name}:{line}: a not-run marker needs a reason"


def test_few_blocks_are_not_run() -> None:
    not_run = [
        f"{_name(path)}:{b.line}: {b.not_run}"
        for path in DOC_FILES
        for b in _blocks(path)
        if b.not_run is not None
    ]
    assert len(not_run) <= MAX_NOT_RUN, "\n".join(not_run)


def test_the_fence_parser(tmp_path: Path) -> None:
    text = (
        "intro\n```python\nx = 1\n\ny = 2\n```\n~~~~text\n```\nnot a fence end\n~~~~\n"
        "<!-- not run: needs a cluster -->\n```python\nlaunch()\n```\n"
    )
    path = tmp_path / "sample.md"
    path.write_text(text, encoding="utf-8")
    got = [(b.language, b.line, b.code, b.not_run) for b in _blocks(path)]
    assert got == [
        ("python", 3, "x = 1\n\ny = 2\n", None),
        ("text", 8, "```\nnot a fence end\n", None),
        ("python", 13, "launch()\n", "needs a cluster"),
    ]
    assert _markers(path) == [11]


def test_a_failing_block_names_its_file_and_line(tmp_path: Path) -> None:
    """The runner reports the Markdown line of the failure, and each block gets an empty cwd."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# t\n\n```python\nimport os\nassert os.listdir() == []\nopen('ckpts', 'w').close()\n"
        "raise ValueError('boom')\n```\n",
        encoding="utf-8",
    )
    (block,) = _blocks(doc)
    for name in ("first", "second"):  # the second sees no `ckpts` from the first
        cwd = tmp_path / name
        cwd.mkdir()
        result = run_block(doc, block, cwd)
        assert result.returncode == 1
        assert f'File "{doc}", line 7' in result.stderr, result.stderr
        assert "ValueError: boom" in result.stderr
