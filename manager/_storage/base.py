"""Where a checkpoint directory lives: everything the manager needs from a place, in one protocol.

`CheckpointManager` never asks which backend it is on. It calls a `Storage` (a POSIX directory,
an object store through TensorStore's kvstore, or TensorStore's in-memory kvstore for tests) to
become the writer, list and read steps, write and commit one step (`Prepared`), delete steps and
items, and write late metrics. Handlers write through the `Destination` and read through the
`Source` the storage gives them. Adding a backend means implementing these two protocols.

The commit point is the storage's: a rename of the temporary directory on POSIX, the manifest
written last with a conditional write on object stores. Either way a step without its manifest
is no step, for every reader.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from cairn.handlers import Destination, Source
from cairn.manager._format import Manifest, StepNames
from cairn.manager._layouts.base import StepView

Reclaim = Callable[[], None]  # work that frees space after a deletion, run off the commit path


@dataclasses.dataclass(frozen=True)
class Listed:
    """One step as its storage found it, before the manifest is parsed (`_catalog` does that).

    Exactly one of `manifest` (its bytes), `error` (why it cannot be read: a link, no manifest, a
    read error) and `foreign` (a step another checkpointer wrote, e.g. Orbax, described as a
    read-only manifest) is set. `metrics` are the bytes of ``metrics.json`` if it exists;
    `metrics_error` says why it could not be read.
    """

    step: int
    where: str  # the step's path or URL, for messages
    manifest: bytes | None = None
    error: Exception | None = None
    foreign: Manifest | None = None
    metrics: bytes | None = None
    metrics_error: Exception | None = None


class Prepared(Protocol):
    """One step being written, not visible to any reader until `commit`.

    Every process of a multi-process save gets one for the same step (the primary's `prepare`
    creates it); each writes its items' files through `destination`, and only the primary
    commits or aborts.
    """

    def destination(self, item: str) -> Destination:
        """Where the write phase of `item` puts its files."""
        ...

    def sync(self) -> None:
        """Make everything this process wrote into the step durable."""
        ...

    def commit(self, manifest: Manifest) -> None:
        """Write the manifest and make the step visible, atomically; StepAlreadyExistsError if
        the step appeared meanwhile, DirectoryLockedError if this writer lost its lease."""
        ...

    def abort(self) -> None:
        """Remove what was written (after a failure; the step was never visible)."""
        ...


class StepStore(Protocol):
    """The step lifecycle: list and read steps, write one (`prepare`, then `Prepared`), delete
    steps and items, late metrics and the files beside the steps.

    Threads: the manager calls it from its caller thread (listing, reading) and its commit
    thread (every change); a storage must allow both at once. Every name it reads from the
    store is untrusted: step names are parsed with `StepNames`, item and file names checked
    before they become paths or keys.
    """

    url: str  # the directory as users name it (a path or a URL), for messages
    identity: str  # one string per directory, however it was spelled (links, ``..`` resolved)
    #: whether `other_naming` is cheap (a directory's entries: POSIX) or lists every object
    #: (object stores: then only the primary looks, and only when it found no step)
    lists_cheaply: bool
    multi_process: bool  # whether several processes of one job may write a step together

    @property
    def directory(self) -> Path | str:
        """What CheckpointManager.directory returns: a Path, or the URL."""
        ...

    def location(self, name: str) -> Path | str:
        """Where step `name` is (StepInfo.path): a Path on POSIX, a URL otherwise."""
        ...

    def reuse_pages(self) -> None:
        """For a local tier's directory of parts: where its files are memory (a RAM disk), a
        deleted step's files become the next steps' files (`PosixStorage`); elsewhere nothing."""
        ...

    def clean_leftovers(self, names: StepNames) -> list[Listed]:
        """Remove what crashed writers left (temporary steps, trash, half-replaced files); the
        writer calls this once, at start-up, holding the directory. Returns every committed step
        then, as `scan` would (from the listing the clean-up read, where it read one: on an
        object store, a second listing and a read of every manifest cost a restart 0.09 s)."""
        ...

    def scan(self, names: StepNames) -> list[Listed]:
        """Every committed step, by step number."""
        ...

    def other_naming(self, names: StepNames) -> tuple[StepNames, str] | None:
        """When no entry is named as `names` expects but steps are there under another naming
        (Orbax's default is a plain number; a cairn run saved with another `step_digits` or
        prefix), that naming and who wrote them ("cairn", "orbax-checkpoint"); else None."""
        ...

    def read_step(self, names: StepNames, step: int) -> Listed | None:
        """One step read again (its manifest may have changed); None if it is gone."""
        ...

    def prepare(self, name: str, tmp_name: str, items: Iterable[str], *, create: bool) -> Prepared:
        """Start writing step `name`; `create` on the process that creates its place (the
        primary); `tmp_name` is the same on every process of a multi-process save.
        StepAlreadyExistsError if the step is committed or claimed by another writer."""
        ...

    def delete_step(self, name: str) -> Reclaim | None:
        """Retire a committed step crash-safely (from the first change on it is no step);
        returns the work that frees its space, or None."""
        ...

    def drop_item(self, name: str, manifest: Manifest, item: str) -> Reclaim | None:
        """Per-item retention: replace the step's manifest with `manifest` (which marks `item`
        dropped) atomically, then remove the item's files; a crash in between leaves files
        that `remove_dropped` clears."""
        ...

    def remove_dropped(self, steps: Mapping[str, Manifest]) -> None:
        """Remove files of items that manifests mark dropped (`steps` maps names to manifests)."""
        ...

    def write_metrics(self, name: str, body: bytes) -> None:
        """Replace ``metrics.json`` of a committed step atomically."""
        ...

    def create_root_file(self, name: str, body: bytes) -> bool:
        """Create the file `name` beside the steps, atomically and only if it does not exist;
        False if it did (then it is left as it is)."""
        ...

    def remove_sync_files(self, names: Sequence[str]) -> None:
        """Remove these meeting files of writer processes (`_writer.StoredMeetings`), made
        with `create_root_file`; ValueError for any other name, before anything is removed."""
        ...

    def read_root_file(self, name: str) -> bytes | None:
        """The bytes of the file `name` beside the steps, or None if there is none."""
        ...

    def source(self, name: str, item: str) -> Source:
        """Where a restore reads `item` of step `name` from."""
        ...

    def view(self, name: str) -> StepView:
        """A read-only view of the root's entry `name` (`_layouts.base.StepView`): what a
        foreign layout reads, and what `Retention.delete_directory` looks into first."""
        ...

    def foreign_source(self, name: str, item: str) -> Source:
        """Where a restore reads `item` of the foreign step `name` (one a `_layouts` layout
        read: its manifest lists no files) from: its directory in place on POSIX; on an object
        store, a source whose `local_directory` downloads every object under the item's prefix
        into a private local directory, which its `release` removes."""
        ...

    def close(self) -> None:
        """Free local resources (staging and download directories); not the lock."""
        ...


class WriterHold(Protocol):
    """The directory's one writer: a lock on POSIX, a lease on object stores, shared with the
    writer process a trainer starts (``writer="process"``)."""

    def acquire(self) -> None:
        """Become the directory's one writer (a lock, a lease): DirectoryLockedError if another
        writer holds it, ReadOnlyError if the place cannot be written."""
        ...

    def release(self) -> None: ...

    def check_writer(self) -> None:
        """DirectoryLockedError if this writer lost the directory (a lease taken over)."""
        ...

    def for_writer_process(self) -> tuple[dict[str, Any], list[int]] | None:
        """What a writer process needs to commit into this directory (``writer="process"``):
        ``{"directory": ..., "storage_options": ...}`` for its `open_storage` and
        `join_writer_process`, and the descriptors it inherits (a lock it holds with this
        process); None where a writer process cannot commit here."""
        ...

    def join_writer_process(self, spec: Mapping[str, Any]) -> None:
        """In the writer process, on the storage `open_storage` gave it: hold the directory
        with the trainer as `spec` (from `for_writer_process`) says (a shared lease)."""
        ...

    def writer_started(self, pid: int) -> None:
        """A writer process `pid` was started for this directory, before any save is sent to
        it: a storage with a lock or lease records it there, so that a trainer started after
        this one ended waits for that writer (see `for_writer_process`)."""
        ...


class SharedDeletion(Protocol):
    """A deletion shared out among the processes of a job (object stores, where each DELETE is
    a request): the primary retires the step, every process removes its share of the files,
    the primary finishes. Storages whose `shares_deletion` is False (POSIX: one rename) are never
    asked."""

    #: whether the processes of a job share a step's deletion out (retire_step, remove_files,
    #: finish_deletion) instead of the primary's delete_step doing it all
    shares_deletion: bool

    def retire_step(self, name: str) -> None:
        """The primary's first half of a shared deletion: from now on `name` is no step, and a
        crash leaves a leftover that `clean_leftovers` removes."""
        ...

    def remove_files(self, name: str, relpaths: Sequence[str]) -> None:
        """One process's share of a retired step's files (the manifest's paths)."""
        ...

    def finish_deletion(self, name: str) -> None:
        """The primary, once every process removed its share: whatever is left of the step."""
        ...


class Storage(StepStore, WriterHold, SharedDeletion, Protocol):
    """A checkpoint directory: a POSIX directory, an object-store prefix, an in-memory store.

    The call order, as `CheckpointManager` makes it:

    1. `open.open_storage`; on a writable manager's primary `acquire`, then `clean_leftovers`
       (which lists the steps) and (with ``metadata=``) `create_root_file`; every other
       manager's primary `scan`s (other processes `read_step` the steps the primary broadcast); `other_naming` when nothing is found;
       the writer's `remove_dropped`.
    2. Each save: the primary's `check_writer` and `prepare`, each item's files through
       `Prepared.destination`, `check_writer` again (or, with several processes,
       `Prepared.sync` on every process), then the primary's `Prepared.commit` (or `abort`). With a writer
       process, `for_writer_process` and `writer_started` before the first save is sent, and
       `join_writer_process` in the writer.
    3. After a commit, on the commit thread: retention's `delete_step` and `drop_item` (or,
       sharing deletion, `retire_step`, every process's `remove_files`, `finish_deletion`);
       `write_metrics` for late metrics.
    4. Reads at any time, on the caller thread: `read_step`, `source`, `read_root_file`.
    5. `release` (the writer), then `close`.
    """


def is_url(text: str) -> bool:
    return "://" in text


SCHEMES = ("s3", "gs", "memory")


def check_directory(directory: Any) -> Path | str:
    """A checkpoint directory as given by a user: an absolute Path, or a URL of a known scheme
    (``s3://bucket/prefix``, ``gs://bucket/prefix``, ``memory://name``). The one place a URL is
    told from a path."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or path, got {type(directory).__qualname__}")
    text = os.fspath(directory)
    if not isinstance(text, str) or not text:
        raise ValueError(f"directory must be a non-empty path, got {directory!r}")
    if is_url(text):
        scheme, _, rest = text.partition("://")
        if scheme not in SCHEMES or not rest.partition("/")[0]:
            raise ValueError(
                f"directory {text!r}: object stores are s3://bucket/prefix or gs://bucket/prefix "
                "(memory://name for an in-process store)"
            )
        return text
    path = Path(text).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"directory {str(path)!r} exists and is not a directory")
    return path
