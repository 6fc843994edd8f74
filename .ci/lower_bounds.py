#!/usr/bin/env python3
"""Print the declared lower bounds of cairn's dependencies as pinned requirements.

    python .ci/lower_bounds.py [EXTRA ...]

Reads pyproject.toml (beside .ci/), takes ``[project] dependencies`` plus the named optional extras
(an extra that refers to ``cairn-ckpt[...]`` is expanded), and prints one line per distribution:
``name[extras]==X`` where X is the highest ``>=`` bound declared for it among those groups (an extra
may raise a core bound: the jax extra asks numpy>=2.0 where the core asks numpy>=1.26). A ``==`` pin
is kept as it is. A requirement with no lower bound, with an upper bound or an environment marker,
or with two different pins, is an error: every dependency must declare a floor that can be tested.

The output is for ``pip install -r``: ``make lower-bounds`` installs it, then cairn with --no-deps,
runs ``pip check`` (so a floor below what another package needs fails loudly), then the tests.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: make lower-bounds installs tomli first
    import tomli as tomllib  # type: ignore[no-redef]

PROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*$")
_SPEC = re.compile(r"^(>=|==)\s*([0-9][0-9A-Za-z.+!-]*)$")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lower_bounds(project: dict, extras: list[str]) -> dict[str, str]:
    """name -> pinned requirement, for the core dependencies plus ``extras``."""
    own = _normalise(project["name"])
    optional = project.get("optional-dependencies", {})
    groups: list[str] = []
    pending = list(extras)
    while pending:
        extra = pending.pop()
        if extra in groups:
            continue
        if extra not in optional:
            raise SystemExit(
                f"lower_bounds: no extra {extra!r} in {PROJECT} (have {sorted(optional)})"
            )
        groups.append(extra)
    requirements = [(req, "dependencies") for req in project.get("dependencies", [])]
    index = 0
    while index < len(groups):
        extra = groups[index]
        index += 1
        for req in optional[extra]:
            match = _REQ.match(req)
            if match and _normalise(match.group(1)) == own:
                for sub in (match.group(2) or "[]")[1:-1].split(","):
                    if sub.strip() and sub.strip() not in groups:
                        groups.append(sub.strip())
                continue
            requirements.append((req, f"extra {extra!r}"))

    floors: dict[str, tuple[str, str, str, str]] = {}  # name -> (op, version, extras, where)
    for req, where in requirements:
        match = _REQ.match(req)
        if not match or ";" in req:
            raise SystemExit(f"lower_bounds: cannot read requirement {req!r} ({where})")
        name, req_extras, spec = match.group(1), match.group(2) or "", match.group(3)
        parts = [part.strip() for part in spec.split(",") if part.strip()]
        specs = [_SPEC.match(part) for part in parts]
        if len(parts) != 1 or specs[0] is None:
            raise SystemExit(
                f"lower_bounds: {req!r} ({where}) must be exactly one '>=X' or '==X' "
                "so that its floor can be installed and tested"
            )
        op, version = specs[0].group(1), specs[0].group(2)
        key = _normalise(name)
        seen = floors.get(key)
        if seen is None:
            floors[key] = (op, version, req_extras, where)
            continue
        if "==" in (op, seen[0]) and (op, version) != (seen[0], seen[1]):
            if op == "==" and seen[0] == ">=" and _version_key(version) >= _version_key(seen[1]):
                floors[key] = (op, version, req_extras or seen[2], where)
                continue
            if seen[0] == "==" and op == ">=" and _version_key(seen[1]) >= _version_key(version):
                floors[key] = (seen[0], seen[1], seen[2] or req_extras, seen[3])
                continue
            raise SystemExit(
                f"lower_bounds: {name}: {seen[0]}{seen[1]} ({seen[3]}) vs {req} ({where})"
            )
        if _version_key(version) > _version_key(seen[1]):
            floors[key] = (op, version, req_extras or seen[2], where)
        elif req_extras and not seen[2]:
            floors[key] = (seen[0], seen[1], req_extras, seen[3])
    return {key: f"{key}{extras_}=={version}" for key, (_, version, extras_, _) in floors.items()}


def main(argv: list[str]) -> int:
    if any(arg.startswith("-") for arg in argv):
        print(__doc__, file=sys.stderr)
        return 2
    project = tomllib.loads(PROJECT.read_text())["project"]
    for line in sorted(lower_bounds(project, argv).values()):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
