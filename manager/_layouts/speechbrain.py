"""SpeechBrain's checkpoints (`Checkpoint`, the names, the meta every checkpointer writes) and
the directories SpeechBrain itself wrote (``CKPT+*/CKPT.yaml``), read in place as untrusted
input: no link followed, the meta parsed as plain YAML data, paramfiles regular files inside the
directory; one that is not is skipped with a warning. Deleting one is the manager's
(`CheckpointManager.delete_directory`), under the directory's lock.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import pathlib
import stat
from typing import Any

from cairn.handlers import SpeechBrainHandler
from cairn.handlers.errors import CorruptCheckpointError, MissingDependencyError
from cairn.handlers.io import open_regular

log = logging.getLogger("cairn")

CKPT_PREFIX = "CKPT"
METAFNAME = f"{CKPT_PREFIX}.yaml"  # the meta file of SpeechBrain's own checkpoints (read only)
PARAMFILE_EXT = SpeechBrainHandler.paramfile_ext  # ".ckpt"

Checkpoint = collections.namedtuple("Checkpoint", ["path", "meta", "paramfiles"])
Checkpoint.__doc__ = """One saved checkpoint: `path` (pathlib.Path of its directory), `meta` (a dict;
"unixtime" and "end-of-epoch" always, plus what was given to save) and `paramfiles` (recoverable
name -> pathlib.Path of its saved file). Hashed by path, so checkpoints make sets."""
Checkpoint.__hash__ = lambda self: hash(self[0])  # type: ignore[method-assign]


def _number(value: Any) -> float | None:
    """A meta value as a number for ranking: a real number that is not NaN (bools count, as in
    SpeechBrain); None for anything else, an int too large for a float included."""
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return None if math.isnan(number) else number


def _checked_meta(meta: Any) -> dict[str, Any]:
    """A checkpoint's meta as this API hands it out: a mapping with str keys, a finite number
    "unixtime" and a bool "end-of-epoch" (every checkpointer writes both); CorruptCheckpointError
    otherwise."""
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise CorruptCheckpointError(
            f"its meta is a {type(meta).__qualname__}, not a mapping with str keys"
        )
    unixtime = meta.get("unixtime")
    number = None if isinstance(unixtime, bool) else _number(unixtime)
    if number is None or not math.isfinite(number):
        raise CorruptCheckpointError(f"its meta's unixtime {unixtime!r:.40} is not a time")
    if not isinstance(meta.get("end-of-epoch"), bool):
        raise CorruptCheckpointError(
            f"its meta's end-of-epoch {meta.get('end-of-epoch')!r:.40} is not a bool"
        )
    return dict(meta)


_META_LIMIT = 256 << 10  # bytes of a SpeechBrain CKPT.yaml (a few lines in practice)
_META_DEPTH = 32  # nesting of its collections


def _parse_meta(data: bytes) -> Any:
    """A CKPT.yaml as data: plain YAML (safe tags only) without aliases and nested at most
    `_META_DEPTH` deep, checked on the event stream before anything is built (an alias bomb or a
    deep document never reaches the constructor); CorruptCheckpointError otherwise."""
    try:
        import yaml
    except ImportError as e:  # PyYAML comes with speechbrain, whose checkpoints these are
        raise MissingDependencyError(
            "reading checkpoints SpeechBrain wrote (CKPT.yaml) needs PyYAML, which is not "
            "installed in this Python; install it with: pip install 'cairn-ckpt[speechbrain]'"
        ) from e

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        text = data.decode("utf-8")
        depth = 0
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent):
                raise CorruptCheckpointError("its meta uses a YAML alias")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > _META_DEPTH:
                    raise CorruptCheckpointError(f"its meta nests deeper than {_META_DEPTH}")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        return yaml.load(text, Loader=loader)  # a safe loader: data only
    except CorruptCheckpointError:
        raise
    except Exception as e:  # the file's bytes are all this parses
        # Besides YAMLError, UTF-8 and int() errors, PyYAML's safe constructors raise whatever
        # a tagged value that does not fit its tag makes their code hit: KeyError for
        # `!!bool maybe`, AttributeError for `!!timestamp x`, IndexError for `!!int _`.
        raise CorruptCheckpointError(
            f"its meta does not parse: {type(e).__name__}: {e!s:.300}"
        ) from None


def _speechbrain_checkpoint(path: pathlib.Path) -> Checkpoint | None:
    """The checkpoint SpeechBrain wrote in `path`, or None if `path` is no such directory (no
    CKPT.yaml); CorruptCheckpointError if it is one that cannot be read safely: a link, a meta
    that is not a regular file or not plain data, a paramfile that is not a regular file."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise CorruptCheckpointError("it is a symbolic link; cairn does not follow links")
    if not stat.S_ISDIR(mode):
        return None
    try:
        with os.fdopen(open_regular(path / METAFNAME), "rb") as f:
            data = f.read(_META_LIMIT + 1)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link
        raise CorruptCheckpointError(f"its {METAFNAME} cannot be read: {e}") from None
    if len(data) > _META_LIMIT:
        raise CorruptCheckpointError(f"its {METAFNAME} is larger than {_META_LIMIT} bytes")
    meta = _checked_meta(_parse_meta(data))
    paramfiles = {}
    with os.scandir(path) as entries:
        for entry in entries:
            stem = entry.name.removesuffix(PARAMFILE_EXT)
            if stem in ("", entry.name):
                continue
            if not entry.is_file(follow_symlinks=False):
                raise CorruptCheckpointError(f"its paramfile {entry.name!r} is not a regular file")
            paramfiles[stem] = pathlib.Path(entry.path)
    return Checkpoint(path, meta, paramfiles)


def _is_speechbrain_dir(path: pathlib.Path) -> bool:
    try:
        is_checkpoint = _speechbrain_checkpoint(path) is not None
    except (OSError, CorruptCheckpointError):
        return False
    return path.name.startswith(f"{CKPT_PREFIX}+") and is_checkpoint


def _speechbrain_checkpoints(root: pathlib.Path) -> list[Checkpoint]:
    """Checkpoints written by SpeechBrain itself (``CKPT+*/CKPT.yaml``); one that cannot be read
    safely is skipped with a warning."""
    try:
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries if e.name.startswith(f"{CKPT_PREFIX}+"))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        try:
            checkpoint = _speechbrain_checkpoint(root / name)
        except FileNotFoundError:
            continue  # deleted meanwhile
        except (OSError, CorruptCheckpointError) as e:
            log.warning("cairn.speechbrain: skipping %s: %s", root / name, e)
            continue
        if checkpoint is not None:
            found.append(checkpoint)
    return found


def _check_paramfile(checkpoint: Checkpoint, path: Any) -> None:
    """Before a load hook reads a paramfile of a checkpoint cairn did not write: it must be a
    regular file (not a link) directly inside the checkpoint's directory, itself not a link."""
    directory, path = pathlib.Path(checkpoint.path), pathlib.Path(path)
    try:
        ok = (
            path.parent == directory
            and stat.S_ISDIR(os.lstat(directory).st_mode)
            and stat.S_ISREG(os.lstat(path).st_mode)
        )
    except OSError:
        ok = False
    if not ok:
        raise CorruptCheckpointError(
            f"checkpoint {directory}: paramfile {path} is not a regular file inside it; cairn "
            "hands a load hook only files of the checkpoint's own directory"
        )
