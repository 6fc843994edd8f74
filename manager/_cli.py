"""The ``cairn`` command line (first version: ``cairn verify``).

Directories are opened read-only. A bad argument or an unusable directory is one line on stderr
and exit status 2, never a traceback; damage found by ``verify`` is exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cairn.handlers.errors import CairnError
from cairn.manager._manager import CheckpointManager


class _UsageError(Exception):
    pass


def _open(directory: str, step_prefix: str) -> CheckpointManager:
    if "://" in directory:  # an object store: the manager says what is wrong with it
        try:
            return CheckpointManager(directory, read_only=True, step_prefix=step_prefix)
        except Exception as e:  # a bad URL, no such bucket, no credentials, no network
            raise _UsageError(f"{directory}: {type(e).__name__}: {e}") from None
    path = Path(directory)
    if not path.exists():
        raise _UsageError(f"{directory}: no such directory")
    if not path.is_dir():
        raise _UsageError(f"{directory}: not a directory")
    try:
        return CheckpointManager(path, read_only=True, step_prefix=step_prefix)
    except (OSError, ValueError, TypeError, CairnError) as e:
        raise _UsageError(f"{directory}: {e}") from None


def _verify(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    err = Console(stderr=True, highlight=False)
    with _open(args.directory, args.step_prefix) as mgr:
        steps = mgr.all_steps()
        if args.step is not None:
            if args.step not in steps:
                raise _UsageError(f"{args.directory}: no step {args.step} (steps: {steps})")
            steps = [args.step]
        total = 0
        for step in steps:
            with contextlib.suppress(CairnError):  # a damaged manifest: verify reports it
                total += mgr.info(step).bytes
        results: list[dict[str, Any]] = []
        with Progress(
            TextColumn("verifying"),
            BarColumn(),
            DownloadColumn(),
            console=err,
            transient=True,
            disable=args.json or not err.is_terminal,
        ) as progress:
            task = progress.add_task("verify", total=total)
            for step in steps:
                try:
                    problems = mgr.verify(step, progress=lambda n: progress.advance(task, n))
                except CairnError as e:  # deleted meanwhile by a writer
                    problems = [str(e)]
                results.append({"step": step, "ok": not problems, "problems": problems})
    damaged = [r for r in results if not r["ok"]]
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:  # plain lines (never wrapped), one per finding, for people and grep
            if r["ok"]:
                print(f"step {r['step']}: ok")
            for problem in r["problems"]:
                print(f"step {r['step']}: DAMAGED: {problem}")
        summary = f"{len(results)} steps checked, {len(damaged)} damaged"
        print(summary if results else f"{args.directory}: no committed steps")
    return 1 if damaged else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cairn", description="Inspect and check cairn checkpoint directories."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="read every file of every step (or --step N) and check sizes and checksums",
        description="Read every file of every committed step and check it against the "
        "manifest (size and crc32c). Exit status 0: all intact; 1: damage found (each damaged "
        "file is named); 2: bad arguments or directory.",
    )
    verify.add_argument("directory")
    verify.add_argument("--step", type=int, default=None, help="verify only this step")
    verify.add_argument("--json", action="store_true", help="print a JSON list, one per step")
    verify.add_argument("--step-prefix", default="checkpoint", help=argparse.SUPPRESS)
    verify.set_defaults(run=_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
        return code
    except _UsageError as e:
        print(f"cairn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cairn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
