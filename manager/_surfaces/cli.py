"""The ``cairn`` command line: ls, show, verify, metrics, gc, rm, export.

Directories are opened read-only, except by ``gc`` (without ``--dry-run``) and ``rm``. A bad
argument or an unusable directory is one line on stderr and exit status 2, never a traceback;
damage found by ``verify`` is exit status 1. ``--json`` prints data for scripts.

Everything printed may come from the directory (metric names, metadata, item names, tree keys,
error messages that quote them), and a directory is untrusted input: every line goes out through
`_say` (and every table cell as a rich `Text`, never markup), which writes what a terminal would
act on as an escape, and JSON is strict (`_json`: no NaN or Infinity, control characters escaped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cairn.handlers.errors import CairnError, MissingDependencyError
from cairn.handlers.io import optional
from cairn.manager._core.manager import CheckpointManager
from cairn.manager._format import PART, StepNames, namings
from cairn.manager._layouts.orbax import is_orbax_step
from cairn.manager._surfaces.cli_parts import (
    mark_held,
    owner_directories,
    part_cells,
    part_columns,
)


class _UsageError(Exception):
    pass


def _printable(text: object) -> str:
    """`text` as a terminal shows it literally: every character that is not printable (control
    characters, so escape sequences and carriage returns; C1 controls; bidi overrides; line
    separators; lone surrogates from undecodable file names) is written as its Python escape."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in s)


def _say(line: object = "", *, err: bool = False) -> None:
    """Print one line, escaped (see `_printable`), on stdout or stderr."""
    print(_printable(line), file=sys.stderr if err else sys.stdout)


def _console() -> Any:
    """The console tables go to: stdout, with styles and the terminal's width on a terminal, and
    plain text 160 columns wide (no escape codes, no colours) in a pipe or a file. rich decides
    what is a terminal (``isatty``, and its ``FORCE_COLOR``/``TTY_COMPATIBLE`` variables)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # main() handles it, as for every other line
            self.quiet = True
            raise BrokenPipeError

    console = _Console(highlight=False)
    return console if console.is_terminal else _Console(highlight=False, width=160)


def _table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: Collection[int] = (),
) -> Any:
    """A rich table of `rows` (headers and cells as `Text`, never markup: they come from the
    directory, metric names included). The columns at the indices in `right` are right-aligned."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=None if title is None else Text(_printable(title)))
    for index, column in enumerate(columns):
        justify: Literal["right", "left"] = "right" if index in right else "left"
        table.add_column(Text(_printable(column)), justify=justify)  # a metric name: not markup
    for row in rows:
        table.add_row(*(Text(_printable(cell)) for cell in row))
    return table


_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _strict(value: Any) -> Any:
    """`value` as strict JSON data: NaN and the infinities become the strings "NaN", "Infinity"
    and "-Infinity" (which Python's float() reads back), NumPy scalars plain numbers, anything
    else that JSON has no type for its str()."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else _NON_FINITE[repr(float(value))]
    if isinstance(value, Mapping):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return str(value)


def _json(value: Any) -> None:
    """Print `value` as strict JSON (ASCII only, so no control character goes out raw)."""
    print(json.dumps(_strict(value), indent=1, allow_nan=False))


class _EscapingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _printable(super().format(record))


@contextlib.contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """cairn's warnings (a damaged step skipped, unreadable metrics) on stderr, escaped: their
    text quotes the directory."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_EscapingFormatter())
    logger = logging.getLogger("cairn")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _open(
    directory: str, step_prefix: str, step_digits: int | None = None, *, writable: bool = False
) -> CheckpointManager:
    if "://" in directory:  # an object store: the manager says what is wrong with it
        try:
            return CheckpointManager(
                directory, read_only=not writable, step_prefix=step_prefix, step_digits=step_digits
            )
        except Exception as e:  # a bad URL, no such bucket, no credentials, no network
            message = _as_flags(str(e))  # cairn's own messages name the URL and the remedy
            if not message.startswith(directory.rstrip("/")):
                message = f"{directory}: {type(e).__name__}: {message}"
            raise _UsageError(message) from None
    path = Path(directory)
    if not path.exists():
        raise _UsageError(f"{directory}: no such directory")
    if not path.is_dir():
        raise _UsageError(f"{directory}: not a directory")
    try:
        return CheckpointManager(
            path, read_only=not writable, step_prefix=step_prefix, step_digits=step_digits
        )
    except (OSError, ValueError, TypeError, CairnError) as e:
        message = _as_flags(str(e))  # named once: the manager's message may start with it
        raise _UsageError(
            message if message.startswith(str(path)) else f"{directory}: {message}"
        ) from None


def _count(n: int, noun: str) -> str:
    """``1 step``, ``2 steps``, ``0 steps``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _as_flags(message: str) -> str:
    """The manager's advice in the command line's words: ``CheckpointManager(...,
    step_prefix='x', step_digits=6)`` becomes ``--step-prefix 'x' --step-digits 6``."""

    def flags(match: re.Match[str]) -> str:
        digits = f" --step-digits {match.group(2)}" if match.group(2) else ""
        return f"run it again with --step-prefix {match.group(1)}{digits}"

    message = re.sub(
        r"open it with CheckpointManager\(\.\.\., step_prefix=('[^']*')(?:, step_digits=(\d+))?\)",
        flags,
        message,
    )
    message = re.sub(r"\bstep_prefix=('[^']*')", r"--step-prefix \1", message)
    message = message.replace(
        "open it with read_only=True to read alongside",
        "cairn ls, show, verify and metrics read alongside it; gc and rm need the directory "
        "to themselves: run them once that writer has closed",
    )
    return re.sub(r"\bstep_digits=(\d+|None)", r"--step-digits \1", message)


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def _when(seconds: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _step_arg(mgr: CheckpointManager, step: int, directory: str) -> int:
    if step not in mgr.all_steps():
        raise _UsageError(f"{directory}: no step {step} (steps: {mgr.all_steps()})")
    return step


def _keep_policy(args: argparse.Namespace) -> Any:
    """The keep policy the gc/ls options describe, or None when none is given."""
    from cairn.manager._core.policies import AnyOf, KeepBest, KeepEvery, KeepLatest

    for flag, value in (
        ("--keep-latest", args.keep_latest),
        ("--keep-best", args.keep_best),
        ("--keep-every", args.keep_every),
    ):
        if value is not None and value < 1:
            raise _UsageError(f"{flag} must be at least 1, got {value}")
    if args.keep_best is None and (args.metric is not None or args.mode is not None):
        raise _UsageError(
            "--metric and --mode say what --keep-best keeps: give --keep-best N with them"
        )
    parts: list[Any] = []
    try:
        if args.keep_latest is not None:
            parts.append(KeepLatest(args.keep_latest))
        if args.keep_best is not None:
            if not args.metric:
                raise _UsageError("--keep-best needs --metric NAME")
            parts.append(KeepBest(args.keep_best, args.metric, mode=args.mode or "min"))
        if args.keep_every is not None:
            parts.append(KeepEvery(steps=args.keep_every))
    except ValueError as e:
        raise _UsageError(str(e)) from None
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AnyOf(*parts)


def _kept_by(policy: Any, views: list[Any]) -> dict[int, list[str]]:
    """For each step, the parts of `policy` that keep it (the newest is always kept)."""
    from cairn.manager._core.policies import AnyOf, checked_keep

    parts: list[Any] = list(policy.policies) if isinstance(policy, AnyOf) else [policy]
    reasons: dict[int, list[str]] = {v.step: [] for v in views}
    for part in parts:
        for step in checked_keep(part, views):
            reasons[step].append(type(part).__name__)
    if views:
        reasons[max(v.step for v in views)].append("newest")
    return reasons


def _infos(mgr: CheckpointManager, steps: Sequence[int] | None = None) -> dict[int, Any]:
    """Each step's StepInfo, read once, or the error that says why it cannot be read."""
    infos: dict[int, Any] = {}
    for step in mgr.all_steps() if steps is None else steps:
        try:
            infos[step] = mgr.info(step)
        except CairnError as e:
            infos[step] = e
    return infos


def _is_orbax(info: Any) -> bool:
    return not isinstance(info, CairnError) and is_orbax_step(info.metadata, info.items)


def _views(infos: dict[int, Any], *, all_readable: bool = False) -> list[Any]:
    """The steps retention considers: readable cairn steps (Orbax steps too with all_readable)."""
    from cairn.manager._core.policies import StepView

    return [
        StepView(step, info.started_at, dict(info.metrics))
        for step, info in infos.items()
        if not isinstance(info, CairnError) and (all_readable or not _is_orbax(info))
    ]


def _step_like_hint(directory: Path, names: StepNames) -> str | None:
    """What an empty listing of a local directory says of the step-like names it holds
    (``checkpoint_000100``, ``ckpt_7``): none is a step (no manifest, no Orbax metadata; a
    directory of steps under another naming is refused before this), and the flags that
    would read steps named so."""
    with contextlib.suppress(OSError):
        entries = [e.name for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]
        found = namings(entries)
        if not found:
            return None
        shown = sorted(name for _, steps in found for _, name in steps)
        more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
        lines = [
            f"{_printable(str(directory))}: no steps; "
            + (
                "1 directory has a step-like name"
                if len(shown) == 1
                else f"{len(shown)} directories have step-like names"
            )
            + f" but no manifest: {', '.join(map(_printable, shown[:5]))}{more}"
        ]
        for naming, _ in found[:3]:
            if naming != names:
                flags = f"--step-prefix '{naming.prefix}'"
                if naming.digits is not None:
                    flags += f" --step-digits {naming.digits}"
                lines.append(f"  steps named like {naming.format(1)!r} are read with {flags}")
        return "\n".join(lines)
    return None


def _ls_rows(mgr: CheckpointManager, args: argparse.Namespace, policy: Any) -> list[dict[str, Any]]:
    """`ls`'s rows of one directory: one per step, with its part record (`part`) where the step
    is a local tier's part."""
    rows: list[dict[str, Any]] = []
    infos = _infos(mgr)
    reasons = _kept_by(policy, _views(infos)) if policy is not None else {}
    checked: dict[tuple[int, ...], str] = {}  # files steps share are read once
    for step, info in infos.items():
        row: dict[str, Any] = {"step": step}
        if isinstance(info, CairnError):
            row.update(status=f"damaged: {info}")
            rows.append(row)
            continue
        problems = []
        if args.verify:
            problems = mgr.verify(step, checked=checked)
        row.update(
            committed_at=info.committed_at,
            bytes=info.bytes,
            metrics=dict(info.metrics),
            items=sorted(n for n, i in info.items.items() if not i.dropped),
            status=("damaged: " + problems[0]) if problems else ("ok" if args.verify else "listed"),
        )
        if _is_orbax(info):
            row["format"] = "orbax"
        if policy is not None:
            row["kept_by"] = reasons.get(step, [])
        part = info.metadata.get(PART)
        if isinstance(part, dict):  # a local tier's part: which process, which save
            row["part"] = dict(part)
        rows.append(row)
    return rows


def _ls_local(
    args: argparse.Namespace, policy: Any, owners: dict[int, Path]
) -> list[dict[str, Any]]:
    """`ls` of a local tier's directory: the parts of each ``process_<q>/`` in it, one row each,
    by step and owner, `held` saying whether each is the holder's own or a replica
    (`mark_held`)."""
    if args.process is not None and args.process not in owners:
        have = ", ".join(f"process_{q}" for q in sorted(owners))
        raise _UsageError(f"{args.directory}: no process_{args.process} in it (it holds {have})")
    rows: list[dict[str, Any]] = []
    for q in sorted(owners):
        with _open(str(owners[q]), args.step_prefix, args.step_digits) as mgr:
            rows += [
                {"step": r["step"], "owner": q, "held": None} | r
                for r in _ls_rows(mgr, args, policy)
            ]
    if mark_held(rows, len(owners), args.process):
        _say(
            f"{args.directory}: some parts do not record which process holds them; give "
            "--process P (the process whose local directory this is) to tell own parts from "
            "replicas",
            err=True,
        )
    return sorted(rows, key=lambda r: (r["step"], r["owner"]))


def _ls(args: argparse.Namespace) -> int:
    policy = _keep_policy(args)
    if args.process is not None and args.process < 0:
        raise _UsageError(f"--process must be at least 0, got {args.process}")
    with _open(args.directory, args.step_prefix, args.step_digits) as mgr:
        rows = _ls_rows(mgr, args, policy)
    owners = owner_directories(args.directory) if not rows else {}
    if owners:  # a local tier's directory: the parts in its process_<q>/ directories
        rows = _ls_local(args, policy, owners)
    elif args.process is not None:
        raise _UsageError(
            f"{args.directory}: --process reads a local tier's directory (one that holds "
            "process_<p> directories); this one holds none"
        )
    elif not rows and "://" not in args.directory:
        hint = _step_like_hint(Path(args.directory), StepNames(args.step_prefix, args.step_digits))
        if hint:
            print(hint, file=sys.stderr)
    if args.json:
        _json(rows)
        return 0
    local = bool(owners)  # a local tier's directory: whose part each row is, own or replica
    parts = local or any("part" in row for row in rows)
    columns = ["step", *(part_columns(local=local) if parts else [])]
    columns += ["committed", "size", "metrics", "items", "status"]
    if policy is not None:
        columns.append("kept by")
    cells = []
    for row in rows:
        line = [
            str(row["step"]),
            *(part_cells(row, local=local) if parts else []),
            _when(row["committed_at"]) if "committed_at" in row else "-",
            _size(row["bytes"]) if "bytes" in row else "-",
            " ".join(f"{k}={v:.4g}" for k, v in row.get("metrics", {}).items()),
            ",".join(row.get("items", [])),
            row["status"],
        ]
        if policy is not None:
            if row.get("format") == "orbax":
                kept = "(Orbax: never deleted)"
            elif "committed_at" not in row:
                kept = "(damaged: gc skips it)"
            else:
                kept = ", ".join(row.get("kept_by", [])) or "(gc would delete)"
            line.append(kept)
        cells.append(line)
    console = _console()
    if console.is_terminal:
        console.print(_table(args.directory, columns, cells, right=(0, columns.index("size"))))
    else:  # plain columns, tab-separated, a header first: for cut, awk and the like
        for line in [columns, *cells]:  # each cell escaped: a tab in a name is no column
            print("\t".join(_printable(cell) for cell in line))
    return 0


def _leaf_bytes(leaf: dict[str, Any]) -> int | None:
    import math

    from cairn.handlers.io import dtype_from_name

    try:
        return math.prod(leaf["shape"]) * dtype_from_name(leaf["dtype"]).itemsize
    except (TypeError, ValueError, KeyError):
        return None


def _show(args: argparse.Namespace) -> int:
    with _open(args.directory, args.step_prefix, args.step_digits) as mgr:
        step = _step_arg(mgr, args.step, args.directory)
        try:
            info, described = mgr.info(step), mgr.describe(step)
        except CairnError as e:
            raise _UsageError(f"{args.directory}: step {step}: {e}") from None
    if args.json:
        _json(
            {
                "step": step,
                "bytes": info.bytes,
                "bytes_written": _int_or_none(info.telemetry.get("bytes_written")),
                "metrics": dict(info.metrics),
                "metadata": dict(info.metadata),
                "items": described,
            }
        )
        return 0
    header = f"step {step}: committed {_when(info.committed_at)}, {_size(info.bytes)}"
    written = info.telemetry.get("bytes_written")
    if written is not None and written < info.bytes:  # an incremental save linked the rest
        header += f" ({_size(written)} written, the rest shared with an earlier step)"
    metrics = ", ".join(f"{k}={v:.6g}" for k, v in info.metrics.items())
    console = _console()
    if console.is_terminal:  # one table: a row per item, then a row per leaf under it
        rows: list[list[str]] = []
        for name, item in described.items():
            kind = str(item.get("kind", item.get("handler")))
            rows.append([name, "", kind, _size(item.get("bytes") or 0)])
            for leaf in item.get("leaves", []):
                rows.append(["", str(leaf["path"]), *_leaf_cells(leaf)])
        _say(header)
        if metrics:
            _say(f"metrics: {metrics}")
        console.print(_table(None, ["item", "key path", "value", "size"], rows, right=(3,)))
        return 0
    _say(header)
    if metrics:
        _say("  metrics: " + metrics)
    for name, item in described.items():
        what = item.get("kind", item.get("handler"))
        _say(f"  item {name!r}: {what}, {_size(item.get('bytes') or 0)}")
        for leaf in item.get("leaves", []):
            value, size = _leaf_cells(leaf)
            _say(f"    {leaf['path']}: {value}" + (f", {size}" if size else ""))
    return 0


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _leaf_cells(leaf: dict[str, Any]) -> tuple[str, str]:
    """A leaf of `describe()` as its value (dtype and shape, or the value) and its size: the
    dtype as NumPy names it (``float32``, not the stored ``<f4``); typed PRNG keys as
    ``key<impl>`` with the keys' shape (their data's, less its last dimension)."""
    if "shape" not in leaf:
        return repr(leaf.get("value")), ""
    from cairn.handlers.io import dtype_from_name

    nbytes = _leaf_bytes(leaf)
    shape = list(leaf["shape"])
    try:
        dtype = dtype_from_name(leaf["dtype"]).name
    except (ValueError, KeyError):
        dtype = str(leaf.get("dtype"))
    if "prng" in leaf:
        dtype, shape = f"key<{leaf['prng']}>", shape[:-1]
    return f"{dtype}{shape}", _size(nbytes) if nbytes is not None else ""


def _metrics(args: argparse.Namespace) -> int:
    if args.mode is not None and args.plot is None:
        raise _UsageError(
            "--mode says which end of the metric --plot marks as best: it needs --plot"
        )
    with _open(args.directory, args.step_prefix, args.step_digits) as mgr:
        infos = _infos(mgr)
        views = _views(infos, all_readable=True)
    # The writing manager's best-step rule (best=, or its one KeepBest), newest step first.
    recorded = next(
        (i.best for _, i in sorted(infos.items(), reverse=True) if getattr(i, "best", None)),
        None,
    )
    names = sorted({k for v in views for k in v.metrics})
    if args.metric is not None:  # the table, the JSON and the plot of that metric alone
        if args.metric not in names:
            raise _UsageError(f"{args.directory}: no metric {args.metric!r} (metrics: {names})")
        names = [args.metric]
    plot = (
        _plot_setup(args, names, recorded) if args.plot is not None else None
    )  # refused before anything is printed
    if args.json:
        # The step number is the "step" key: a metric of that name cannot stand in for it.
        _json(
            [
                {"step": v.step}
                | {n: v.metrics[n] for n in names if n in v.metrics and n != "step"}
                for v in views
            ]
        )
    else:
        rows = [
            [str(v.step), *(f"{v.metrics[n]:.6g}" if n in v.metrics else "-" for n in names)]
            for v in views
        ]
        console = _console()
        if console.is_terminal:
            columns = ["step", *names]
            console.print(_table(args.directory, columns, rows, right=range(len(columns))))
        else:  # plain lines, for scripts: a header, then one line per step
            _say("step " + " ".join(names))
            for row in rows:
                _say(" ".join(row))
    if plot is not None:
        _plot(args, views, *plot)
    return 0


def _plot_setup(
    args: argparse.Namespace, names: list[str], recorded: tuple[str, str] | None
) -> tuple[str, str | None, Any]:
    """The metric --plot draws, the mode of the best step it marks (None: no mark), and
    pyplot; a usage error for what cannot work. The mode is --mode, else the one the manager
    that wrote the run recorded for that metric (its best= or KeepBest); a guess would mark
    the worst step of an accuracy, so without either the curve has no best step marked."""
    default = recorded[0] if recorded is not None and recorded[0] in names else None
    metric = args.metric or default or (names[0] if names else None)
    if metric is None:
        raise _UsageError(f"{args.directory}: no metrics to plot")
    mode = args.mode
    if mode is None and recorded is not None and recorded[0] == metric:
        mode = recorded[1]
    if not args.plot:
        raise _UsageError("--plot needs the name of the PNG file to write")
    if Path(args.plot).is_dir():
        raise _UsageError(f"--plot {args.plot}: is a directory; give the name of a PNG file")
    parent = Path(args.plot).parent
    if not parent.is_dir():
        raise _UsageError(f"--plot {args.plot}: no such directory {str(parent)!r}")
    try:
        matplotlib = optional("matplotlib", feature="cairn metrics --plot")
    except MissingDependencyError as e:
        raise _UsageError(str(e)) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return metric, mode, plt


def _plot(
    args: argparse.Namespace, views: list[Any], metric: str, mode: str | None, plt: Any
) -> None:
    points = [(v.step, v.metrics[metric]) for v in views if metric in v.metrics]
    name = _printable(metric)  # drawn as it is: no control characters, no $math$
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=f"{name} (kept steps)")
    if mode is not None:
        best = (min if mode == "min" else max)(points, key=lambda p: p[1])
        ax.plot([best[0]], [best[1]], "r*", markersize=14, label=f"best ({mode}): step {best[0]}")
    else:
        _say("no best step marked: give --mode min or --mode max", err=True)
    ax.set_xlabel("step")
    ax.set_ylabel(name, parse_math=False)
    ax.set_title(_printable(args.directory), parse_math=False)
    for text in ax.legend().get_texts():
        text.set_parse_math(False)
    fig.tight_layout()
    try:
        # A name without an extension is written as PNG under that name (matplotlib would
        # otherwise write NAME.png, and "wrote NAME" would name the wrong file).
        fig.savefig(args.plot, dpi=100, format=None if Path(args.plot).suffix else "png")
    except OSError as e:
        raise _UsageError(f"--plot {args.plot}: {e.strerror or e}") from None
    except ValueError as e:  # an extension matplotlib cannot write ("x.foo")
        raise _UsageError(f"--plot {args.plot}: {e}") from None
    finally:
        plt.close(fig)
    _say(f"wrote {args.plot}", err=True)


def _gc(args: argparse.Namespace) -> int:
    from cairn.manager._core.policies import steps_to_delete

    policy = _keep_policy(args)
    if policy is None:
        raise _UsageError("gc needs a keep option: --keep-latest, --keep-best or --keep-every")
    with _open(
        args.directory, args.step_prefix, args.step_digits, writable=not args.dry_run
    ) as mgr:
        doomed = steps_to_delete(_views(_infos(mgr)), policy)
        with _progress("deleting", len(doomed), quiet=args.dry_run) as advance:
            for step in doomed:
                _say(f"{'would delete' if args.dry_run else 'deleting'} step {step}")
                if not args.dry_run:
                    mgr.delete(step)
                advance(1)
        kept = [s for s in mgr.all_steps() if s not in doomed]
    _say(
        f"{_count(len(doomed), 'step')} {'would be ' if args.dry_run else ''}deleted, "
        f"{len(kept)} kept: {kept}"
    )
    return 0


@contextlib.contextmanager
def _progress(
    what: str, total: float, *, quiet: bool = False, in_bytes: bool = False
) -> Iterator[Callable[[float], None]]:
    """A progress bar on stderr when it is a terminal (never in pipes, logs or --json)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
    )

    err = Console(stderr=True, highlight=False)
    if quiet or not err.is_terminal:  # not a disabled Progress: rich 13.0 ends one with a newline
        yield lambda n: None
        return
    with Progress(
        TextColumn(what),
        BarColumn(),
        DownloadColumn() if in_bytes else MofNCompleteColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)


def _export(args: argparse.Namespace) -> int:
    from cairn.manager._surfaces.orbax_interop import export_step

    with _open(args.directory, args.step_prefix, args.step_digits) as mgr:
        _step_arg(mgr, args.step, args.directory)
    try:
        with _progress("exporting", 1) as advance:
            out = export_step(
                args.directory,
                args.step,
                args.destination,
                items=args.items,
                step_prefix=args.orbax_step_prefix or None,
                source_step_prefix=args.step_prefix,
            )
            advance(1)
    except (ValueError, CairnError) as e:
        raise _UsageError(f"{args.directory}: {e}") from None
    _say(f"exported step {args.step} to {out}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    with _open(args.directory, args.step_prefix, args.step_digits, writable=True) as mgr:
        step = _step_arg(mgr, args.step, args.directory)
        try:
            mgr.delete(step)
        except CairnError as e:
            raise _UsageError(f"{args.directory}: step {step}: {e}") from None
    _say(f"deleted step {step}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    with _open(args.directory, args.step_prefix, args.step_digits) as mgr:
        steps = mgr.all_steps()
        if args.step is not None:
            if args.step not in steps:
                raise _UsageError(f"{args.directory}: no step {args.step} (steps: {steps})")
            steps = [args.step]
        infos = _infos(mgr, steps)  # a damaged manifest counts no bytes: verify reports it
        total = sum(i.bytes for i in infos.values() if not isinstance(i, CairnError))
        results: list[dict[str, Any]] = []
        checked: dict[tuple[int, ...], str] = {}  # files steps share are read once
        with _progress("verifying", total, quiet=args.json, in_bytes=True) as advance:
            for step in steps:
                try:
                    problems = mgr.verify(step, progress=advance, checked=checked)
                except CairnError as e:  # deleted meanwhile by a writer
                    problems = [str(e)]
                result = {"step": step, "ok": not problems, "problems": problems}
                if _is_orbax(infos[step]):
                    result["format"] = "orbax"  # Orbax keeps no checksums: nothing to compare
                results.append(result)
    damaged = [r for r in results if not r["ok"]]
    if args.json:
        _json(results)
        return 1 if damaged else 0
    summary = f"{_count(len(results), 'step')} checked, {len(damaged)} damaged"
    if not results:
        summary = f"{args.directory}: no committed steps"
    findings: list[tuple[int, str, str]] = []
    for r in results:
        if r["ok"] and r.get("format") == "orbax":
            findings.append((r["step"], "ok", "orbax step, no checksums to verify"))
        elif r["ok"]:
            findings.append((r["step"], "ok", ""))
        for problem in r["problems"]:
            findings.append((r["step"], "DAMAGED", problem))
    console = _console()
    if console.is_terminal:
        rows = [[str(step), status, detail] for step, status, detail in findings]
        console.print(_table(args.directory, ["step", "status", "detail"], rows, right=(0,)))
        _say(summary)
        return 1 if damaged else 0
    for step, status, detail in findings:  # plain lines (never wrapped), one per finding, for grep
        if status == "DAMAGED":
            _say(f"step {step}: DAMAGED: {detail}")
        else:
            _say(f"step {step}: {detail or 'ok'}")
    _say(summary)
    return 1 if damaged else 0


def _keep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-latest", type=int, default=None, metavar="N", help="keep the N newest")
    p.add_argument(
        "--keep-best", type=int, default=None, metavar="N", help="keep the N best by --metric"
    )
    p.add_argument("--metric", default=None, help="the metric of --keep-best")
    p.add_argument(
        "--mode", choices=["min", "max"], default=None, help="--keep-best's best end (min)"
    )
    p.add_argument("--keep-every", type=int, default=None, metavar="K", help="keep multiples of K")


def _version() -> str:
    """The installed cairn-ckpt's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cairn-ckpt")
    except PackageNotFoundError:
        return "(not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cairn", description="Inspect, check and clean up cairn checkpoint directories."
    )
    parser.add_argument("--version", action="version", version=f"cairn {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run: Any, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("directory", help="a checkpoint directory or s3:// URL")
        p.add_argument("--step-prefix", default="checkpoint", help="as the manager's step_prefix")
        p.add_argument(
            "--step-digits", type=int, default=None, help="as the manager's step_digits (padding)"
        )
        p.set_defaults(run=run, parser=p)
        return p

    ls = command(
        "ls",
        _ls,
        "list the steps: time, size, metrics, items, status; of a local tier's directory (one "
        "holding process_<p> directories), the parts it holds",
    )
    ls.add_argument("--verify", action="store_true", help="read every file (slow) for the status")
    ls.add_argument("--json", action="store_true", help="a JSON list of objects with a 'step' key")
    ls.add_argument(
        "--process",
        type=int,
        default=None,
        metavar="P",
        help="the directory is process P's local directory: its parts in process_P are its own, the "
        "others replicas (by default, as each part records the process that committed it)",
    )
    _keep_options(ls)
    show = command("show", _show, "one step: its items, and the arrays with shapes and dtypes")
    show.add_argument("step", type=int)
    show.add_argument("--json", action="store_true")
    metrics = command("metrics", _metrics, "metrics by step; --plot writes a PNG")
    metrics.add_argument("--plot", default=None, metavar="OUT.png")
    metrics.add_argument("--metric", default=None)
    metrics.add_argument(
        "--mode",
        choices=["min", "max"],
        default=None,
        help="which end of the metric is best: --plot marks the best step (default: the "
        "mode the run's manager recorded, from best= or KeepBest; none: no mark)",
    )
    metrics.add_argument("--json", action="store_true")
    gc = command("gc", _gc, "delete the steps a keep policy does not keep (the newest stays)")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    _keep_options(gc)
    export = command(
        "export",
        _export,
        "write one step as an Orbax step (orbax-checkpoint reads it): DESTINATION/<step> "
        "(or DESTINATION/<prefix>_<step> with --orbax-step-prefix), as an Orbax "
        "CheckpointManager on DESTINATION saves it",
    )
    export.add_argument("step", type=int)
    export.add_argument(
        "destination",
        help="the Orbax checkpoint directory (a CheckpointManager's directory, created if need "
        "be) that receives the step; not the step's own directory",
    )
    export.add_argument("--items", nargs="+", default=None, help="only these items")
    export.add_argument(
        "--orbax-step-prefix", default="", help="the Orbax step prefix (default: plain <step>)"
    )
    rm = command("rm", _rm, "delete one step")
    rm.add_argument("step", type=int)
    verify = command(
        "verify",
        _verify,
        "read every file of every step (or --step N) and check sizes and checksums; exit 0: all "
        "intact, 1: damage found (each damaged file named), 2: bad arguments or directory",
    )
    verify.add_argument("--step", type=int, default=None, help="verify only this step")
    verify.add_argument("--json", action="store_true", help="print a JSON list, one per step")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # that subcommand's usage, not the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with _warnings_to_stderr():
            code: int = args.run(args)
            sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return code
    except _UsageError as e:
        _say(f"cairn: error: {e}", err=True)
        return 2
    except KeyboardInterrupt:
        _say("cairn: interrupted", err=True)
        return 130
    except BrokenPipeError:  # `cairn ls DIR | head`: as Python's docs advise, stay quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE
    except Exception as e:  # never a traceback: one line and a status
        _say(f"cairn: error: {type(e).__name__}: {e}", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
