"""TensorBoard metrics for T5X's best-checkpoint retention: event files read as untrusted
TFRecords (incrementally, by `_EventCache`), populate_metrics_for_steps, and the keep policy of
SaveBestCheckpointer."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import struct
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import crc32c

from cairn.handlers.errors import CorruptCheckpointError
from cairn.handlers.io import open_regular
from cairn.manager._core.policies import StepView
from cairn.manager._core.validate import as_step
from cairn.manager._surfaces.t5x.state import PathLike

log = logging.getLogger("cairn")


def _event_files(run: Path) -> list[Path]:
    """The event files of a run directory (``*tfevents*`` entries that are not directories)."""
    try:
        with os.scandir(run) as entries:
            return sorted(
                Path(e.path)
                for e in entries
                if "tfevents" in e.name and not e.is_dir(follow_symlinks=False)
            )
    except OSError:  # no such run directory
        return []


def populate_metrics_for_steps(
    checkpoints_dir: PathLike, metric_name: str, steps: Iterable[int]
) -> dict[int, float]:
    """Read ``{run}/{tag}`` from the TensorBoard event files under `checkpoints_dir`, for `steps`.

    The run is the longest leading part of `metric_name` that is a directory of event files under
    `checkpoints_dir` (T5X's model directory: ``train``, ``inference_eval/...``). Every event is
    read (no sampling), scalar (``simple_value``) and tensor summaries alike; when a step was
    written twice (a restarted run), the later event wins. Returns ``{step: value}`` for the steps
    found, as floats.

    Event files are read as untrusted input (see `_EventCache`): a damaged or crafted record,
    a value that is not a finite number, a link or a FIFO named like an event file are ignored
    with a warning.
    """
    if not isinstance(metric_name, str) or not metric_name.strip("/"):
        raise ValueError(
            f"metric_name must be '{{run}}/{{tag}}' (e.g. 'train/accuracy'), got {metric_name!r}"
        )
    wanted = {as_step(s) for s in steps}
    root, parts = Path(os.fspath(checkpoints_dir)), metric_name.strip("/").split("/")
    for cut in range(len(parts) - 1, 0, -1):
        run, tag = root.joinpath(*parts[:cut]), "/".join(parts[cut:])
        files = _event_files(run)
        if files:
            break
    else:
        return {}
    found: dict[int, tuple[float, float]] = {}
    for file in files:
        for step, (wall_time, number) in _EVENTS.values(file, tag).items():
            if step in wanted and (step not in found or wall_time >= found[step][0]):
                found[step] = (wall_time, number)
    return {step: value for step, (_, value) in sorted(found.items())}


_HEADER = 12  # a TFRecord: uint64 length, uint32 masked CRC-32C of it, data, its masked CRC


def _masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's checksum: a CRC-32C, rotated and offset ("masked")."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _event_value(value: Any) -> float | None:
    """The number in a summary value: its simple_value, or a tensor of one real element; None for
    anything else (histograms, text, a tensor of several elements, a malformed tensor)."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if not value.HasField("tensor"):
        return None
    if any(d.size != 1 for d in value.tensor.tensor_shape.dim):  # a crafted shape allocates
        return None
    from tensorboard.util import tensor_util

    try:
        array = tensor_util.make_ndarray(value.tensor)
    except (TypeError, ValueError, KeyError) as e:  # content that does not match its dtype
        log.warning("cairn: ignoring a malformed tensor summary %r: %s", value.tag, e)
        return None
    if array.size == 1 and array.dtype.kind in "fiub":
        return float(array.reshape(()))
    return None


@dataclasses.dataclass
class _EventFile:
    """How far one event file has been read, and the values found so far (tag -> step ->
    (wall_time, value))."""

    identity: tuple[int, int]  # (device, inode): a file replaced under the same name is new
    offset: int = 0
    damaged: bool = False  # a record failed its checksum: the rest of the file is ignored
    warned_at: int = -1  # the offset of an incomplete last record already warned about
    by_tag: dict[str, dict[int, tuple[float, float]]] = dataclasses.field(default_factory=dict)

    def read(self, fd: int, size: int, file: Path) -> None:
        """Read the records after `offset`, each checked against its CRCs before it is parsed,
        and never more bytes than the file holds (a length field is trusted only that far)."""
        from google.protobuf.message import DecodeError
        from tensorboard.compat.proto import event_pb2

        while not self.damaged and self.offset + _HEADER <= size:
            header = os.pread(fd, _HEADER, self.offset)
            length, length_crc = struct.unpack("<QI", header)
            if _masked_crc(header[:8]) != length_crc:
                self._damaged(file, "its length field fails its checksum")
                return
            if length + 4 > size - self.offset - _HEADER:
                if self.warned_at != self.offset:  # once: it may be a record being written
                    self.warned_at = self.offset
                    log.warning(
                        "cairn: event file %s: the record at byte %d says %d bytes, past the end "
                        "of the file (%d bytes); it is read again when the file grows",
                        file,
                        self.offset,
                        length,
                        size,
                    )
                return
            data = memoryview(os.pread(fd, length + 4, self.offset + _HEADER))
            if len(data) < length + 4:  # truncated meanwhile
                return
            if _masked_crc(data[:length]) != struct.unpack("<I", data[length:])[0]:
                self._damaged(file, "its data fails its checksum")
                return
            self.offset += _HEADER + length + 4
            try:
                event = event_pb2.Event.FromString(data[:length])
            except DecodeError as e:
                log.warning(
                    "cairn: event file %s: ignoring a record that is not an event: %s", file, e
                )
                continue
            self._add(event, file)

    def _add(self, event: Any, file: Path) -> None:
        for value in event.summary.value:
            number = _event_value(value)
            if number is None:
                continue
            if not (math.isfinite(number) and math.isfinite(event.wall_time)):
                log.warning(
                    "cairn: event file %s: ignoring %r at step %d: value %r, wall_time %r",
                    file,
                    value.tag,
                    event.step,
                    number,
                    event.wall_time,
                )
                continue
            steps = self.by_tag.setdefault(value.tag, {})
            old = steps.get(event.step)
            if old is None or event.wall_time >= old[0]:  # a step written twice: the later
                steps[event.step] = (event.wall_time, number)

    def _damaged(self, file: Path, why: str) -> None:
        self.damaged = True
        log.warning(
            "cairn: event file %s: ignoring the rest of it from byte %d: %s", file, self.offset, why
        )


class _EventCache:
    """Values read from TensorBoard event files, by file and tag, read incrementally.

    SaveBestCheckpointer asks at every retention; re-reading whole event files each time (as T5X
    does) costs O(history) per save. Each file's position is kept, so each call reads only the
    events appended since the last. A file replaced (another inode, or shorter) is read afresh.
    The records are read here, not by TensorBoard's loader: TensorFlow's record reader allocates
    whatever a record's length field says (a length of 2**60 kills the process with SIGSEGV).
    Threads: the commit thread and the caller's may both ask; one lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, _EventFile] = {}

    def values(self, file: Path, tag: str) -> dict[int, tuple[float, float]]:
        key = str(file)
        with self._lock:
            try:
                fd = open_regular(file)  # a link is not followed, a FIFO does not block
            except (OSError, CorruptCheckpointError) as e:
                log.warning("cairn: ignoring event file %s: %s", file, e)
                self._files.pop(key, None)
                return {}
            try:
                info = os.fstat(fd)
                state = self._files.get(key)
                identity = (info.st_dev, info.st_ino)
                if state is None or state.identity != identity or info.st_size < state.offset:
                    state = self._files[key] = _EventFile(identity)
                state.read(fd, info.st_size, file)
            finally:
                os.close(fd)
            return dict(state.by_tag.get(tag, {}))


_EVENTS = _EventCache()


def _check_metric_name(value: Any, what: str) -> str:
    """A metric to monitor: ``{run}/{tag}``. As in T5X, a name with no run (``"loss"``) is
    accepted and never found, so no step has a value for it; a warning says so."""
    if not isinstance(value, str) or not value.strip("/"):
        raise ValueError(f"{what} must be '{{run}}/{{tag}}' (e.g. 'train/loss'), got {value!r}")
    if "/" not in value.strip("/"):
        log.warning(
            "cairn: %s=%r names no run ('{run}/{tag}', e.g. 'train/%s'): no step will have a "
            "value for it, so retention treats every step as one without metrics (as T5X does)",
            what,
            value,
            value.strip("/"),
        )
    return value


@dataclasses.dataclass(frozen=True)
class _KeepBestFromEvents:
    """SaveBestCheckpointer's retention: the latest step, the `n` best by a TensorBoard metric,
    steps that are multiples of `force_keep_period`, and (if `keep_without_metrics`) every step
    whose metric has not been written yet. NaN counts as missing."""

    n: int
    metric: str
    mode: Literal["min", "max"]
    keep_without_metrics: bool
    force_keep_period: int | None
    logdir: str

    def keep(self, steps: Sequence[StepView]) -> set[int]:
        ordered = sorted(v.step for v in steps)
        if not ordered:
            return set()
        latest = ordered[-1]
        period = self.force_keep_period
        forced = {s for s in ordered if period and s % period == 0}
        candidates = [s for s in ordered[:-1] if s not in forced]
        if len(candidates) <= self.n:
            return set(ordered)
        metrics = {
            s: v
            for s, v in populate_metrics_for_steps(self.logdir, self.metric, candidates).items()
            if not math.isnan(v)
        }
        without = {s for s in candidates if s not in metrics}
        pool = [s for s in candidates if s in metrics or not self.keep_without_metrics]
        worst = math.inf if self.mode == "min" else -math.inf
        sign = 1.0 if self.mode == "min" else -1.0
        pool.sort(key=lambda s: (sign * metrics.get(s, worst), -s))  # best first, newer on ties
        kept = {latest, *forced, *pool[: self.n]}
        return kept | without if self.keep_without_metrics else kept
