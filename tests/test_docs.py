"""Every ```python block in README.md and docs/*.md runs, so the documentation cannot drift.

Each block runs on its own: a fresh module namespace, a fresh temporary working directory, and a
private copy of the handler registry (a snippet may `register` a handler of its own). Blocks that are not
meant to run are fenced as ```text (or with no language); Python-looking fences other than
``python`` are refused, so that no snippet is skipped by accident.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

import cairn.manager  # noqa: F401  (registers its handlers before the registry is copied)
from cairn.handlers import _registry

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# An opening fence: up to three spaces, three or more backticks or tildes, then the info string.
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_PYTHONISH = {"py", "py3", "python3", "pycon", "pytb", "ipython", "ipython3"}


def _blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, first code line number, code) for every fenced block of a Markdown file."""
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        info = opening["info"].strip()
        language = info.split()[0].lower() if info else ""
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
        first_line = i - len(body) + 1  # 1-based line number of the block's first code line
        blocks.append((language, first_line, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _python_blocks() -> list[object]:
    params = []
    for path in DOC_FILES:
        runnable = [(line, code) for lang, line, code in _blocks(path) if lang == "python"]
        for index, (line, code) in enumerate(runnable):
            name = path.relative_to(ROOT).as_posix()
            params.append(pytest.param(path, line, code, id=f"{name}-{index}"))
    return params


@pytest.fixture
def private_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a snippet register handlers without changing what later tests see."""
    monkeypatch.setattr(_registry, "_BY_TYPE", dict(_registry._BY_TYPE))
    monkeypatch.setattr(_registry, "_BY_ID", dict(_registry._BY_ID))


@pytest.mark.usefixtures("private_registry")
@pytest.mark.parametrize(("path", "line", "code"), _python_blocks())
def test_snippet_runs(
    path: Path, line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # Pad with blank lines so that a traceback points at the line in the Markdown file; do not
    # inherit this file's `from __future__` flags.
    compiled = compile("\n" * (line - 1) + code, str(path), "exec", dont_inherit=True)
    # A real module, so that dataclasses and pickle defined in a snippet can find it.
    module = types.ModuleType("cairn_docs_snippet")
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compiled, module.__dict__)


def test_the_docs_exist_and_have_snippets() -> None:
    for path in (ROOT / "README.md", ROOT / "docs" / "quickstart.md"):
        assert any(lang == "python" for lang, _, _ in _blocks(path)), path
    for name in ("quickstart.md", "format.md", "concepts.md"):
        assert (ROOT / "docs" / name).is_file(), name


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_python_block_is_skipped_by_its_fence(path: Path) -> None:
    wrong = [(line, lang) for lang, line, _ in _blocks(path) if lang in _PYTHONISH]
    assert not wrong, f"{path.name}: fence these as ```python (runnable) or ```text: {wrong}"


def test_the_fence_parser(tmp_path: Path) -> None:
    text = "intro\n```python\nx = 1\n\ny = 2\n```\n~~~~text\n```\nnot a fence end\n~~~~\n"
    path = tmp_path / "sample.md"
    path.write_text(text, encoding="utf-8")
    assert _blocks(path) == [
        ("python", 3, "x = 1\n\ny = 2\n"),
        ("text", 8, "```\nnot a fence end\n"),
    ]
