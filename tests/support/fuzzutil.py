"""The fuzzer of committed checkpoint directories (tests/test_fuzz.py): templates, mutations, checks.

A *case* is a copy of a template directory (steps written through the public API, `BUILDERS`:
cairn's own, a root shared with orbax-checkpoint's steps, a SpeechBrain directory, tf.data
iterator states; `run_s3_case` puts the cairn one in a bucket) with mutations applied as a
stranger could craft them: JSON edits of manifests and item metadata with their checksums
recomputed (the format is documented, so an attacker can), bytes flipped, files truncated,
swapped or copied from another step with nothing recomputed, symbolic links and FIFOs in place of
files and directories, extra and missing entries, object keys no filesystem allows. A
`sentinel` tree lies beside the checkpoint root in every case. Then every reader and writer
entry point runs on it (`operations`): read-only and writable managers, restore, verify,
retention, the command line, SpeechBrain's Checkpointer.

What must hold (anything else is a finding, reported by `run_case` as one line each):

- every exception is one of cairn's documented errors, or a plain ValueError/TypeError raised by a
  ``raise`` statement in cairn's own code (`PLAIN` adds SpeechBrain's RuntimeErrors); an error on
  the commit thread (CommitError) must have such a cause too. The command line never lets an
  exception out, exits 0, 1 or 2, prints no control characters, and its ``--json`` output is
  strict JSON;
- the sentinel tree (and the sentinel objects beside a bucket's root) is unchanged (names, modes,
  contents, mtimes); no path inside it is opened, listed, renamed or deleted, no path outside the
  checkpoint is written (a Python audit hook watches every such call: `Watch`), and no restore
  returns data read from it;
- no operation takes longer than `OP_SECONDS` (a FIFO opened for reading blocks forever);
- the Python heap (tracemalloc, which NumPy reports to) never grows beyond the size of the files
  in the directory plus `ALLOC_SLACK`;
- a listed file whose bytes changed, with nothing recomputed, makes `verify` report its step and
  `restore(step)` fail with CorruptCheckpointError (swapped and stale chunks included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import signal
import stat
import struct
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import crc32c
import numpy as np
import xxhash
from hypothesis import strategies as st

import cairn.handlers
import cairn.manager
from cairn.handlers import JsonHandler, TrainStateHandler
from cairn.handlers.errors import CairnError, CommitError
from cairn.manager import CheckpointManager, KeepLatest

MANIFEST = "_CHECKPOINT.json"
METRICS = "metrics.json"
LOCK = ".cairn.lock"
OP_SECONDS = 20.0
APPLY_SECONDS = 5.0  # a later mutation of a case, applied by the harness (see Case.apply_all)
ALLOC_SLACK = 64 * 2**20
# FIFOs make every reader that opens them without O_NONBLOCK hang; CAIRN_FUZZ_FIFO=0 leaves them out.
FIFOS = os.environ.get("CAIRN_FUZZ_FIFO", "1") != "0"
CHUNK_BYTES = 64  # small chunks: every leaf of the template has several chunk files
SENTINEL_MARK = "SENTINEL-CONTENT"


# ---------------------------------------------------------------------------- JSON with a checksum


@dataclasses.dataclass(frozen=True)
class Raw:
    """A JSON token written as it is: nesting deeper than `json` handles, 5,000-digit integers."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({_short(self.text)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis's reports
        printer.text(repr(self))


def deep(levels: int) -> Raw:
    return Raw("[" * levels + "]" * levels)


def _dumps(body: Any, **options: Any) -> str:
    raws: list[str] = []

    def swap(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(body), **options)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw)
    return text


def checked_json(body: Mapping[str, Any]) -> bytes:
    """`body` with the `crc32c` field docs/format.md specifies (the CRC-32C of the canonical JSON
    of the rest), as an attacker who read the format page would write it."""
    body = {k: v for k, v in body.items() if k != "crc32c"}
    canonical = _dumps(body, sort_keys=True, separators=(",", ":"))
    return _dumps({**body, "crc32c": crc32c.crc32c(canonical.encode())}, sort_keys=True).encode()


def record_for(record: Mapping[str, Any], data: bytes) -> dict[str, Any]:
    """A manifest file record recomputed for `data`: its size and whichever checksums it has."""
    out = {**record, "size": len(data)}
    if "crc32c" in out:
        out["crc32c"] = crc32c.crc32c(data)
    if "xxh3_128" in out:
        out["xxh3_128"] = xxhash.xxh3_128_hexdigest(data)
    return out


# ---------------------------------------------------------------------------- templates


def _state(step: int) -> dict[str, Any]:
    """A train state whose float32 leaves share a chunk size (68 bytes), so chunks can be swapped."""
    return {
        "params": {
            "w": np.arange(32, dtype=np.float32).reshape(4, 8) * step,
            "b": np.linspace(0, 1, 16, dtype=np.float32) + step,
        },
        "opt": {"mu": np.full((4, 8), 0.5 * step, np.float32), "count": np.int64(step)},
        "tokens": np.arange(24, dtype=np.int16).reshape(2, 3, 4) - step,
        "flags": np.array([True, False, step % 2 == 0]),
        "lr": 0.125,
    }


HANDLERS = {
    "state": TrainStateHandler(chunk_bytes=CHUNK_BYTES, layout="zarr"),
    "config": JsonHandler(),
}
PACKED = {**HANDLERS, "state": TrainStateHandler(chunk_bytes=CHUNK_BYTES, layout="packed")}
KEEP_ITEMS = {"extra": KeepLatest(1)}


def write_run(
    root: Path, steps: tuple[int, ...], *, mark: str = "", handlers: Any = HANDLERS
) -> None:
    """Committed steps with a chunked train state, a JSON item, an iterator's state (arrays,
    bytes and tuples tagged in JSON), metrics, metadata, late metrics, and an item "extra" that
    per-item retention drops from all but the newest step."""
    from support.iterutil import Shuffled, advanced

    with CheckpointManager(root, handlers=handlers, keep_items=KEEP_ITEMS) as mgr:
        for step in steps:
            mgr.save(
                step,
                {
                    "state": _state(step),
                    "config": {"lr": 0.1, "step": step, "mark": mark, "layers": [1, 2, 3]},
                    "data": advanced(Shuffled(n=12), step),
                    "extra": {"x": np.arange(6, dtype=np.float64) * step},
                },
                metrics={"loss": 1.0 / step, "accuracy": 0.1 * step},
                metadata={"git": "abc123", "note": f"step {step}"},
            )
            mgr.wait_until_finished()
            if step != steps[-1]:
                mgr.record_metrics(step, {"eval_loss": 2.0 / step})


def write_sentinel(path: Path) -> None:
    """The tree beside the root that no case may touch: plain files, a subdirectory, and a
    committed cairn run whose JSON item says SENTINEL_MARK (a restore that reads it read outside)."""
    (path / "sub").mkdir(parents=True)
    (path / "a.txt").write_text("sentinel a\n")
    (path / "b.bin").write_bytes(bytes(range(68)))
    (path / "sub" / "c.txt").write_text("sentinel c\n")
    (path / ".hidden").write_text("a dotfile in a home directory\n")
    os.chmod(path / "sub" / "c.txt", 0o640)
    write_run(path / "run", (1,), mark=SENTINEL_MARK)


@dataclasses.dataclass(frozen=True)
class Template:
    """A template directory (`path`/root, `path`/sentinel) and what the strategies draw from."""

    path: Path
    family: str
    steps: dict[int, str]  # step -> directory name
    files: dict[str, int]  # root-relative path -> size, every regular file
    listed: dict[str, tuple[int, str, str]]  # root-relative -> (step, item, record path)
    items: dict[int, dict[str, dict[str, Any]]]  # step -> item -> manifest entry
    dirs: tuple[str, ...]  # root-relative directories below the steps
    json_files: tuple[str, ...]  # root-relative files that hold JSON
    step_prefix: str = "checkpoint"

    @property
    def root(self) -> Path:
        return self.path / "root"


def scan_template(path: Path, family: str, step_prefix: str = "checkpoint") -> Template:
    root = path / "root"
    steps: dict[int, str] = {}
    items: dict[int, dict[str, dict[str, Any]]] = {}
    listed: dict[str, tuple[int, str, str]] = {}
    step_name = re.compile(rf"{re.escape(step_prefix)}_(\d+)" if step_prefix else r"(\d+)")
    for entry in sorted(root.iterdir()):
        match = step_name.fullmatch(entry.name)
        if match and entry.is_dir():
            steps[int(match.group(1))] = entry.name
        manifest = entry / MANIFEST
        if not match or not manifest.is_file():
            continue
        obj = json.loads(manifest.read_bytes())
        items[obj["step"]] = obj["items"]
        for item, e in obj["items"].items():
            for rec in e["files"]:
                listed[f"{entry.name}/{item}/{rec['path']}"] = (obj["step"], item, rec["path"])
    files, dirs, json_files = {}, [], []
    for top, dnames, fnames in os.walk(root):
        rel_top = os.path.relpath(top, root)
        for d in dnames:
            if rel_top != ".":
                dirs.append(os.path.join(rel_top, d))
        for f in fnames:
            rel = os.path.normpath(os.path.join(rel_top, f))
            files[rel] = os.path.getsize(root / rel)
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                json.loads((root / rel).read_bytes())
                json_files.append(rel)
    return Template(
        path,
        family,
        steps,
        files,
        listed,
        items,
        tuple(sorted(dirs)),
        tuple(sorted(json_files)),
        step_prefix,
    )


class Lazy:
    """A template built once per process, on first use, in a temporary directory removed at exit
    (Hypothesis strategies need the template's file names before any fixture runs)."""

    def __init__(self, build: Callable[[Path], Template]) -> None:
        self._build = build
        self._template: Template | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def get(self) -> Template:
        if self._template is None:
            self._dir = tempfile.TemporaryDirectory(prefix="cairn-fuzz-template-")
            self._template = self._build(Path(self._dir.name))
        return self._template


def build_cairn_template(path: Path) -> Template:
    write_run(path / "root", (1, 2, 3))
    write_sentinel(path / "sentinel")
    return scan_template(path, "cairn")


def build_packed_template(path: Path) -> Template:
    """The cairn run with its train state in the packed layout (packs, indexes)."""
    write_run(path / "root", (1, 2, 3), handlers=PACKED)
    write_sentinel(path / "sentinel")
    return scan_template(path, "packed")


def _t5x_state_dict(step: int) -> dict[str, Any]:
    """A T5X state dict as T5X writes it: 2-D params in zarr arrays, the rest in the msgpack
    file, `big` (800 bytes) as a flax chunked array of 256-byte chunks."""
    return {
        "target": {
            "encoder": {
                "kernel": np.full((4, 8), step, np.float32),
                "bias": np.arange(8, dtype=np.float32) * step,
                "big": np.arange(200, dtype=np.float32) + step,
            }
        },
        "state": {
            "step": np.asarray(step, np.int32),
            "param_states": {"encoder": {"bias": {"v": np.ones(8, np.float32)}}},
        },
    }


def t5x_train_state() -> dict[str, Any]:
    """What a trainer restores a T5X step into (T5X's Checkpointer's train state)."""
    return {
        "step": np.asarray(0, np.int32),
        "params": {
            "encoder": {
                "kernel": np.zeros((4, 8), np.float32),
                "bias": np.zeros(8, np.float32),
                "big": np.zeros(200, np.float32),
            }
        },
        "opt_state": {"encoder": {"bias": {"v": np.zeros(8, np.float32)}}},
    }


def build_t5x_template(path: Path) -> Template:
    """Steps in T5X's own layout (manager/_layouts/t5x.py reads them), as T5X writes them."""
    from support.t5x_legacy_writer import write_legacy_step

    for step in (100, 200):
        write_legacy_step(path / "root", _t5x_state_dict(step), chunk_bytes=256)
    write_sentinel(path / "sentinel")
    return scan_template(path, "t5x")


def _tree(step: int) -> dict[str, Any]:
    return {
        "params": {"w": np.arange(12.0).reshape(3, 4) * step, "b": np.full(3, step, np.float32)},
        "step": step,
    }


def build_orbax_template(path: Path) -> Template:
    """A root holding steps written by orbax-checkpoint itself (1: StandardSave with OCDBT, 2:
    PyTreeSave without) and one cairn step (3), as after `import_step`."""
    import orbax.checkpoint as ocp

    root = path / "root"
    for step, ocdbt in ((1, True), (2, False)):
        options = ocp.CheckpointManagerOptions(
            step_prefix="checkpoint",
            best_fn=lambda m: m["loss"],
            best_mode="min",
            enable_async_checkpointing=False,
        )
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)}
        with ocp.CheckpointManager(root, options=options, item_handlers=handlers) as mgr:
            mgr.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(_tree(step))),
                metrics={"loss": 1.0 / (step + 1)},
            )
    write_run(root, (3,))
    write_sentinel(path / "sentinel")
    return scan_template(path, "orbax")


def tf_iterator(advance: int) -> Any:
    import tensorflow as tf

    iterator = iter(tf.data.Dataset.range(100).shuffle(10, seed=0).batch(4))
    for _ in range(advance):
        next(iterator)
    return iterator


def build_tfdata_template(path: Path) -> Template:
    """Steps with a tf.data iterator item (restored into a fresh iterator: TensorFlow's native
    DeserializeIterator reads the pieces) beside a JSON item."""
    root = path / "root"
    with CheckpointManager(root, handlers=HANDLERS) as mgr:
        for step in (1, 2):
            mgr.save(step, {"dataset": tf_iterator(step), "config": {"step": step}})
        mgr.wait_until_finished()
        # TensorFlow writes its traced functions' code to the temporary directory once per
        # process: let that happen here, not while a case watches for writes outside the root.
        mgr.restore(1, {"dataset": tf_iterator(0)})
    write_sentinel(path / "sentinel")
    return scan_template(path, "tfdata")


SB_PREFIX = "CKPT"
SB_YAML = "CKPT.yaml"


def sb_recoverables() -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def build_speechbrain_template(path: Path) -> Template:
    """cairn.manager.speechbrain checkpoints (CKPT_0, CKPT_1) and two that SpeechBrain itself
    wrote (``CKPT+<time>/CKPT.yaml`` and ``<name>.ckpt`` files from torch.save)."""
    import torch

    from cairn.manager.speechbrain import Checkpointer

    root = path / "root"
    recoverables = sb_recoverables()
    with Checkpointer(root, recoverables) as checkpointer:
        checkpointer.save_checkpoint(meta={"loss": 0.5})
        checkpointer.save_checkpoint(meta={"loss": 0.3}, end_of_epoch=False)
    for i, loss in enumerate((0.4, 0.2)):
        native = root / f"{SB_PREFIX}+2024-01-0{i + 1}+00-00-00+00"
        native.mkdir()
        (native / SB_YAML).write_text(
            f"# yamllint disable\nend-of-epoch: true\nloss: {loss}\nunixtime: {1.7e9 + i}\n"
        )
        for name, obj in recoverables.items():
            torch.save(obj.state_dict(), native / f"{name}.ckpt")
    write_sentinel(path / "sentinel")
    return scan_template(path, "speechbrain", step_prefix=SB_PREFIX)


# ---------------------------------------------------------------------------- the sentinel


def tree_digest(path: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under `path`: (mode, mtime_ns, sha256 of the content or the link target)."""
    out = {}
    for top, dnames, fnames in os.walk(path):
        for name in [*dnames, *fnames]:
            full = os.path.join(top, name)
            st_ = os.lstat(full)
            if stat.S_ISLNK(st_.st_mode):
                digest = "-> " + os.readlink(full)
            elif stat.S_ISREG(st_.st_mode):
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            else:
                digest = ""
            out[os.path.relpath(full, path)] = (st_.st_mode, st_.st_mtime_ns, digest)
    return out


# The audit events Watch looks at, each with how many leading arguments are paths.
_AUDIT_CHANGES: dict[str, int] = {
    "os.rename": 2,
    "os.replace": 2,
    "os.remove": 1,
    "os.rmdir": 1,
    "os.mkdir": 1,
    "os.truncate": 1,
    "os.chmod": 1,
    "os.chown": 1,
    "os.utime": 1,
    "os.link": 2,
    "shutil.rmtree": 1,
    "shutil.copyfile": 2,
    "shutil.move": 2,
}
_AUDIT_READS = {"open": 1, "os.listdir": 1, "os.scandir": 1}
_AUDIT_LINK_SAFE = {"os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree"}
_AUDIT_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Watch:
    """A Python audit hook (installed once per process). While `sentinel` is set it records every
    open, listing, rename or removal of a path inside the sentinel tree, and every write, rename,
    creation or removal of a path outside the `writable` directories."""

    _installed = False
    sentinel: str | None = None
    writable: tuple[str, ...] = ()
    seen: ClassVar[list[str]] = []  # one list for the process, reset per case

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            sys.addaudithook(cls._hook)
            cls._installed = True

    @classmethod
    @contextlib.contextmanager
    def watching(cls, sentinel: Path, writable: tuple[Path, ...]) -> Iterator[None]:
        cls.install()
        cls.seen = []
        cls.writable = tuple(os.path.realpath(p) for p in writable)
        cls.sentinel = os.path.realpath(sentinel)
        try:
            yield
        finally:
            cls.sentinel = None

    @classmethod
    @contextlib.contextmanager
    def paused(cls) -> Iterator[None]:
        """For the harness's own walks while a case runs."""
        sentinel, cls.sentinel = cls.sentinel, None
        try:
            yield
        finally:
            cls.sentinel = sentinel

    @staticmethod
    def _inside(path: str, top: str) -> bool:
        return path == top or path.startswith(top + os.sep)

    @classmethod
    def _hook(cls, event: str, args: tuple[Any, ...]) -> None:
        sentinel = cls.sentinel
        if sentinel is None or (event not in _AUDIT_READS and event not in _AUDIT_CHANGES):
            return
        change = event in _AUDIT_CHANGES or (
            event == "open" and isinstance(args[2], int) and args[2] & _AUDIT_WRITE_FLAGS
        )
        nofollow = event == "open" and isinstance(args[2], int) and args[2] & os.O_NOFOLLOW
        for raw in args[: _AUDIT_CHANGES.get(event, 1)]:
            if isinstance(raw, bytes):
                raw = os.fsdecode(raw)
            if not isinstance(raw, (str, os.PathLike)) or not os.path.isabs(raw):
                continue  # a descriptor, or a name relative to one (shutil.rmtree's dir_fd)
            p = os.path.normpath(os.fspath(raw))
            if event in _AUDIT_LINK_SAFE or nofollow:  # the call does not follow a final link
                where = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
            else:
                where = os.path.realpath(p)
            if cls._inside(where, sentinel):
                cls.seen.append(f"{event}({os.fspath(raw)!r})")
            elif change and not any(cls._inside(where, top) for top in cls.writable):
                cls.seen.append(f"{event}({os.fspath(raw)!r}) outside the checkpoint")


# ---------------------------------------------------------------------------- mutations


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One change to a case directory: `kind` (for the statistics), `target` (root-relative) and
    parameters; `apply` makes it and returns the steps whose damage must be detected."""

    kind: str
    target: str
    params: tuple[tuple[str, Any], ...] = ()

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.params)
        return f"{self.kind}({self.target!r}{', ' if shown else ''}{shown})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis's reports
        printer.text(repr(self))

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"...<{len(text)} chars>"


def mutation(kind: str, target: str, **params: Any) -> Mutation:
    return Mutation(kind, target, tuple(params.items()))


# Names a manifest may give an item. `{sentinel}` is the absolute path of the sentinel tree.
BAD_NAMES = [
    "..",
    ".",
    "",
    "../../sentinel",
    "../../sentinel/sub",
    "../../sentinel/run/checkpoint_1/config",
    "../checkpoint_2",
    "{sentinel}",
    "{sentinel}/run/checkpoint_1/config",
    "a/b",
    "config/../..",
    ".hidden",
    "_CHECKPOINT.json",
    "metrics.json",
    "x" * 300,
    "x" * 129,
    "ünïcødé",
    "tab\there",
    "new\nline",
    "\x1b[31mred\x1b[0m",
    "nul\x00byte",
    "\u202eevil",
    "config\\..\\..",
]
BAD_PATHS = [
    "../../../sentinel/a.txt",
    "../../../sentinel/run/checkpoint_1/config/data.json",
    "{sentinel}/a.txt",
    "/etc/passwd",
    "",
    ".",
    "..",
    "arrays/0/../../../../../sentinel/b.bin",
    "arrays//0",
    "arrays/0/",
    "./tree.json",
    "x" * 300,
    "a\x00b",
    "\x1b]0;title\x07",
    "arrays\\0",
    "data.json\n",
]
WEIRD = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    2**63,
    2**64,
    -(2**63) - 1,
    10**400,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e308,
    "",
    "1",
    "\x1b[2J\x1b[31m",
    "x" * 10_000,
    [],
    [1, 2],
    {},
    {"a": 1},
    deep(100_000),
    deep(500),
    Raw("1" + "0" * 5000),
    Raw("-" + "9" * 4400),
    Raw("1e400"),
    Raw('"\\ud800"'),
]
HANDLER_IDS = [
    "cairn.train_state",
    "cairn.numpy_tree",
    "cairn.json",
    "cairn.tf_data_iterator",
    "cairn.grain_iterator",
    "cairn.stateful_iterator",
    "orbax.pytree",
    "orbax.json",
    "orbax.tf_dataset",
    "no.such.handler",
    "",
    "../handler",
]
BAD_SHAPES = [
    [-1],
    [-4, 8],
    [2**40, 8],
    [2**14, 2**12],
    [2**63],
    [2**64],
    [],
    [0],
    [0, 8],
    [1] * 40,
    [4, 8, 1],
    [8, 4],
    [2, 16],
    [4.0, 8],
    ["4", 8],
    [True, 8],
    None,
    "4,8",
    {},
]
BAD_DTYPES = [
    "|O",
    "O",
    "object",
    "<U4",
    "|S4",
    "V8",
    "|V68",
    "<M8[s]",
    "<f16",
    "float128",
    "bfloat16",
    "int4",
    "<f8",
    "|b1",
    "bogus",
    "",
    7,
    None,
    ["<f4"],
    "[('a', '<f4')]",
]
ZARR_DTYPES = ["object", "string", "bogus", "float64", "int64", "bool", "r64", "complex128", "", 3]
BAD_CHUNKS = [[3, 8], [0, 8], [-1, 8], [2**40, 8], [1, 1], [4], [], [2, 8, 1], None, "2,8"]


def _walk_json(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk_json(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk_json(v, (*path, i))


def _set_path(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = obj
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        with contextlib.suppress(KeyError, IndexError):
            del node[path[-1]]
    else:
        node[path[-1]] = value
    return obj


_DELETE: Any = Raw("<deleted>")


def _sentinel_text(value: Any, sentinel: Path) -> Any:
    return value.replace("{sentinel}", str(sentinel)) if isinstance(value, str) else value


@st.composite
def _step_and_item(draw: st.DrawFn, t: Template) -> tuple[int, str]:
    step = draw(st.sampled_from(sorted(t.items)))
    return step, draw(st.sampled_from(sorted(t.items[step])))


def manifest_mutations(t: Template) -> st.SearchStrategy[Mutation]:
    """JSON edits of a step's manifest, checksum recomputed."""
    any_name = st.one_of(st.sampled_from(BAD_NAMES), st.text(max_size=20))
    weird = st.sampled_from(WEIRD)

    @st.composite
    def item_name(draw: st.DrawFn) -> Mutation:
        step, item = draw(_step_and_item(t))
        dropped = draw(st.sampled_from([None, True, False]))
        return mutation(
            "manifest.item_name", t.steps[step], item=item, name=draw(any_name), dropped=dropped
        )

    @st.composite
    def foreign_item(draw: st.DrawFn) -> Mutation:
        step = draw(st.sampled_from(sorted(t.items)))
        return mutation(
            "manifest.foreign_item",
            t.steps[step],
            name=draw(st.sampled_from(BAD_NAMES[:10])),
            copy_of=draw(st.sampled_from(["config", "state"])),
            dropped=draw(st.booleans()),
        )

    @st.composite
    def record(draw: st.DrawFn) -> Mutation:
        step, item = draw(_step_and_item(t))
        n = len(t.items[step][item]["files"])
        if n == 0:
            return mutation("manifest.record", t.steps[step], item=item, op="add", index=0)
        op = draw(
            st.sampled_from(
                [
                    "path",
                    "path_of_other",
                    "remove",
                    "duplicate",
                    "size",
                    "hash",
                    "swap_hash",
                    "field",
                    "replace",
                    "add",
                ]
            )
        )
        index = draw(st.integers(0, n - 1))
        other = draw(st.integers(0, n - 1))
        value: Any = None
        if op == "path":
            value = draw(st.one_of(st.sampled_from(BAD_PATHS), st.text(max_size=12)))
        elif op == "size":
            value = draw(st.one_of(st.sampled_from(["+1", "-1", "*2"]), weird))
        elif op == "hash":
            value = draw(
                st.sampled_from(
                    ["+1", "flip", "upper", "zero", "drop", "drop_all", *range(3), *WEIRD[:12]]
                )
            )
        elif op == "field":
            value = draw(st.sampled_from(["path", "size", "crc32c", "xxh3_128"]))
        elif op == "replace":
            value = draw(weird)
        return mutation(
            "manifest.record",
            t.steps[step],
            item=item,
            op=op,
            index=index,
            other=other,
            value=value,
        )

    @st.composite
    def field(draw: st.DrawFn) -> Mutation:
        step = draw(st.sampled_from(sorted(t.items)))
        name = draw(
            st.sampled_from(
                [
                    "step",
                    "format_version",
                    "format",
                    "started_at",
                    "committed_at",
                    "items",
                    "metrics",
                    "metadata",
                    "telemetry",
                ]
            )
        )
        fv = cairn.manager.FORMAT_VERSION
        special = {
            "step": [*sorted(t.steps), 0, 4, 10**18, "1"],
            "format_version": [0, 1, fv, fv + 1, 99, -1, str(fv), float(fv)],
            "format": ["orbax", "", "CAIRN"],
        }.get(name, [])
        value = draw(st.one_of(st.sampled_from([*special, _DELETE]), weird))
        return mutation("manifest.field", t.steps[step], field=name, value=value)

    @st.composite
    def item_field(draw: st.DrawFn) -> Mutation:
        step, item = draw(_step_and_item(t))
        name = draw(st.sampled_from(["handler", "version", "dropped", "files"]))
        special = {
            "handler": HANDLER_IDS,
            "version": [0, 2, 99, -1, 10**400, "1", 1.0],
            "dropped": [True, False, 1, 0, "yes", "false"],
            "files": [[], {}, "x", None],
        }[name]
        value = draw(st.one_of(st.sampled_from([*special, _DELETE]), weird))
        return mutation("manifest.item_field", t.steps[step], item=item, field=name, value=value)

    @st.composite
    def user_values(draw: st.DrawFn) -> Mutation:
        step = draw(st.sampled_from(sorted(t.items)))
        where = draw(st.sampled_from(["metrics", "metadata", "telemetry"]))
        key = draw(
            st.one_of(
                st.sampled_from(["loss", "\x1b[31mred", "a\nb", "", "x" * 500, "ünï"]),
                st.text(max_size=8),
            )
        )
        value = draw(st.one_of(weird, st.floats(), st.text(max_size=8)))
        return mutation("manifest.user_values", t.steps[step], where=where, key=key, value=value)

    @st.composite
    def anywhere(draw: st.DrawFn) -> Mutation:
        step = draw(st.sampled_from(sorted(t.items)))
        return mutation(
            "manifest.anywhere",
            t.steps[step],
            pick=draw(st.integers(0, 10**6)),
            value=draw(st.one_of(weird, st.just(_DELETE))),
        )

    @st.composite
    def whole(draw: st.DrawFn) -> Mutation:
        step = draw(st.sampled_from(sorted(t.items)))
        text = draw(
            st.sampled_from(
                [
                    "[]",
                    '"x"',
                    "1",
                    "null",
                    "{}",
                    '{"crc32c": 0}',
                    "",
                    "\udcff\udcfe",
                    deep(100_000).text,
                    "{" * 50_000,
                ]
            )
        )
        return mutation("manifest.whole", t.steps[step], text=text)

    return st.one_of(
        item_name(),
        foreign_item(),
        record(),
        field(),
        item_field(),
        user_values(),
        anywhere(),
        whole(),
    )


def byte_mutations(t: Template) -> st.SearchStrategy[Mutation]:
    """Bytes of any file changed with nothing recomputed, or with the manifest record recomputed."""
    files = sorted(t.files)
    by_size: dict[int, list[str]] = {}
    for f, size in t.files.items():
        by_size.setdefault(size, []).append(f)
    pairs = sorted((a, b) for same in by_size.values() for a in same for b in same if a < b)
    chunk_pairs = [
        (a, b)
        for a, b in pairs
        if a in t.listed and b in t.listed and "/arrays/" in a and "/arrays/" in b
    ]
    stale = sorted(
        (a, b)
        for a in t.listed
        for b in t.files
        if a != b and "/" in b and a.split("/", 1)[1] == b.split("/", 1)[1]
    )

    @st.composite
    def edit(draw: st.DrawFn) -> Mutation:
        target = draw(st.sampled_from(files))
        size = t.files[target]
        op = draw(st.sampled_from(["flip", "truncate", "extend", "empty"]))
        crafted = target in t.listed and draw(st.booleans())
        return mutation(
            "bytes.crafted" if crafted else f"bytes.{op}",
            target,
            op=op,
            offset=draw(st.integers(0, max(size - 1, 0))),
            mask=draw(st.integers(1, 255)),
            extra=draw(st.binary(min_size=1, max_size=64)),
        )

    strategies = [edit()]
    if pairs:
        strategies.append(
            st.sampled_from(pairs).map(lambda p: mutation("bytes.swap", p[0], other=p[1]))
        )
    if chunk_pairs:  # the key case: two chunks of the same size, nothing recomputed
        strategies.append(
            st.sampled_from(chunk_pairs).map(
                lambda p: mutation("bytes.swap_chunks", p[0], other=p[1])
            )
        )
    if stale:
        strategies.append(
            st.sampled_from(stale).map(lambda p: mutation("bytes.stale", p[0], source=p[1]))
        )
    if t.listed:  # (none in a directory of T5X's own steps)
        strategies.append(
            st.tuples(st.sampled_from(sorted(t.listed)), st.sampled_from(files)).map(
                lambda p: mutation("bytes.replace", p[0], source=p[1])
            )
        )
    return st.one_of(*strategies)


def metadata_mutations(t: Template) -> st.SearchStrategy[Mutation]:
    """tree.json, zarr.json, data.json and metrics.json edited, their records (or crc) recomputed."""
    trees = [f for f in t.json_files if f.endswith("tree.json") and f in t.listed]
    zarrs = [f for f in t.json_files if f.endswith("zarr.json") and f in t.listed]
    datas = [f for f in t.json_files if f.endswith("data.json") and f in t.listed]
    metrics = [name + "/" + METRICS for name in t.steps.values()]
    states = [f for f in t.json_files if re.search(r"/process_\d+-of-\d+\.json$", f)]
    indexes = [
        f for f in t.json_files if re.search(r"/packs/index\.\d+\.json$", f) and f in t.listed
    ]

    @st.composite
    def tree(draw: st.DrawFn) -> Mutation:
        field = draw(
            st.sampled_from(
                ["shape", "dtype", "chunk", "f", "t", "k", "c", "v", "kind", "anywhere"]
            )
        )
        values: dict[str, list[Any]] = {
            "shape": BAD_SHAPES,
            "dtype": BAD_DTYPES,
            "chunk": BAD_CHUNKS,
            "f": [*BAD_PATHS, "arrays/99", "arrays/1", "arrays"],
            "t": ["bogus", "dict", "list", "array", "npscalar", "custom", "namedtuple", None],
            "k": [[], ["a"], ["a", "a", "a", "a", "a"], None, [1, 2]],
            "c": [[], None, {}],
            "v": [*WEIRD[:16], "x"],
            "kind": ["jax", "bogus", None, "numpy", "npscalar"],
            "anywhere": WEIRD,
        }
        value = draw(st.one_of(st.sampled_from(values[field]), st.just(_DELETE)))
        return mutation(
            "tree.edit",
            draw(st.sampled_from(trees)),
            field=field,
            pick=draw(st.integers(0, 10**6)),
            value=value,
        )

    @st.composite
    def zarr(draw: st.DrawFn) -> Mutation:
        field = draw(
            st.sampled_from(
                [
                    "shape",
                    "data_type",
                    "chunk_shape",
                    "codecs",
                    "fill_value",
                    "separator",
                    "node_type",
                    "zarr_format",
                    "anywhere",
                ]
            )
        )
        values: dict[str, list[Any]] = {
            "shape": BAD_SHAPES,
            "data_type": ZARR_DTYPES,
            "chunk_shape": BAD_CHUNKS,
            "codecs": [
                [],
                [{"name": "bytes", "configuration": {"endian": "little"}}],
                [{"name": "blosc"}],
                [{"name": "crc32c"}],
                None,
                [{"name": "gzip", "configuration": {"level": 5}}, {"name": "bytes"}],
            ],
            "fill_value": ["NaN", None, "x", 10**400, [1, 2], "Infinity"],
            "separator": ["/", "", "..", "x"],
            "node_type": ["group", "bogus"],
            "zarr_format": [2, 4, "3"],
            "anywhere": WEIRD,
        }
        value = draw(st.one_of(st.sampled_from(values[field]), st.just(_DELETE)))
        return mutation(
            "zarr.edit",
            draw(st.sampled_from(zarrs)),
            field=field,
            pick=draw(st.integers(0, 10**6)),
            value=value,
        )

    @st.composite
    def data(draw: st.DrawFn) -> Mutation:
        return mutation(
            "data.edit",
            draw(st.sampled_from(datas)),
            pick=draw(st.integers(0, 10**6)),
            value=draw(st.sampled_from(WEIRD)),
        )

    @st.composite
    def metrics_edit(draw: st.DrawFn) -> Mutation:
        key = draw(
            st.sampled_from(["loss", "eval_loss", "\x1b[31mred\x1b[0m", "a\nb", "", "x" * 300])
        )
        return mutation(
            "metrics.edit",
            draw(st.sampled_from(metrics)),
            key=key,
            value=draw(st.one_of(st.sampled_from(WEIRD), st.floats())),
            whole=draw(
                st.sampled_from(
                    [
                        None,
                        None,
                        None,
                        "[]",
                        '"x"',
                        "{}",
                        '{"crc32c": 1}',
                        deep(100_000).text,
                        "\udcff",
                    ]
                )
            ),
            crc=draw(st.booleans()),
        )

    @st.composite
    def any_json(draw: st.DrawFn) -> Mutation:
        return mutation(
            "json.edit",
            draw(st.sampled_from(t.json_files)),
            field="anywhere",
            pick=draw(st.integers(0, 10**6)),
            value=draw(st.one_of(st.sampled_from(WEIRD), st.just(_DELETE))),
        )

    @st.composite
    def state(draw: st.DrawFn) -> Mutation:
        """An iterator state's tagged values: arrays (dtype, shape, base64 data), floats, bytes."""
        field = draw(st.sampled_from(["dtype", "shape", "data", "__cairn__", "value", "items"]))
        values: dict[str, list[Any]] = {
            "dtype": BAD_DTYPES,
            "shape": BAD_SHAPES,
            "data": ["", "!!!!", "AAAA" * 3, "A" * 4_000_000, None, 7],
            "__cairn__": ["bogus", "ndarray", "scalar", "bytes", "tuple", "dict", "float", None],
            "value": ["nan", "1e400", "x", None, [], 10**400],
            "items": [None, 5, [[1]], [[1, 2, 3]], [{}], deep(100_000)],
        }
        return mutation(
            "state.edit",
            draw(st.sampled_from(states)),
            field=field,
            pick=draw(st.integers(0, 10**6)),
            value=draw(st.sampled_from(values[field])),
        )

    @st.composite
    def index_lie(draw: st.DrawFn) -> Mutation:
        """An index entry moved to other bytes of its pack (or another pack) with its content
        hash kept and the index's record recomputed: each file is intact on its own."""
        return mutation(
            "index.lie",
            draw(st.sampled_from(indexes)),
            pick=draw(st.integers(0, 10**6)),
            to=draw(st.sampled_from(["other chunk", "shifted", "other pack", "past the end"])),
            by=draw(st.integers(1, 64)),
        )

    present = [
        (trees, tree()),
        (zarrs, zarr()),
        (datas, data()),
        (metrics, metrics_edit()),
        (states, state()),
        (indexes, index_lie()),
    ]
    return st.one_of(any_json(), *(strategy for where, strategy in present if where))


def fs_mutations(t: Template) -> st.SearchStrategy[Mutation]:
    """Symbolic links, FIFOs, extra and missing files and directories."""
    files = sorted(t.files)
    dirs = [*t.steps.values(), *t.dirs]
    sentinel_targets = [
        "a.txt",
        "b.bin",
        "sub",
        "sub/c.txt",
        ".hidden",
        "run",
        "run/checkpoint_1",
        "run/checkpoint_1/config",
        "run/checkpoint_1/_CHECKPOINT.json",
        "missing",
    ]
    dropped = sorted(
        f"{t.steps[s]}/{item}"
        for s, its in t.items.items()
        for item, e in its.items()
        if e.get("dropped")
    )

    @st.composite
    def link(draw: st.DrawFn) -> Mutation:
        target = draw(st.sampled_from([*files, *dirs]))
        to = draw(
            st.one_of(
                st.sampled_from(sentinel_targets),
                st.sampled_from(["<self>", "<other>", "<dangling>"]),
            )
        )
        return mutation(
            "fs.symlink",
            target,
            to=to,
            absolute=draw(st.booleans()),
            other=draw(st.sampled_from(files)),
        )

    @st.composite
    def extra(draw: st.DrawFn) -> Mutation:
        where = draw(st.sampled_from(["", *t.steps.values(), *t.dirs]))
        name = draw(
            st.one_of(
                st.sampled_from(
                    [
                        "checkpoint_9",
                        "checkpoint_007",
                        "checkpoint_4.tmp-" + "a" * 32,
                        ".trash-checkpoint_1-" + "b" * 32,
                        ".trash-x",
                        "._CHECKPOINT.json.tmp-" + "c" * 32,
                        ".metrics.json.tmp-1",
                        "0.0",
                        "9.9",
                        "99",
                        "zarr.json",
                        "tree.json",
                        "extra",
                        "CKPT+2024",
                        "\x1b[31mcheckpoint_5",
                        MANIFEST,
                        METRICS,
                    ]
                ),
                st.text(
                    alphabet=st.characters(
                        blacklist_characters="/\x00", blacklist_categories=("Cs",)
                    ),
                    min_size=1,
                    max_size=12,
                ),
            )
        )
        kind = draw(st.sampled_from(["file", "dir", "link", "fifo" if FIFOS else "file", "step"]))
        return mutation(
            "fs.extra", where, name=name, what=kind, to=draw(st.sampled_from(sentinel_targets))
        )

    @st.composite
    def missing(draw: st.DrawFn) -> Mutation:
        return mutation("fs.missing", draw(st.sampled_from([*files, *dirs])))

    @st.composite
    def fifo(draw: st.DrawFn) -> Mutation:
        return mutation("fs.fifo", draw(st.sampled_from([*files, *dirs, LOCK])))

    @st.composite
    def lock(draw: st.DrawFn) -> Mutation:
        what = draw(
            st.sampled_from(
                ["link", "dir", "missing", "fifo" if FIFOS else "link", "dangling", "hardlink"]
            )
        )
        return mutation(
            "fs.lock",
            LOCK,
            what=what,
            to=draw(st.sampled_from(["a.txt", ".hidden", "sub", "sub/c.txt"])),
            absolute=draw(st.booleans()),
        )

    @st.composite
    def dropped_dir(draw: st.DrawFn) -> Mutation:
        return mutation(
            "fs.dropped_dir",
            draw(st.sampled_from(dropped)),
            what=draw(st.sampled_from(["link", "dir_with_link", "file"])),
            to=draw(st.sampled_from(["sub", "run", "a.txt", "run/checkpoint_1"])),
        )

    strategies = [link(), extra(), missing(), lock()]
    if FIFOS:
        strategies.append(fifo())
    if dropped:
        strategies.append(dropped_dir())
    return st.one_of(*strategies)


# What a stranger's CKPT.yaml may say. PyYAML's safe_load builds aliases once, so the "laughs"
# are small on disk and in memory until something walks them (json.dumps, a deep copy).
_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)
SB_YAMLS = [
    "end-of-epoch: true\nunixtime: [1]\n",
    "end-of-epoch: true\nunixtime: .nan\nloss: .inf\n",
    "end-of-epoch: true\nunixtime: 1e400\n",
    "end-of-epoch: maybe\nunixtime: 1.0\nloss: abc\n",
    "unixtime: 1.0\n",
    "end-of-epoch: true\n",
    "end-of-epoch: true\nunixtime: 1.0\nloss: " + "9" * 5000 + "\n",
    'end-of-epoch: true\nunixtime: 1.0\nloss: 0.1\n\x1b[31mkey: "\\e[2J"\n',
    "!!python/object/apply:os.system [echo pwned]\n",
    "end-of-epoch: true\nunixtime: !!python/name:os.system\n",
    "[" * 100_000,
    "- " * 5000 + "x\n",
    _LAUGHS + "end-of-epoch: true\nunixtime: 1.0\nloss: *i\n",
    "end-of-epoch: true\nunixtime: 2000-01-01\nloss: 2000-01-01\n",
    "end-of-epoch: true\nunixtime: 1.0\n? [a, b]\n: c\n",
    "\udcff\udcfe",
    "",
    "null",
    "[]",
    "--- 1\n--- 2\n",
]


def speechbrain_mutations(t: Template) -> st.SearchStrategy[Mutation]:
    yamls = sorted(f for f in t.files if f.endswith("/" + SB_YAML))
    return st.builds(
        lambda target, text: mutation("sb.yaml", target, text=text),
        st.sampled_from(yamls),
        st.sampled_from(SB_YAMLS),
    )


def tfdata_mutations(t: Template) -> st.SearchStrategy[Mutation]:
    """A tf.data iterator file crafted with its record recomputed: bytes anywhere, or the header
    (piece count, piece lengths) rewritten."""
    files = sorted(f for f in t.listed if f.endswith(".tfdata"))
    crafted = st.builds(
        lambda target, op, offset, mask, extra: mutation(
            "tfdata.crafted", target, op=op, offset=offset, mask=mask, extra=extra
        ),
        st.sampled_from(files),
        st.sampled_from(["flip", "flip", "flip", "truncate", "extend"]),
        st.integers(0, 10**5),
        st.integers(1, 255),
        st.binary(min_size=1, max_size=32),
    )
    header = st.builds(
        lambda target, field, value: mutation("tfdata.header", target, field=field, value=value),
        st.sampled_from(files),
        st.sampled_from(["count", "length", "swap"]),
        st.sampled_from([0, 1, 2, 3, 2**31, 2**32 - 1, 2**63, 2**64 - 1]),
    )
    return st.one_of(crafted, header)


# Map keys and values a stranger's msgpack file may hold where flax writes "0".."n-1" and arrays.
T5X_KEYS = ["\u00b2", "9" * 5000, "-1", "", " 0", "0" * 30, "\x1b[31m", "../x", "1e3", "\u0663"]
_DEEP_MSGPACK = b"\x91" * 100_000 + b"\xc0"  # a list in a list ... 100,000 deep


def _msgpack_weird() -> list[Any]:
    import msgpack

    ext = msgpack.ExtType
    return [
        None,
        True,
        -1,
        2**63 - 1,
        -(2**63),
        1.5,
        float("nan"),
        "",
        "x" * 10_000,
        b"bytes",
        [],
        {},
        {"__msgpack_chunked_array__": True, "shape": [2**40], "chunks": {"0": 1}},
        {"__msgpack_chunked_array__": True, "shape": "x", "chunks": []},
        ext(1, b"not msgpack"),
        ext(1, msgpack.packb(([2**40, 8], "float32", b""))),
        ext(1, msgpack.packb(([-1], "float32", b""))),
        ext(1, msgpack.packb(([2], "object", b"12345678"))),
        ext(2, b"\x00"),
        ext(3, b"junk"),
        ext(9, b""),
        {"driver": "zarr", "kvstore": {"driver": "file", "path": "../../sentinel/run"}},
        {"driver": "zarr", "kvstore": {"driver": "memory", "path": "x"}},
    ]


T5X_WHOLE = [
    _DEEP_MSGPACK,
    b"\xdf\xff\xff\xff\xff",  # a map that says it has 4 billion entries, and ends
    b"\xdd\xff\xff\xff\xff",  # the same for a list
    b"\xc6\xff\xff\xff\xff",  # 4 GiB of bin, not there
    b"\x82\xa7version\x03\xa9optimizer" + b"\x91" * 5000 + b"\xc0",
    b"",
]


def t5x_mutations(t: Template) -> st.SearchStrategy[Mutation]:
    """T5X's msgpack file edited node by node (odd chunk and map keys, values of every kind,
    ext types that lie), or replaced by crafted bytes."""
    files = sorted(f for f in t.files if f.endswith("/checkpoint"))
    kinds = ["chunk_key", "map_key", "value", "whole"]
    return st.builds(
        lambda target, kind, pick, key, value, whole: mutation(
            f"t5x.{kind}", target, pick=pick, key=key, value=value, whole=whole
        ),
        st.sampled_from(files),
        st.sampled_from(kinds),
        st.integers(0, 10**6),
        st.sampled_from(T5X_KEYS),
        st.integers(0, len(_msgpack_weird()) - 1),
        st.integers(0, len(T5X_WHOLE) - 1),
    )


@st.composite
def _half_and_half(
    draw: st.DrawFn, first: st.SearchStrategy[Mutation], second: st.SearchStrategy[Mutation]
) -> Mutation:
    """Each case from one of two strategies, as often (a `one_of` would merge their branches
    and weigh each branch alike)."""
    return draw(first) if draw(st.booleans()) else draw(second)


def mutations(t: Template) -> st.SearchStrategy[Mutation]:
    families = [manifest_mutations(t), byte_mutations(t), metadata_mutations(t), fs_mutations(t)]
    if t.family == "speechbrain":  # half the cases: SpeechBrain's own files
        return _half_and_half(speechbrain_mutations(t), st.one_of(*families))
    if t.family == "tfdata":  # the native decoder is what this family is for (the rest of
        return tfdata_mutations(t)  # its directory is what the cairn family fuzzes)
    if t.family == "t5x":  # half the cases: T5X's msgpack file; the rest its bytes and entries
        return _half_and_half(t5x_mutations(t), st.one_of(byte_mutations(t), fs_mutations(t)))
    return st.one_of(*families)


# ---------------------------------------------------------------------------- applying


@dataclasses.dataclass
class Expect:
    """What a mutation obliges the readers to notice: steps that must be reported damaged."""

    damaged: set[int] = dataclasses.field(default_factory=set)
    # Steps changed only in pack bytes outside every indexed chunk (the zeros between staged
    # chunks): a restore never reads them, verify (which checks each pack whole) must notice.
    unread: set[int] = dataclasses.field(default_factory=set)


class Case:
    """One case directory: ``root`` (the checkpoint root) and ``sentinel`` beside it."""

    def __init__(self, template: Template, path: Path) -> None:
        self.template = template
        self.path = path
        shutil.copytree(template.path, path, symlinks=True)
        self.root = path / "root"
        self.sentinel = path / "sentinel"
        self.expect = Expect()

    # helpers for the mutations

    def read_json(self, rel: str) -> Any:
        return json.loads((self.root / rel).read_bytes())

    def manifest(self, step_dir: str) -> dict[str, Any]:
        obj = self.read_json(f"{step_dir}/{MANIFEST}")
        if not isinstance(obj, dict):  # an earlier mutation replaced it: no target any more
            raise TypeError(f"{step_dir}/{MANIFEST} is not a JSON object")
        obj.pop("crc32c", None)
        return dict(obj)

    def write_manifest(self, step_dir: str, body: Mapping[str, Any]) -> None:
        (self.root / step_dir / MANIFEST).write_bytes(checked_json(body))

    def rewrite_listed(self, rel: str, data: bytes) -> None:
        """Write `data` to a listed file and recompute its record and the manifest's checksum."""
        step, item, recpath = self.template.listed[rel]
        step_dir = self.template.steps[step]
        (self.root / rel).write_bytes(data)
        body = self.manifest(step_dir)
        files = body["items"][item]["files"]
        for i, rec in enumerate(files):
            if rec["path"] == recpath:
                files[i] = record_for(rec, data)
        self.write_manifest(step_dir, body)

    def changed(self, rel: str, before: bytes | None) -> None:
        """A listed file's bytes changed with nothing recomputed: its step must be found damaged."""
        listed = self.template.listed.get(rel)
        if listed is None:
            return
        path = self.root / rel
        after = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        if after != before:
            unread = self._outside_chunks(rel, listed, before, after)
            (self.expect.unread if unread else self.expect.damaged).add(listed[0])

    def _outside_chunks(
        self, rel: str, listed: tuple[int, str, str], before: bytes | None, after: bytes | None
    ) -> bool:
        """Whether a pack changed only in bytes that no index entry of its item covers."""
        recpath = listed[2]
        if not recpath.startswith("packs/") or "index" in recpath or before is None:
            return False
        if after is None or len(after) != len(before):
            return False
        changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
        item_dir = self.template.root / rel[: -len(recpath)]
        ranges = [
            (offset, offset + nbytes)
            for index in item_dir.glob("packs/index.*.json")
            for pack, offset, nbytes, _ in json.loads(index.read_bytes())["chunks"].values()
            if pack == recpath
        ]
        return not any(lo <= i < hi for i in changed for lo, hi in ranges)

    def sentinel_path(self, to: str, absolute: bool, from_dir: Path) -> str:
        target = self.sentinel / to
        return str(target) if absolute else os.path.relpath(target, from_dir)

    def apply_all(self, muts: list[Mutation]) -> None:
        """Apply the first mutation, then those of the others that still find their target (an
        earlier one may have removed it)."""
        for i, m in enumerate(muts):
            if i == 0:
                self.apply(m)
                continue
            try:
                with (
                    deadline(APPLY_SECONDS),
                    contextlib.suppress(
                        OSError, KeyError, IndexError, TypeError, ValueError, RecursionError
                    ),
                ):
                    self.apply(m)
            except Hang:  # it opened a FIFO an earlier mutation put in place of its target
                unblock_fifos(self.path)
        if len(muts) > 1:
            self.expect.damaged.clear()  # a later change may hide an earlier one (a deleted step)
            self.expect.unread.clear()

    def apply(self, m: Mutation) -> None:
        APPLY[m.kind.split(".")[0] if m.kind.split(".")[0] in APPLY else m.kind](self, m)


def _apply_manifest(case: Case, m: Mutation) -> None:
    body = case.manifest(m.target)
    items = body["items"]
    sub = m.kind.split(".", 1)[1]
    sentinel = case.sentinel
    if sub == "item_name":
        name = _sentinel_text(m.param("name"), sentinel)
        entry = items.pop(m.param("item"))
        if m.param("dropped") is not None:
            entry["dropped"] = m.param("dropped")
        items[name] = entry
    elif sub == "foreign_item":
        # The sentinel's own step: its records match its files, so only the path can stop a read.
        foreign = json.loads((sentinel / "run" / "checkpoint_1" / MANIFEST).read_bytes())
        entry = dict(foreign["items"][m.param("copy_of")])
        entry["dropped"] = m.param("dropped")
        items[_sentinel_text(m.param("name"), sentinel)] = entry
    elif sub == "record":
        files = items[m.param("item")]["files"]
        i, j, op, value = m.param("index"), m.param("other"), m.param("op"), m.param("value")
        if op == "add":
            files.append({"path": "../../../sentinel/a.txt", "size": 11, "crc32c": 0})
        elif op == "path":
            files[i]["path"] = _sentinel_text(value, sentinel)
        elif op == "path_of_other":
            files[i]["path"] = files[j]["path"]
        elif op == "remove":
            del files[i]
        elif op == "duplicate":
            files.append(dict(files[i]))
        elif op == "size":
            size = files[i]["size"]
            files[i]["size"] = (
                {"+1": size + 1, "-1": size - 1, "*2": size * 2}.get(value, value)
                if isinstance(value, str)
                else value
            )
        elif op in ("hash", "swap_hash"):
            for key in [k for k in ("crc32c", "xxh3_128") if k in files[i]]:
                files[i][key] = _hash_edit(files[i][key], value, files[j].get(key), op)
                if files[i][key] is _DELETE:
                    del files[i][key]
        elif op == "field":
            files[i].pop(value, None)
        elif op == "replace":
            files[i] = value
    elif sub == "field":
        _set_path(body, (m.param("field"),), m.param("value"))
    elif sub == "item_field":
        _set_path(body, ("items", m.param("item"), m.param("field")), m.param("value"))
    elif sub == "user_values":
        where = body.setdefault(m.param("where"), {})
        if isinstance(where, dict):
            where[m.param("key")] = m.param("value")
    elif sub == "anywhere":
        paths = list(_walk_json(body))[1:]
        _set_path(body, paths[m.param("pick") % len(paths)], m.param("value"))
    elif sub == "whole":
        (case.root / m.target / MANIFEST).write_bytes(
            m.param("text").encode("utf-8", "surrogateescape")
        )
        return
    case.write_manifest(m.target, body)


def _hash_edit(old: Any, how: Any, other: Any, op: str) -> Any:
    if op == "swap_hash":
        return other
    if how == "+1":
        return old + 1 if isinstance(old, int) else old[:-1] + ("0" if old[-1] != "0" else "1")
    if how == "flip":
        return (
            old ^ 0x80000000 if isinstance(old, int) else ("f" if old[0] != "f" else "e") + old[1:]
        )
    if how == "upper":
        return old.upper() if isinstance(old, str) else -old
    if how == "zero":
        return 0 if isinstance(old, int) else "0" * 32
    if how in ("drop", "drop_all"):
        return _DELETE
    return how


def _apply_bytes(case: Case, m: Mutation) -> None:
    path = case.root / m.target
    data = path.read_bytes()
    if m.kind in ("bytes.swap", "bytes.swap_chunks"):
        other = case.root / m.param("other")
        data2 = other.read_bytes()
        path.write_bytes(data2)
        other.write_bytes(data)
        case.changed(m.target, data)
        case.changed(m.param("other"), data2)
        return
    if m.kind in ("bytes.stale", "bytes.replace"):
        path.write_bytes((case.root / m.param("source")).read_bytes())
        case.changed(m.target, data)
        return
    op, offset = m.param("op"), min(m.param("offset"), max(len(data) - 1, 0))
    if op == "flip" and data:
        new = data[:offset] + bytes([data[offset] ^ m.param("mask")]) + data[offset + 1 :]
    elif op == "truncate":
        new = data[:offset]
    elif op == "extend":
        new = data + m.param("extra")
    else:
        new = b""
    if m.kind == "bytes.crafted":
        case.rewrite_listed(m.target, new)
    else:
        path.write_bytes(new)
        case.changed(m.target, data)


def _pick_node(tree: Any, field: str, pick: int) -> tuple[Any, ...]:
    """A JSON path in `tree` that ends at `field` (any path for "anywhere"), chosen by `pick`."""
    paths = [p for p in _walk_json(tree) if field == "anywhere" or (p and p[-1] == field)]
    if not paths:
        paths = [p for p in _walk_json(tree) if isinstance(_get(tree, p), dict)] or [()]
        path = paths[pick % len(paths)]
        return (*path, field) if field != "anywhere" else path
    return paths[pick % len(paths)]


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _apply_json_file(case: Case, m: Mutation) -> None:
    obj = case.read_json(m.target)
    path = _pick_node(obj, m.param("field", "anywhere"), m.param("pick"))
    data = _dumps(_set_path(obj, path, m.param("value"))).encode()
    if m.target in case.template.listed:
        case.rewrite_listed(m.target, data)
    else:
        (case.root / m.target).write_bytes(data)


def _apply_index(case: Case, m: Mutation) -> None:
    """`index.lie`; the step must be found damaged when the bytes the entry now names are not
    the chunk its hash says (or lie outside its pack): `verify` and `restore` read them."""
    index = case.read_json(m.target)
    chunks = index["chunks"]
    names = sorted(chunks)
    name = names[m.param("pick") % len(names)]
    pack, offset, nbytes, digest = chunks[name]
    step, item, _ = case.template.listed[m.target]
    item_dir = case.root / case.template.steps[step] / item
    packs = sorted({entry[0] for entry in chunks.values()})
    size = (item_dir / pack).stat().st_size
    to = m.param("to")
    if to == "other chunk":
        others = [chunks[n] for n in names if n != name and chunks[n][0] == pack]
        if others:
            offset = others[m.param("pick") % len(others)][1]
    elif to == "shifted":
        offset += m.param("by")
    elif to == "other pack" and len(packs) > 1:
        pack = packs[(packs.index(pack) + 1) % len(packs)]
    elif to == "past the end":
        offset = size - nbytes + m.param("by")
    chunks[name] = [pack, offset, nbytes, digest]
    case.rewrite_listed(m.target, json.dumps(index).encode())
    path = item_dir / pack
    data = path.read_bytes()[offset : offset + nbytes] if path.is_file() else b""
    if len(data) != nbytes or xxhash.xxh3_128_hexdigest(data) != digest:
        case.expect.damaged.add(step)


def _apply_metrics(case: Case, m: Mutation) -> None:
    path = case.root / m.target
    whole = m.param("whole")
    if whole is not None:
        path.write_bytes(whole.encode("utf-8", "surrogateescape"))
        return
    body = json.loads(path.read_bytes()) if path.exists() else {"metrics": {}}
    body["metrics"][m.param("key")] = m.param("value")
    if m.param("crc"):
        path.write_bytes(checked_json(body))
    else:
        path.write_bytes(_dumps(body).encode())


def _replace(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _apply_fs(case: Case, m: Mutation) -> None:
    path = case.root / m.target
    sub = m.kind.split(".", 1)[1]
    before = path.read_bytes() if path.is_file() else None
    if sub == "symlink":
        to = m.param("to")
        if to == "<self>":
            link = path.name
        elif to == "<other>":
            link = os.path.relpath(case.root / m.param("other"), path.parent)
        elif to == "<dangling>":
            link = "no-such-file"
        else:
            link = case.sentinel_path(to, m.param("absolute"), path.parent)
        _replace(path)
        os.symlink(link, path)
        case.changed(m.target, before)
    elif sub == "fifo":
        _replace(path)
        os.mkfifo(path)
        case.changed(m.target, before)
    elif sub == "missing":
        _replace(path)
        case.changed(m.target, before)
    elif sub == "extra":
        parent = case.root / m.target
        new = parent / m.param("name")
        if new.exists() or new.is_symlink() or not parent.is_dir():
            return
        what = m.param("what")
        if what == "step" and parent != case.root:
            what = "dir"  # a copy of a step inside itself would never end
        if what == "file":
            new.write_bytes(b"extra")
        elif what == "dir":
            new.mkdir()
            (new / "inside").write_bytes(b"extra")
        elif what == "link":
            os.symlink(case.sentinel_path(m.param("to"), True, parent), new)
        elif what == "fifo":
            os.mkfifo(new)
        else:  # a copy of a real step under this name
            shutil.copytree(
                case.root / next(iter(case.template.steps.values())), new, symlinks=True
            )
    elif sub == "lock":
        what = m.param("what")
        _replace(path)
        if what == "link":
            os.symlink(case.sentinel_path(m.param("to"), m.param("absolute"), path.parent), path)
        elif what == "dangling":
            os.symlink(str(case.sentinel / "no-such-lock"), path)
        elif what == "hardlink":  # tar and rsync -H keep them; the sentinel is on this disk
            target = case.sentinel / m.param("to")
            os.link(target / "c.txt" if target.is_dir() else target, path)
        elif what == "dir":
            path.mkdir()
        elif what == "fifo":
            os.mkfifo(path)
    elif sub == "dropped_dir":
        _replace(path)
        what = m.param("what")
        if what == "link":
            os.symlink(case.sentinel_path(m.param("to"), False, path.parent), path)
        elif what == "dir_with_link":
            path.mkdir()
            os.symlink(case.sentinel_path(m.param("to"), True, path), path / "inside")
        else:
            path.write_bytes(b"not a directory")


def _apply_tfdata(case: Case, m: Mutation) -> None:
    data = bytearray((case.root / m.target).read_bytes())
    if m.kind == "tfdata.crafted":
        case.apply(dataclasses.replace(m, kind="bytes.crafted", params=m.params))
        return
    magic = len(b"CAIRN-TFDATA-1\n")
    (count,) = struct.unpack_from("<Q", data, magic)
    field, value = m.param("field"), m.param("value")
    if field == "count":
        struct.pack_into("<Q", data, magic, value)
    elif field == "length" and count:
        struct.pack_into("<Q", data, magic + 8 + 8 * (value % count), value)
    elif field == "swap" and count > 1:  # two pieces' lengths exchanged: the sum still fits
        a, b = magic + 8, magic + 16
        data[a : a + 8], data[b : b + 8] = data[b : b + 8], data[a : a + 8]
    case.rewrite_listed(m.target, bytes(data))


def _apply_t5x(case: Case, m: Mutation) -> None:
    import msgpack

    path = case.root / m.target
    kind = m.kind.split(".", 1)[1]
    if kind == "whole":
        path.write_bytes(T5X_WHOLE[m.param("whole")])
        return
    body = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    nodes = [p for p in _walk_msgpack(body) if p]
    if kind == "chunk_key":
        chunked = [p for p in nodes if p[-1] == "chunks" and isinstance(_get(body, p), dict)]
        nodes = [(*p, k) for p in chunked for k in _get(body, p)] or nodes
    where = nodes[m.param("pick") % len(nodes)]
    parent = _get(body, where[:-1])
    if kind in ("chunk_key", "map_key") and isinstance(parent, dict):
        parent[m.param("key")] = parent.pop(where[-1])
    else:
        parent[where[-1]] = _msgpack_weird()[m.param("value")]
    path.write_bytes(msgpack.packb(body, use_bin_type=True))


def _walk_msgpack(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk_msgpack(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk_msgpack(v, (*path, i))


def _apply_yaml(case: Case, m: Mutation) -> None:
    (case.root / m.target).write_bytes(m.param("text").encode("utf-8", "surrogateescape"))


APPLY: dict[str, Callable[[Case, Mutation], None]] = {
    "tfdata": _apply_tfdata,
    "sb": _apply_yaml,
    "manifest": _apply_manifest,
    "bytes": _apply_bytes,
    "tree.edit": _apply_json_file,
    "zarr.edit": _apply_json_file,
    "data.edit": _apply_json_file,
    "json.edit": _apply_json_file,
    "state.edit": _apply_json_file,
    "metrics.edit": _apply_metrics,
    "index.lie": _apply_index,
    "t5x": _apply_t5x,
    "fs": _apply_fs,
}


# ---------------------------------------------------------------------------- running a case


class Hang(BaseException):
    """Raised in the main thread when one operation runs longer than OP_SECONDS."""


def _raise_hang(signum: int, frame: Any) -> None:
    raise Hang(f"still running after {OP_SECONDS:.0f} s")


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Interrupt the main thread with Hang after `seconds` (SIGUSR1, so pytest-timeout's SIGALRM
    is left alone). A blocked open() of a FIFO returns EINTR and the handler raises."""
    previous = signal.signal(signal.SIGUSR1, _raise_hang)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGUSR1))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)


def unblock_fifos(path: Path) -> None:
    """Open every FIFO under `path` for writing once, so that a thread blocked opening it for
    reading goes on (and reads end-of-file)."""
    for top, dnames, fnames in os.walk(path):
        for name in [*dnames, *fnames]:
            full = os.path.join(top, name)
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(os.lstat(full).st_mode):
                    os.close(os.open(full, os.O_RDWR | os.O_NONBLOCK))


_CAIRN_DIRS = tuple(
    os.path.realpath(os.path.dirname(m.__file__ or "")) + os.sep
    for m in (cairn.manager, cairn.handlers)
)
_CAIRN_SOURCES = tuple(
    os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..", d)) + os.sep
    for d in ("manager", "handlers")
)


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{_short_path(f.filename)}:{f.lineno} {(f.line or '').strip()[:90]}"


def _short_path(filename: str) -> str:
    for marker in ("/site-packages/", "/work/main/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def _raised_by_cairn(e: BaseException) -> bool:
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False
    f = frames[-1]
    real = os.path.realpath(f.filename)
    return real.startswith(_CAIRN_DIRS + _CAIRN_SOURCES) and (f.line or "").lstrip().startswith(
        "raise"
    )


# Plain exceptions a family's API may raise on purpose (from a `raise` in cairn's code): invalid
# arguments everywhere, and SpeechBrain's own RuntimeErrors ("missing a load path for ...").
PLAIN: dict[str, tuple[type[BaseException], ...]] = {
    "speechbrain": (ValueError, TypeError, RuntimeError),
}


def problem_with(e: BaseException, family: str = "cairn") -> str | None:
    """None if `e` is an error cairn may raise on a crafted directory, else what is wrong."""
    if isinstance(e, CommitError):
        cause = e.__cause__
        if cause is None:
            return None
        inner = problem_with(cause, family)
        return None if inner is None else f"CommitError caused by {inner}"
    if isinstance(e, CairnError):
        return None
    if type(e) in PLAIN.get(family, (ValueError, TypeError)) and _raised_by_cairn(e):
        return None
    return f"{type(e).__name__}: {str(e)[:160]!r} at {_where(e)}"


@dataclasses.dataclass
class Report:
    failures: list[str] = dataclasses.field(default_factory=list)
    outcomes: list[str] = dataclasses.field(default_factory=list)  # "op: ok" / "op: ErrorType"
    peak: int = 0


class _Failed:
    pass


FAILED = _Failed()


class Runner:
    def __init__(self, case: Case, root: str | None = None) -> None:
        self.case = case
        self.root = str(case.root) if root is None else root  # a path, or an s3:// URL
        self.report = Report()

    def attempt(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            with deadline(OP_SECONDS):
                result = fn(*args, **kwargs)
        except Hang as e:
            self.report.failures.append(f"{op}: hang ({e})")
            with Watch.paused():  # the harness's own walk
                unblock_fifos(self.case.path)
            return FAILED
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            problem = problem_with(e, self.case.template.family)
            self.report.outcomes.append(f"{op}: {type(e).__name__}")
            if problem is not None:
                self.report.failures.append(f"{op}: {problem}")
            return FAILED
        self.report.outcomes.append(f"{op}: ok")
        return result

    @contextlib.contextmanager
    def traced(self) -> Iterator[None]:
        """Measure the Python heap's peak (tracemalloc: slow, so only around the manager calls;
        the command line goes through the same calls)."""
        tracemalloc.start()
        try:
            yield
        finally:
            self.report.peak = max(self.report.peak, tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    def fail(self, message: str) -> None:
        self.report.failures.append(message)


def _strict_json(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


_CONTROL = {c for c in range(0x20) if c not in (0x09, 0x0A)} | {0x7F} | set(range(0x80, 0xA0))


def _contains_mark(obj: Any) -> bool:
    """Whether SENTINEL_MARK is anywhere in a restored object (iterative: it may be deep)."""
    todo = [obj]
    while todo:
        node = todo.pop()
        if isinstance(node, str) and SENTINEL_MARK in node:
            return True
        if isinstance(node, Mapping):
            todo.extend(node.keys())
            todo.extend(node.values())
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
    return False


def cli(runner: Runner, *argv: str) -> None:
    from cairn.manager._surfaces.cli import main

    out, err = io.StringIO(), io.StringIO()
    name = "cairn " + " ".join("DIR" if a == runner.root else a for a in argv)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = runner.attempt(name, _cli_main, main, list(argv))
    if code is FAILED:
        # The command line must turn every error into one line and status 2: anything escaping is
        # a traceback for its user.
        if not runner.report.failures or not runner.report.failures[-1].startswith(name):
            runner.fail(f"{name}: an exception escaped main(): {runner.report.outcomes[-1]}")
        return
    text = out.getvalue() + err.getvalue()
    if code not in (0, 1, 2):
        runner.fail(f"{name}: exit status {code!r}")
    if "Traceback" in err.getvalue():
        runner.fail(f"{name}: a traceback on stderr")
    bad = sorted({f"{ord(c):#04x}" for c in text if ord(c) in _CONTROL})
    if bad:
        runner.fail(f"{name}: control characters {bad} in the output")
    if "--json" in argv and code in (0, 1):
        try:
            _strict_json(out.getvalue())
        except ValueError as e:
            runner.fail(f"{name}: --json output is not strict JSON: {e}")


def _cli_main(main: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return e.code if isinstance(e.code, int) else 2


def _files_size(path: Path) -> int:
    total = 0
    for top, _, fnames in os.walk(path):
        for name in fnames:
            with contextlib.suppress(OSError):
                st_ = os.lstat(os.path.join(top, name))
                if stat.S_ISREG(st_.st_mode):
                    total += st_.st_size
    return total


# What restoring a damaged step may raise: damage, or a handler this reader does not have.
DAMAGE_ERRORS = ("CorruptCheckpointError", "UnsupportedFormatError")


def _reads(runner: Runner, mgr: CheckpointManager, expect: Expect) -> None:
    steps = runner.attempt("all_steps", mgr.all_steps)
    runner.attempt("latest_step", mgr.latest_step)
    if steps is FAILED:
        return
    for step in steps:
        runner.attempt(f"info({step})", mgr.info, step)
        runner.attempt(f"metrics({step})", mgr.metrics, step)
        runner.attempt(f"describe({step})", mgr.describe, step)
        problems = runner.attempt(f"verify({step})", mgr.verify, step)
        if step in expect.damaged | expect.unread and problems is not FAILED and not problems:
            runner.fail(
                f"verify({step}): a listed file was changed, yet verify reports the step intact"
            )
        if runner.case.template.family == "tfdata":  # TensorFlow reads the pieces natively
            runner.attempt(
                f"restore({step}, dataset=iterator)",
                mgr.restore,
                step,
                {"dataset": tf_iterator(0)},
            )
        restored = runner.attempt(f"restore({step})", mgr.restore, step)
        if step in expect.damaged and restored is not FAILED:
            runner.fail(f"restore({step}): a listed file was changed, yet the step restored")
        if restored is not FAILED and _contains_mark(restored):
            runner.fail(f"restore({step}): returned data read from the sentinel tree")
        raised = runner.report.outcomes[-1].split(": ", 1)[1]
        if step in expect.damaged and raised not in (*DAMAGE_ERRORS, "ok"):
            runner.fail(f"restore({step}): a changed file raised {raised}, not {DAMAGE_ERRORS}")
        cairns = runner.case.template.items  # an Orbax step has no checksums: verify says []
        if raised == "CorruptCheckpointError" and problems == [] and step in cairns:
            runner.fail(f"verify({step}) calls the step intact, and restore({step}) refuses it")
    restored = runner.attempt("restore()", mgr.restore)
    if restored is not FAILED and _contains_mark(restored):
        runner.fail("restore(): returned data read from the sentinel tree")


def _writes(runner: Runner, root: str, prefix: str) -> None:
    """A writer's start, an incremental save of the state the template's newest step holds (so
    that it links or copies what that step's manifest and indexes say is unchanged), late
    metrics and a restore. The saved step must restore as what was saved: a crafted record or
    index of the step before may cost a link, never the new step (issue 42)."""
    writer = runner.attempt(
        "open writable",
        CheckpointManager,
        root,
        keep=KeepLatest(2),
        keep_items=KEEP_ITEMS,
        handlers=PACKED if runner.case.template.family == "packed" else HANDLERS,
        step_prefix=prefix,
        incremental=True,
    )
    if writer is FAILED:
        return
    try:
        steps = runner.attempt("writer all_steps", writer.all_steps)
        new = max(steps, default=0) + 1 if steps is not FAILED else 100
        state = _state(max(runner.case.template.steps))
        saved = runner.attempt(
            f"save({new})",
            writer.save,
            new,
            {"state": state, "config": {"lr": 0.2}, "extra": {"x": np.ones(3)}},
            metrics={"loss": 0.01},
            force=True,
        )
        done = runner.attempt("wait_until_finished", writer.wait_until_finished)
        if saved is True and done is not FAILED:
            got = runner.attempt(f"restore({new}), saved", writer.restore, new, {"state": None})
            if got is FAILED or not _same_tree(got["state"], state):
                runner.fail(
                    f"save({new}): the incremental save of a known state made a step that does "
                    "not restore as that state (something of the step before was carried on)"
                )
        runner.attempt(f"record_metrics({new})", writer.record_metrics, new, {"eval_loss": 0.5})
        runner.attempt("writer restore()", writer.restore)
    finally:
        runner.attempt("close writable", writer.close)


def _same_tree(got: Any, want: Any) -> bool:
    if isinstance(want, Mapping):
        return (
            isinstance(got, Mapping)
            and set(got) == set(want)
            and all(_same_tree(got[k], v) for k, v in want.items())
        )
    return bool(np.array_equal(np.asarray(got), np.asarray(want)))


def _t5x(runner: Runner, root: str) -> None:
    """What a T5X job and its tools do with a directory of T5X's own steps."""
    from cairn.manager import t5x as checkpoints

    runner.attempt("t5x all_steps", checkpoints.all_steps, root)
    runner.attempt("t5x latest_step", checkpoints.latest_step, root)
    for step in sorted(runner.case.template.steps):
        runner.attempt(f"load_t5x_checkpoint({step})", checkpoints.load_t5x_checkpoint, root, step)
    ckpt = runner.attempt(
        "t5x Checkpointer", checkpoints.Checkpointer, t5x_train_state(), None, root
    )
    if ckpt is FAILED:
        return
    try:
        runner.attempt("t5x restore()", ckpt.restore)
        for step in sorted(runner.case.template.steps):
            runner.attempt(f"t5x restore(step={step})", ckpt.restore, step=step)
    finally:
        runner.attempt("t5x close", ckpt.close)


def _speechbrain(runner: Runner, root: str) -> None:
    """What a SpeechBrain recipe does at start and at each epoch's end."""
    from cairn.manager.speechbrain import Checkpointer

    checkpointer = runner.attempt("Checkpointer", Checkpointer, root, sb_recoverables())
    if checkpointer is FAILED:
        return
    try:
        runner.attempt("list_checkpoints", checkpointer.list_checkpoints)
        runner.attempt("find_checkpoints(min_key)", checkpointer.find_checkpoints, min_key="loss")
        runner.attempt("recover_if_possible()", checkpointer.recover_if_possible)
        runner.attempt(
            "recover_if_possible(min_key)", checkpointer.recover_if_possible, min_key="loss"
        )
        runner.attempt(
            "save_and_keep_only",
            checkpointer.save_and_keep_only,
            meta={"loss": 0.1},
            num_to_keep=2,
            min_keys=["loss"],
        )
    finally:
        runner.attempt("Checkpointer.close", checkpointer.close)


def operations(runner: Runner) -> None:
    """Everything a reader, a writer and a person at the command line do with a directory."""
    case, root = runner.case, runner.root
    prefix, family = case.template.step_prefix, case.template.family
    with runner.traced():
        mgr = runner.attempt(
            "open read_only",
            CheckpointManager,
            root,
            read_only=True,
            step_prefix=prefix,
        )
        if mgr is not FAILED:
            try:
                _reads(runner, mgr, case.expect)
            finally:
                runner.attempt("close read_only", mgr.close)
    options = ["--step-prefix", prefix]
    cli(runner, "ls", root, *options)
    cli(runner, "ls", root, "--verify", "--json", "--keep-latest", "1", *options)
    cli(runner, "verify", root, *options)
    cli(runner, "verify", root, "--json", *options)
    for step in sorted(case.template.steps)[:3]:
        cli(runner, "show", root, str(step), *options)
        cli(runner, "show", root, str(step), "--json", *options)
    cli(runner, "metrics", root, *options)
    cli(runner, "metrics", root, "--json", *options)
    cli(runner, "gc", root, "--keep-latest", "1", "--dry-run", *options)

    with runner.traced():
        if family == "speechbrain":
            _speechbrain(runner, root)
        else:
            if family == "t5x":
                _t5x(runner, root)
            _writes(runner, root, prefix)
    cli(runner, "gc", root, "--keep-latest", "1", *options)
    cli(runner, "ls", root, *options)


def run_case(template: Template, work: Path, muts: list[Mutation]) -> Report:
    """Copy the template to `work`, apply `muts`, run every operation, check what must hold."""
    case = Case(template, work)
    case.apply_all(muts)
    runner = Runner(case)
    _run_checked(runner, writable=case.root)
    return runner.report


def _run_checked(runner: Runner, writable: Path) -> None:
    """`operations`, watched: the sentinel, writes outside `writable`, the heap's peak."""
    case = runner.case
    before = tree_digest(case.sentinel)
    limit = _files_size(case.path) + ALLOC_SLACK
    try:
        with Watch.watching(case.sentinel, writable=(writable,)):
            operations(runner)
    finally:
        unblock_fifos(case.path)
    if runner.report.peak > limit:
        runner.fail(
            f"allocation: the Python heap peaked at {runner.report.peak / 2**20:.0f} MiB, the "
            f"directory holds {(limit - ALLOC_SLACK) / 2**20:.1f} MiB"
        )
    after = tree_digest(case.sentinel)
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        runner.fail(f"sentinel: changed beside the root: {changed[:8]}")
    if Watch.seen:
        runner.fail(f"touched through the checkpoint: {sorted(set(Watch.seen))[:4]}")


# ---------------------------------------------------------------------------- object stores

# Keys a stranger can put under a directory in a bucket (relative to its root prefix), which a
# filesystem cannot hold: "." and ".." parts, empty parts, an object and a "directory" of one name.
S3_KEYS = [
    "checkpoint_1/state/../../../sentinel/a.txt",
    "checkpoint_1/config/../../../sentinel/injected",
    "checkpoint_1/./state/tree.json",
    "checkpoint_1//state/tree.json",
    "checkpoint_1/state/tree.json/child",
    "checkpoint_1/extra/tree.json",
    "checkpoint_1/._CHECKPOINT.json.tmp-" + "c" * 32,
    "checkpoint_2/metrics.json",
    "checkpoint_3/_CHECKPOINT.json/x",
    "checkpoint_9",
    "checkpoint_9/",
    "checkpoint_9/_CHECKPOINT.json",
    "checkpoint_4/_CHECKPOINT.json",
    "checkpoint_4/../../sentinel/a.txt",
    "checkpoint_007/_CHECKPOINT.json",
    "checkpoint_4.tmp-" + "a" * 32 + "/x",
    ".trash-checkpoint_1-" + "b" * 32 + "/x",
    "../sentinel/_CHECKPOINT.json",
    "checkpoint_1/\x1b[31m/x",
    ".cairn.lock",
    ".claim",
]
S3_CONTENTS = [
    "x",
    "empty",
    "manifest",
    "claim",
    "lease_expired",
    "lease_live",
    "garbage",
    "lease_infinity",
    "lease_nan",
    "lease_1e300",
    "lease_digits",
    "lease_deep",
    "lease_ahead",
    "lease_pids",
]


def s3_content(kind: str, case: Case) -> bytes:
    if kind == "manifest":  # a valid manifest of another step
        return (case.root / next(iter(case.template.steps.values())) / MANIFEST).read_bytes()
    return {
        "x": b"x",
        "empty": b"",
        "claim": b'{"cairn_claim": "save", "id": "fuzz"}',
        "lease_expired": b'{"owner": "elsewhere:1:fuzz", "expires": 0}',
        "lease_live": b'{"owner": "elsewhere:1:fuzz", "expires": 1e12}',
        "garbage": b"\x00\xff" * 8,
        # issue 42: numbers no clock or pid has, JSON deeper than Python parses
        "lease_infinity": b'{"owner": "elsewhere:1:fuzz", "expires": Infinity}',
        "lease_nan": b'{"owner": "elsewhere:1:fuzz", "expires": NaN}',
        "lease_1e300": b'{"owner": "elsewhere:1:fuzz", "expires": 1e300}',
        "lease_digits": b'{"owner": "elsewhere:1:fuzz", "expires": ' + b"9" * 400 + b"}",
        "lease_deep": b"[" * 100_000 + b"]" * 100_000,
        "lease_ahead": json.dumps({"owner": "x:1:fuzz", "expires": time.time() + 9e5}).encode(),
        "lease_pids": b'{"owner": "here:99999999999999:x", "expires": 1, "writer": 1e20}',
    }[kind]


def s3_mutations(t: Template) -> st.SearchStrategy[Mutation]:
    """A cairn directory in a bucket: the manifest, bytes and metadata mutations (links and FIFOs
    do not exist there), and objects under keys no filesystem allows."""
    keys = st.builds(
        lambda key, content: mutation("s3.key", key, content=content),
        st.sampled_from(S3_KEYS),
        st.sampled_from(S3_CONTENTS),
    )
    files = st.one_of(manifest_mutations(t), byte_mutations(t), metadata_mutations(t))
    return _half_and_half(keys, files)


def _upload(store: Any, local: Path, prefix: str) -> None:
    for top, _, fnames in os.walk(local):
        for name in fnames:
            path = Path(top, name)
            rel = path.relative_to(local).as_posix()
            if path.is_symlink() or not path.is_file() or rel == LOCK:
                continue  # an object store has no links, FIFOs, or lock file
            store.write(prefix + rel, path.read_bytes())


def _remote(store: Any, prefix: str) -> dict[str, bytes | None]:
    return {key: store.read(key) for key in store.list_keys(prefix)}


def run_s3_case(template: Template, work: Path, muts: list[Mutation], bucket: str) -> Report:
    """A case in a bucket (`bucket` is ``s3://name``; each case under its own prefix): the
    template and the sentinel uploaded side by side, then every operation on the URL. Staging
    and cache directories go under the case's own temporary directory."""
    from cairn.manager._storage.objectstore import ObjectStore, StorageOptions

    case = Case(template, work)
    case.apply_all([m for m in muts if m.kind != "s3.key"])
    url = f"{bucket}/{work.name}"
    store = ObjectStore(url, StorageOptions())
    _upload(store, case.root, "root/")
    _upload(store, case.sentinel, "sentinel/")
    for m in muts:
        if m.kind == "s3.key":
            store.write("root/" + m.target, s3_content(m.param("content"), case))
    remote = _remote(store, "sentinel/")
    runner = Runner(case, root=f"{url}/root")
    scratch = work / "tmp"
    scratch.mkdir()
    saved, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        _run_checked(runner, writable=scratch)
    finally:
        tempfile.tempdir = saved
    after = _remote(store, "sentinel/")
    if after != remote:
        changed = sorted(k for k in remote.keys() | after.keys() if remote.get(k) != after.get(k))
        runner.fail(f"sentinel: objects beside the root changed: {changed[:8]}")
    return runner.report


def remove_case(path: Path) -> None:
    """Remove a case directory (links are removed, never followed)."""
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def kind_of(muts: list[Mutation]) -> str:
    return "+".join(sorted({m.kind for m in muts}))


BUILDERS: dict[str, Callable[[Path], Template]] = {
    "cairn": build_cairn_template,
    "packed": build_packed_template,
    "orbax": build_orbax_template,
    "speechbrain": build_speechbrain_template,
    "tfdata": build_tfdata_template,
    "t5x": build_t5x_template,
}


def survey(
    template: Template, work: Path, cases: int, seed: int | None = None
) -> list[tuple[Mutation, list[str]]]:
    """Run `cases` cases drawn by Hypothesis (derandomized unless `seed`), collecting every
    failure instead of stopping at the first; each case is announced on stdout before it runs,
    so that a crash of the process names it."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    results: list[tuple[Mutation, list[str]]] = []
    counter = iter(range(10**9))

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=seed is None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(mutations(template))
    def run(m: Mutation) -> None:
        where = work / f"case-{next(counter)}"
        print(f"CASE {m!r}", flush=True)
        try:
            results.append((m, run_case(template, where, [m]).failures))
        finally:
            remove_case(where)

    (run if seed is None else with_seed(seed)(run))()
    return results


def main(argv: list[str]) -> int:
    """``python tests/support/fuzzutil.py FAMILY CASES [SEED]``: a survey in a process of its own (the
    tf.data family: a crash in native code must not take the test run down). Prints one
    ``FAIL <json>`` line per failing case; exit status 1 if there was any."""
    import logging

    logging.disable(logging.WARNING)
    family, cases = argv[0], int(argv[1])
    seed = int(argv[2]) if len(argv) > 2 else None
    with tempfile.TemporaryDirectory(prefix=f"cairn-fuzz-{family}-") as d:
        template = BUILDERS[family](Path(d) / "template")
        results = survey(template, Path(d), cases, seed)
    failing = [(m, f) for m, f in results if f]
    for m, f in failing:
        print("FAIL " + json.dumps({"mutation": repr(m), "failures": f}), flush=True)
    print(f"DONE {len(results)} cases, {len(failing)} failing", flush=True)
    return 1 if failing else 0


if __name__ == "__main__":
    # Run by path (test_fuzz.py): tests/, not tests/support/, holds the `support` package.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))
