"""Orbax's own ``checkpoint_manager_test.py`` against a drop-in ``CheckpointManager``: pass counts.

A measurement of how much of orbax-checkpoint's test suite a replacement class passes, per class
of test (P public, P* public plus a cheap private attribute, L legacy API, I Orbax internals; see
classes.py and docs/design/orbax-drop-in-research.md section 3). Orbax's test file is not in this
repository: it is read from the fetched google/orbax mirror (or ``--test-file``) into a temp
directory, beside a conftest.py (the single-process CPU harness) and a wrapper test module that
swaps the class. flax, chex and friends, which the test module imports, are installed once with
``pip --no-deps --target`` into ``.cache/orbax-suite/site`` (git-ignored), not into the venv.

    .venv/bin/python bench/orbax_suite/run.py                   # against cairn's drop-in
    .venv/bin/python bench/orbax_suite/run.py --against orbax \\
        --out bench/results/orbax_suite-orbax.json              # the baseline: Orbax itself
    .venv/bin/python bench/orbax_suite/run.py -k save_best      # a subset (pytest -k)

Exit status 0 whatever the tests do; 2 if the harness broke (no test file, the drop-in does not
import, pytest found nothing or wrote no report).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import classes
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SITE = REPO / ".cache" / "orbax-suite" / "site"
MIRROR = Path("/work/.mirror/google+orbax/repo")
MIRROR_PATH = "checkpoint/orbax/checkpoint/checkpoint_manager_test.py"
DROPINS = {
    "cairn": "cairn.manager.orbax:CheckpointManager",
    "orbax": "orbax.checkpoint.checkpoint_manager:CheckpointManager",
}
# What the test module imports beyond the venv; versions that work with jax 0.10.2 and
# orbax-checkpoint 0.12.8 (research doc, section 3.1). optax only when the venv lacks it.
PINS = ("flax==0.12.8", "chex==0.1.92", "treescope==0.1.10", "toolz==1.2.0")
OPTAX_PIN = "optax==0.2.8"
NOT_CONSTRUCTED = "harness: the drop-in"

console = Console()


class HarnessError(RuntimeError):
    """The measurement could not be made (as opposed to tests failing)."""


@dataclass
class Case:
    """One collected test case (or one subtest of a case) and its outcome."""

    id: str
    method: str
    cls: str
    outcome: str  # passed, failed, error, skipped
    error: str | None
    duration_s: float
    subtest: str | None = None
    known_single_process_failure: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome in ("passed", "skipped")


# ----------------------------------------------------------------------------- preparation


def resolve_test_file(
    path: Path | None, mirror: Path, workdir: Path
) -> tuple[Path, dict[str, Any]]:
    """The test file to run (``--test-file``, else the mirror's HEAD) and where it came from."""
    if path is not None:
        if not path.is_file():
            raise HarnessError(f"--test-file {path}: no such file")
        return path, {"path": str(path.resolve())}
    if not (mirror / "HEAD").exists():
        raise HarnessError(
            f"no test file: pass --test-file PATH, or fetch google/orbax (a bare git dir expected "
            f"at {mirror}; --mirror names another)"
        )
    git = ["git", f"--git-dir={mirror}"]
    try:
        text = subprocess.run(
            [*git, "show", f"HEAD:{MIRROR_PATH}"], check=True, capture_output=True
        ).stdout
        commit = subprocess.run(
            [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
        ).stdout.strip()
    except subprocess.CalledProcessError as exc:
        raise HarnessError(f"git show HEAD:{MIRROR_PATH} in {mirror}: {exc.stderr!r}") from exc
    extracted = workdir / "checkpoint_manager_test.py"
    extracted.write_bytes(text)
    return extracted, {"mirror": str(mirror), "commit": commit, "path": MIRROR_PATH}


def ensure_site(site: Path) -> list[str]:
    """Install the test module's extra imports into ``site`` once (a stamp records the pins)."""
    pins = list(PINS)
    if importlib.util.find_spec("optax") is None:
        pins.append(OPTAX_PIN)
    stamp = site / ".orbax-suite-pins"
    if stamp.exists() and stamp.read_text().split() == pins:
        return pins
    console.print(f"installing {' '.join(pins)} into {site} (--no-deps, once)")
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site)]
    result = subprocess.run([*cmd, *pins], capture_output=True, text=True)
    if result.returncode != 0:
        raise HarnessError(f"pip install into {site} failed:\n{result.stderr[-2000:]}")
    stamp.write_text("\n".join(pins) + "\n")
    return pins


def pytest_env(dropin: str, test_tmpdir: Path) -> dict[str, str]:
    """The environment of the pytest process: 8 CPU devices, a fresh TEST_TMPDIR, the site."""
    env = dict(os.environ)
    xla = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in xla:
        env["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count=8".strip()
    env.update(
        JAX_PLATFORMS="cpu",
        TEST_TMPDIR=str(test_tmpdir),
        ORBAX_SUITE_SITE=str(SITE),
        ORBAX_SUITE_DROPIN=dropin,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def check_dropin(dropin: str, env: dict[str, str]) -> None:
    """Import the drop-in in a child process first, for a clear error instead of 163 errors."""
    module, _, attribute = dropin.partition(":")
    code = f"import importlib; getattr(importlib.import_module({module!r}), {attribute!r})"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        raise HarnessError(f"the drop-in {dropin} does not import: {last}")


def build_suite(workdir: Path, test_file: Path) -> Path:
    """The temp directory pytest runs in: harness, Orbax's module, the wrapper, a pytest.ini."""
    suite = workdir / "suite"
    suite.mkdir()
    shutil.copyfile(test_file, suite / "upstream_cmt.py")
    shutil.copyfile(HERE / "conftest_template.py", suite / "conftest.py")
    shutil.copyfile(HERE / "wrapper_template.py", suite / "test_dropin.py")
    # An ini here makes this the rootdir, so the repository's pytest options are not picked up.
    (suite / "pytest.ini").write_text("[pytest]\naddopts =\njunit_family = xunit2\n")
    return suite


# ----------------------------------------------------------------------------- running


def run_pytest(
    suite: Path, env: dict[str, str], workers: int, timeout_s: int, k: str | None, log: Path
) -> tuple[int, Path]:
    """pytest in a subprocess; its output goes to ``log``. Returns the exit code and the xml
    (the subtest reports go to ``env["ORBAX_SUITE_REPORTS"]``)."""
    junit = suite.parent / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "test_dropin.py", "-p", "no:cacheprovider", "-rA"]
    cmd += ["--timeout", str(timeout_s), "--junitxml", str(junit)]
    if workers > 0:
        cmd += ["-n", str(workers)]
    if k:
        cmd += ["-k", k]
    with log.open("w") as out:
        out.write(" ".join(cmd) + "\n\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=suite, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc.returncode, junit


def first_line(text: str | None, limit: int = 240) -> str | None:
    """The first non-empty line of an error message, shortened."""
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return None


def error_line(element: ET.Element) -> str | None:
    """A failure's first line: its message, else the first ``E   `` line of its traceback."""
    line = first_line(element.get("message"))
    if line:
        return line
    for raw in (element.text or "").splitlines():
        if raw.startswith("E   "):
            return first_line(raw[4:])
    return first_line(element.text)


def parse_junit(junit: Path) -> list[Case]:
    """Every test case of the report, with its outcome as junit has it (subtests folded in)."""
    if not junit.exists():
        raise HarnessError(f"pytest wrote no report ({junit})")
    cases: list[Case] = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        name = tc.get("name", "")
        outcome, error = "passed", None
        for tag in ("failure", "error", "skipped"):
            child = tc.find(tag)
            if child is not None:
                outcome, error = {"failure": "failed"}.get(tag, tag), error_line(child)
                break
        cases.append(
            Case(
                id=name,
                method=classes.split_case(name)[0],
                cls=classes.classify(name),
                outcome=outcome,
                error=error,
                duration_s=round(float(tc.get("time") or 0.0), 3),
            )
        )
    return cases


def apply_subtests(cases: list[Case], reports: Path) -> list[Case]:
    """Split subtests out of the junit cases, using the reports conftest.py recorded.

    A case counts as failed when its own body, setup or teardown failed, or when a subtest of
    its own class failed; a subtest classified apart (broadcast_impl, I) is listed on its own and
    leaves its case alone. Returns the cases followed by every subtest.
    """
    lines = [json.loads(x) for x in reports.read_text().splitlines()] if reports.exists() else []
    by_name = {c.id: c for c in cases}
    own_failed: set[str] = set()
    subtests: list[Case] = []
    for line in lines:
        name = line["nodeid"].rpartition("::")[2]
        if not line["is_subtest"]:
            if line["outcome"] == "failed":
                own_failed.add(name)
            continue
        msg = line["subtest"] or ""
        method = classes.split_case(name)[0]
        subtests.append(
            Case(
                id=f"{name} [{msg}]",
                method=method,
                cls=classes.classify(name, msg),
                outcome=line["outcome"],
                error=first_line(line["error"]) if line["outcome"] == "failed" else None,
                duration_s=0.0,
                subtest=msg,
                known_single_process_failure=(method, msg) in classes.KNOWN_SINGLE_PROCESS_FAILURES,
            )
        )
    for name, case in by_name.items():
        if case.outcome != "failed" or name in own_failed:
            continue
        failed_own_class = [
            s for s in subtests if s.id.startswith(name + " [") and not s.ok and s.cls == case.cls
        ]
        if failed_own_class:
            case.error = f"[{failed_own_class[0].subtest}] {failed_own_class[0].error}"
        elif any(s.id.startswith(name + " [") and not s.ok for s in subtests):
            case.outcome, case.error = "passed", None  # only a subtest of another class failed
    return cases + subtests


# ----------------------------------------------------------------------------- reporting


def summarise(cases: list[Case]) -> dict[str, dict[str, int]]:
    """Counts per class (and total) over whole cases, subtests apart."""
    rows: dict[str, dict[str, int]] = {}
    whole = [c for c in cases if c.subtest is None]
    keys = [*classes.CLASSES, *sorted({c.cls for c in whole} - set(classes.CLASSES))]
    for key in [*keys, "public", "total"]:
        chosen = [
            c
            for c in whole
            if key == "total" or c.cls == key or (key == "public" and c.cls in classes.PUBLIC)
        ]
        counts = Counter(c.outcome for c in chosen)
        rows[key] = {
            "cases": len(chosen),
            "passed": counts["passed"],
            "failed": counts["failed"] + counts["error"],
            "skipped": counts["skipped"],
        }
    return rows


def print_report(
    summary: dict[str, dict[str, int]],
    cases: list[Case],
    against: str,
    full: bool,
    all_failures: bool = False,
) -> None:
    """The table per class, the failing subtests, then the failing public (or all) cases."""
    expected = {**classes.EXPECTED_COUNTS, "total": classes.expected_cases()}
    expected["public"] = expected[classes.P] + expected[classes.P_STAR]
    table = Table(title=f"checkpoint_manager_test.py against {against}")
    for column in ("class", "cases", "passed", "failed", "skipped", "pass %"):
        table.add_column(column, justify="left" if column == "class" else "right")
    for key, row in summary.items():
        cases_text = str(row["cases"])
        if full and key in expected and row["cases"] != expected[key]:
            cases_text += f" (expected {expected[key]})"
        rate = f"{100 * row['passed'] / row['cases']:.0f}" if row["cases"] else "-"
        style = "bold" if key in ("public", "total") else None
        table.add_row(
            key, cases_text, str(row["passed"]), str(row["failed"]), str(row["skipped"]), rate,
            style=style,
        )  # fmt: skip
    console.print(table)

    subtests = [c for c in cases if c.subtest is not None]
    sub_failed = [c for c in subtests if not c.ok]
    console.print(f"subtests: {len(subtests) - len(sub_failed)} passed, {len(sub_failed)} failed")
    for case in sub_failed:
        note = " (fails under Orbax too, one process)" if case.known_single_process_failure else ""
        console.print(f"  [{case.cls}] {case.id}{note}: {case.error}", markup=False, soft_wrap=True)

    shown = classes.CLASSES if all_failures else classes.PUBLIC
    public_failed = [c for c in cases if c.subtest is None and c.cls in shown and not c.ok]
    if public_failed:
        what = "cases" if all_failures else "public cases"
        console.print(f"\nfailing {what} ({len(public_failed)}):")
        for case in sorted(public_failed, key=lambda c: (shown.index(c.cls), c.id)):
            console.print(f"  [{case.cls}] {case.id}: {case.error}", markup=False, soft_wrap=True)
    unknown = [c.id for c in cases if c.cls == classes.UNKNOWN]
    if unknown:
        console.print(f"\n[yellow]unclassified cases (not in classes.py): {unknown}[/]")
    not_built = [c.id for c in cases if c.error and NOT_CONSTRUCTED in c.error]
    if not_built:
        console.print(f"\n[yellow]cases in which the drop-in was never constructed: {not_built}[/]")


def versions() -> dict[str, str]:
    """Versions of what the result depends on."""
    found = {"python": platform.python_version()}
    for dist in ("orbax-checkpoint", "jax", "jaxlib", "numpy", "pytest", "cairn-ckpt"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def missing_cases(cases: list[Case]) -> list[str]:
    """Classified methods with fewer collected cases than the research counted."""
    seen = Counter(c.method for c in cases if c.subtest is None)
    return [m for m, (n, _) in classes.METHODS.items() if seen[m] != n]


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test-file", type=Path, help="Orbax's checkpoint_manager_test.py")
    parser.add_argument("--mirror", type=Path, default=MIRROR, help="bare git dir of google/orbax")
    parser.add_argument("--against", choices=sorted(DROPINS), default="cairn")
    parser.add_argument("--dropin", help="module:Class to test instead of --against's")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/orbax_suite.json")
    parser.add_argument("-k", dest="k", help="pytest -k expression (a subset)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers, 0 for none")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--log", type=Path, help="keep pytest's -rA output here")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    parser.add_argument(
        "--all-failures", action="store_true", help="list failing L and I cases too"
    )
    return parser.parse_args(argv)


def measure(opts: argparse.Namespace, workdir: Path) -> int:
    """Prepare, run, parse, report, write the JSON. Raises HarnessError when it cannot."""
    dropin = opts.dropin or DROPINS[opts.against]
    test_file, source = resolve_test_file(opts.test_file, opts.mirror, workdir)
    source["sha256"] = hashlib.sha256(test_file.read_bytes()).hexdigest()
    pins = ensure_site(SITE)
    test_tmpdir = workdir / "test_tmpdir"
    test_tmpdir.mkdir()
    reports = workdir / "reports.jsonl"
    env = pytest_env(dropin, test_tmpdir)
    env["ORBAX_SUITE_REPORTS"] = str(reports)
    check_dropin(dropin, env)
    suite = build_suite(workdir, test_file)
    log = opts.log or workdir / "pytest.log"
    log.parent.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    with console.status(f"pytest against {dropin}, {opts.workers} workers (log: {log})"):
        rc, junit = run_pytest(suite, env, opts.workers, opts.timeout, opts.k, log)
    elapsed = time.perf_counter() - started
    if rc not in (0, 1):  # 2 interrupted, 3 internal error, 4 usage error, 5 nothing collected
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise HarnessError(f"pytest exited {rc} (log {log}):\n{tail}")
    cases = apply_subtests(parse_junit(junit), reports)
    for case in cases:  # temp paths: long, and different every run
        if case.error:
            case.error = case.error.replace(str(test_tmpdir), "$TEST_TMPDIR")
            case.error = case.error.replace(str(workdir), "$WORKDIR")
    if not any(c.subtest is None for c in cases):
        raise HarnessError(f"pytest ran no test case (log {log})")

    full = opts.k is None
    summary = summarise(cases)
    print_report(summary, cases, dropin, full, opts.all_failures)
    console.print(f"\n{elapsed:.0f} s with {opts.workers} workers; pytest exit {rc}")
    missing = missing_cases(cases) if full else []
    if missing:
        console.print(f"[yellow]methods whose case count differs from classes.py: {missing}[/]")

    result = {
        "what": "orbax-checkpoint's checkpoint_manager_test.py against a drop-in CheckpointManager",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "against": opts.against if opts.dropin is None else None,
        "dropin": dropin,
        "test_file": source,
        "versions": versions(),
        "extra_site_packages": pins,
        "pytest": {"exit": rc, "workers": opts.workers, "timeout_s": opts.timeout, "k": opts.k},
        "wall_s": round(elapsed, 1),
        "summary": summary,
        "expected_counts": {**classes.EXPECTED_COUNTS, "total": classes.expected_cases()},
        "methods_with_other_case_counts": missing,
        "cases": [asdict(c) for c in sorted(cases, key=lambda c: (c.subtest is not None, c.id))],
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {opts.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="orbax-suite-"))
    try:
        return measure(opts, workdir)
    except HarnessError as exc:
        console.print(f"[red]harness error:[/] {exc}", highlight=False)
        opts.keep = (
            opts.keep or (workdir / "junit.xml").exists() or (workdir / "pytest.log").exists()
        )
        return 2
    finally:
        if opts.keep:
            console.print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
