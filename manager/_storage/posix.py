"""A checkpoint directory on a POSIX filesystem: the commit is one rename.

A step is written into ``<name>.tmp-<hex>`` beside the steps, made durable, and renamed to its
final name; a step is retired by renaming it to ``.trash-*`` first. A crash at any point leaves
either no step or a whole one, plus leftovers the next writer removes. One writer per directory
across processes, through an advisory lock on ``.cairn.lock``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import Any, ClassVar

from cairn.handlers import Destination, LocalDestination, LocalSource, Source, write_file
from cairn.handlers.errors import (
    CorruptCheckpointError,
    DirectoryLockedError,
    ReadOnlyError,
    StepAlreadyExistsError,
)
from cairn.handlers.io import (
    PagePool,
    fsync_dir,
    fsync_path,
    in_memory_directory,
    read_no_follow,
    within,
)
from cairn.manager._format import (
    LOCK,
    MANIFEST,
    METRICS,
    SYNC_PREFIX,
    TRASH_PREFIX,
    Manifest,
    StepNames,
    check_sync_name,
    namings,
    trash_name,
)
from cairn.manager._layouts.base import LocalStepView
from cairn.manager._layouts.registry import read_foreign
from cairn.manager._storage.base import Listed, Reclaim
from cairn.manager._storage.orphans import WRITER_WAIT_S, wait_for_orphan

log = logging.getLogger("cairn")


class PosixStorage:
    """A local (or shared, for multi-host) directory. See the module docstring.

    Threads: the caller thread lists and reads, the commit thread changes; every change is a
    rename or a replacement of one file, so a listing never sees half of one.
    """

    multi_process = True  # on a filesystem every host mounts
    shares_deletion = False  # one rename retires a step; the reclaim thread removes it

    def __init__(self, root: Path) -> None:
        self.root = self.directory = root
        self.url = str(root)
        self.identity = os.path.realpath(root)
        self._lock: _DirectoryLock | None = None
        self._pool: PagePool | None = None  # `reuse_pages`

    def __repr__(self) -> str:
        return f"PosixStorage({self.url!r})"

    def location(self, name: str) -> Path:
        return self.root / name

    def acquire(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = _DirectoryLock(self.root)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise ReadOnlyError(
                f"{self.root} cannot be written ({e.strerror}); open it with "
                "read_only=True to read its checkpoints"
            ) from e

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def check_writer(self) -> None:
        """The lock is held until released: nothing can take it away."""

    def for_writer_process(self) -> tuple[dict[str, Any], list[int]]:
        """How a writer process opens this directory, and the lock's descriptor it inherits
        (so the directory stays locked while it commits what a dead trainer handed it); none
        on the other processes of a multi-process run, which do not hold the lock."""
        fd = self._lock.fd if self._lock is not None else None
        return {"directory": self.root}, [] if fd is None else [fd]

    def join_writer_process(self, spec: Mapping[str, Any]) -> None:
        """In the writer process: nothing to do; it inherited the lock's descriptor."""

    def writer_started(self, pid: int) -> None:
        """Say in the lock file that writer process `pid` holds the lock with this process, so
        that a trainer started after this one ended waits for it (`_wait_for_writer`). Called
        before the first save is sent, so a trainer killed at once has said it."""
        if self._lock is None or self._lock.fd is None:
            return  # not the primary of a multi-process run
        os.ftruncate(self._lock.fd, 0)
        os.pwrite(self._lock.fd, f"{os.getpid()} {pid} {WRITER_MARK}".encode(), 0)

    def reuse_pages(self) -> None:
        """On a RAM disk, a deleted step's files become the next steps' files, written over
        (`PagePool`), rather than freed. For a directory only this process reads (a local
        tier's parts): a reader holding a deleted step's file open would see it change,
        where a freed file keeps its bytes. Call after `acquire` (whose clean-up removes the
        pool a previous run left)."""
        if self._pool is None and in_memory_directory(self.root):
            self._pool = PagePool(self.root / f"{TRASH_PREFIX}pages")

    def close(self) -> None:
        """The files of the pool, if any, go (nothing else local to free)."""
        if self._pool is not None:
            self._pool.clear()

    # ------------------------------------------------------------------ listing and reading

    def scan(self, names: StepNames) -> list[Listed]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            step = names.parse(entry.name)
            if step is None:
                continue
            if entry.is_symlink():  # never followed: it could lead anywhere
                error = CorruptCheckpointError(
                    f"step {step} at {entry.path} is a symbolic link; cairn does not follow links "
                    "to step directories"
                )
                found.append(Listed(step, entry.path, error=error))
            elif entry.is_dir(follow_symlinks=False):
                listed = self._read(step, Path(entry.path))
                if listed is not None:
                    found.append(listed)
        return sorted(found, key=lambda listed: listed.step)

    lists_cheaply = True

    def other_naming(self, names: StepNames) -> tuple[StepNames, str] | None:
        try:
            entries = [e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return None
        if any(names.parse(name) is not None for name in entries):
            return None
        for naming, steps in namings(entries):
            for step, name in steps[:3]:  # a few are enough to tell
                path = self.root / name
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.lstat(path / MANIFEST).st_mode):
                        return naming, "cairn"
                with contextlib.suppress(OSError):
                    found = read_foreign(step, LocalStepView(path))
                    if found is not None:
                        return naming, found[0]
        return None

    def read_step(self, names: StepNames, step: int) -> Listed | None:
        path = self.root / names.format(step)
        if os.path.islink(path):
            return Listed(step, str(path), error=CorruptCheckpointError(f"{path} is a link"))
        return self._read(step, path)

    def _read(self, step: int, path: Path) -> Listed | None:
        """A step directory's manifest and metrics (None if the directory is gone)."""
        where = f"manifest {path / MANIFEST} of step {step}"
        try:
            manifest = read_no_follow(path / MANIFEST)
        except FileNotFoundError:
            try:
                foreign = read_foreign(step, LocalStepView(path))
            except FileNotFoundError:  # the step was deleted while being listed
                return None
            if foreign is not None:
                return Listed(step, str(path), foreign=foreign[1])
            if not os.path.lexists(path):
                return None
            missing = f"step {step} at {path} has no manifest: {path / MANIFEST} is missing"
            return Listed(step, str(path), error=CorruptCheckpointError(missing))
        except (OSError, CorruptCheckpointError) as e:
            error = CorruptCheckpointError(f"{where} cannot be read: {e}")
            return Listed(step, str(path), error=error)
        metrics, metrics_error = None, None
        try:
            metrics = read_no_follow(path / METRICS)
        except FileNotFoundError:
            pass
        except (OSError, CorruptCheckpointError) as e:
            metrics_error = CorruptCheckpointError(f"{path / METRICS} cannot be read: {e}")
        return Listed(step, str(path), manifest, metrics=metrics, metrics_error=metrics_error)

    def source(self, name: str, item: str) -> Source:
        return LocalSource(within(self.root, f"{name}/{item}", what=f"step {name}"))

    def view(self, name: str) -> LocalStepView:
        return LocalStepView(self.root / name)

    def foreign_source(self, name: str, item: str) -> Source:
        """An item of a foreign step, read in place."""
        return self.source(name, item)

    # ------------------------------------------------------------------ writing

    def prepare(self, name: str, tmp_name: str, items: Iterable[str], *, create: bool) -> _Prepared:
        tmp = self.root / tmp_name
        if create:
            tmp.mkdir()
            for item in items:
                (tmp / item).mkdir()
        return _Prepared(self.root, tmp, self.root / name, owner=create, pool=self._pool)

    def delete_step(self, name: str) -> Reclaim | None:
        """Rename the step to trash (atomic: from then on it is no step) and fsync; freeing its
        space is the returned work. A crash before that leaves a ``.trash-*`` directory, which
        the next start removes."""
        trash = self.root / trash_name(name)
        try:
            os.rename(self.root / name, trash)  # from here on the step is gone
        except FileNotFoundError:
            log.warning("cairn: step directory %s was already gone", self.root / name)
            return None
        fsync_dir(self.root)
        pool = self._pool
        if pool is None:
            return lambda: _remove_trash(trash)

        def reclaim() -> None:
            try:
                pool.keep(trash)
            except OSError as e:  # then it is freed as without a pool
                log.warning("cairn: could not keep the files of %s to write over: %s", trash, e)
            _remove_trash(trash)

        return reclaim

    def retire_step(self, name: str) -> None:
        raise NotImplementedError("a POSIX step is deleted with delete_step (one rename)")

    def remove_files(self, name: str, relpaths: Sequence[str]) -> None:
        raise NotImplementedError("a POSIX step is deleted with delete_step (one rename)")

    def finish_deletion(self, name: str) -> None:
        raise NotImplementedError("a POSIX step is deleted with delete_step (one rename)")

    def drop_item(self, name: str, manifest: Manifest, item: str) -> Reclaim | None:
        """The manifest that marks the item dropped replaces the old one atomically first, so
        from then on no reader looks for the item's files; only then does the item's directory
        leave the step (renamed to trash beside the steps)."""
        step_dir = self.root / name
        _replace_file(step_dir, MANIFEST, manifest.to_bytes())  # the item is dropped from here on
        trash = self.root / trash_name(f"{name}-{item}")
        try:
            os.rename(within(step_dir, item, what=f"step {manifest.step}"), trash)
        except FileNotFoundError:  # a damaged step whose item had no directory: dropped anyway
            log.warning("cairn: item %r of %s had no directory to drop", item, step_dir)
            return None
        fsync_dir(step_dir)
        fsync_dir(self.root)
        return lambda: _remove_trash(trash)

    def remove_dropped(self, steps: Mapping[str, Manifest]) -> None:
        """Names come from manifests, so they go through `within` (a manifest is untrusted):
        only an entry of the step directory itself is removed, and a link is unlinked, never
        followed."""
        for name, manifest in steps.items():
            step_dir = self.root / name
            for item, entry in manifest.items.items():
                if not entry.dropped:
                    continue
                path = within(step_dir, item, what=f"manifest of {step_dir}")
                if path.is_symlink():
                    log.info("cairn: removing link %s left as a dropped item", path)
                    path.unlink()
                elif path.is_dir():
                    log.info("cairn: removing dropped item %r left in %s", item, step_dir)
                    shutil.rmtree(path)

    def write_metrics(self, name: str, body: bytes) -> None:
        _replace_file(self.root / name, METRICS, body)

    def create_root_file(self, name: str, body: bytes) -> bool:
        tmp = self.root / f"{_ROOT_TMP}{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.root / name)  # atomic, and refuses an existing name (or link)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.root)
        return True

    def remove_sync_files(self, names: Sequence[str]) -> None:
        """Remove meeting files of writer processes (`_writer.StoredMeetings`), never followed."""
        for name in [check_sync_name(name) for name in names]:
            (self.root / name).unlink(missing_ok=True)

    def read_root_file(self, name: str) -> bytes | None:
        try:
            return read_no_follow(self.root / name)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CorruptCheckpointError(
                f"{self.root / name} cannot be read as a regular file (cairn follows no link "
                f"there): {e.strerror or e}"
            ) from None

    def clean_leftovers(self, names: StepNames) -> list[Listed]:
        """Temporary and trash entries a crashed writer left behind, and half-written
        replacements of a step's manifest or metrics; then `scan`."""
        removed = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(
                    (TRASH_PREFIX, _ROOT_TMP, SYNC_PREFIX)
                ) or names.is_temporary(entry.name):
                    _remove(entry.path)
                    removed.append(entry.name)
        with os.scandir(self.root) as entries:
            steps = [
                e.path
                for e in entries
                if e.is_dir(follow_symlinks=False) and names.parse(e.name) is not None
            ]
        for step in steps:
            with os.scandir(step) as inside:
                for inner in inside:
                    if inner.name.startswith(_REPLACING):
                        _remove(inner.path)  # a directory of that name too (a crafted one)
                        removed.append(f"{os.path.basename(step)}/{inner.name}")
        if removed:
            fsync_dir(self.root)
            log.info(
                "cairn: removed %d leftover entries in %s: %s", len(removed), self.root, removed
            )
        return self.scan(names)


_ROOT_TMP = ".cairn-root.tmp-"  # a root file being created (create_root_file)
_REPLACING = (f".{METRICS}.tmp-", f".{MANIFEST}.tmp-")


def _replace_file(directory: Path, name: str, data: bytes) -> None:
    """Replace `directory/name` atomically: a temporary file, fsync, rename, fsync the directory."""
    tmp = directory / f".{name}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def _remove(path: str | Path) -> None:
    """Remove an entry cairn's names claim: a directory with what is in it; anything else (a
    file, a link, a FIFO) unlinked, never followed or opened. rmtree opens its top, and a FIFO
    there (where a crafted step had an item's directory) would block it for ever."""
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _remove_trash(trash: Path) -> None:
    """Free the space of a retired step or dropped item (slow on some filesystems; never on the
    commit path), as `_remove` does: the reclaim thread, and `close()`, never wait on a FIFO."""
    try:
        _remove(trash)
    except OSError as e:
        log.warning("cairn: could not finish removing %s (the next start will): %s", trash, e)


class _Prepared:
    """A step being written into ``<name>.tmp-<hex>``; the rename is its commit."""

    def __init__(
        self, root: Path, tmp: Path, final: Path, *, owner: bool, pool: PagePool | None
    ) -> None:
        self._root, self._tmp, self._final, self._owner = root, tmp, final, owner
        self._pool = pool
        self._synced = False  # every item durable already (sync): the manifest is what is left
        self._destinations: list[LocalDestination] = []

    def destination(self, item: str) -> Destination:
        dest = LocalDestination(self._tmp / item, self._pool)
        self._destinations.append(dest)
        return dest

    def _linked(self) -> set[str]:
        """The files the items linked to a committed step's: their content is durable already
        (that step's commit fsynced it), and the link itself is the directory entry, which
        the fsync of its directory makes durable (ext4 and XFS journal the inode's new link
        count in the same transaction). So they are not fsynced again."""
        return {os.path.join(d.directory, rel) for d in self._destinations for rel in d.linked}

    def sync(self) -> None:
        fsync_tree(self._tmp, skip=self._linked())
        self._synced = True

    def commit(self, manifest: Manifest) -> None:
        """Items first, the manifest last, everything durable, then one rename: a reader (or a
        restart after SIGKILL) sees no step or a whole one. POSIX rename would replace an
        *empty* directory of the final name, so an existing one is refused first (the lock
        keeps other writers out)."""
        write_file(self._tmp, MANIFEST, manifest.to_bytes())
        if self._synced:
            fsync_path(os.fspath(self._tmp / MANIFEST))
            fsync_dir(self._tmp)
        else:
            fsync_tree(self._tmp, skip=self._linked())
        appeared = StepAlreadyExistsError(
            f"step {manifest.step}: {self._final} appeared on disk meanwhile"
        )
        if os.path.lexists(self._final):
            raise appeared
        try:
            os.rename(self._tmp, self._final)  # the commit point
        except OSError as e:  # it appeared between the check and the rename (a non-empty dir)
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise appeared from None
            raise
        fsync_dir(self._root)  # make the new name itself durable

    def abort(self) -> None:
        if self._owner:
            shutil.rmtree(self._tmp, ignore_errors=True)


_SYNC_THREADS = 8  # fsyncs in flight: the filesystem's journal commits them together
_SYNC_ALONE = 64  # up to this many files and directories, one thread fsyncs them


def fsync_tree(top: Path, *, skip: Set[str] = frozenset()) -> None:
    """Make every file and directory under `top` durable: an fsync of each, files before the
    directories that name them; the files in `skip` (paths as ``os.walk`` joins them) are
    durable already, and only the directories that name them are fsynced.

    Only what the step wrote is flushed: ``syncfs(2)``, one call, would also flush every other
    dirty page of the filesystem (the trainer's logs, its data cache, other jobs' files on a
    shared disk) and charge that to the commit. The fsyncs run on a few threads at once, which
    ext4 and XFS serve with one journal commit per batch rather than one per file; the
    train state's chunk files went to the disk with ``O_DIRECT`` already, so theirs cost only
    that commit.
    """
    files: list[str] = []
    dirs: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(top, topdown=False, onerror=_raise):
        files.extend(p for p in (os.path.join(dirpath, n) for n in filenames) if p not in skip)
        dirs.append(dirpath)
    if len(files) + len(dirs) <= _SYNC_ALONE:  # threads cost more than they save here
        for path in (*files, *dirs):
            fsync_path(path)
        return
    with concurrent.futures.ThreadPoolExecutor(
        _SYNC_THREADS, thread_name_prefix="cairn-sync"
    ) as pool:
        list(pool.map(fsync_path, files))
        list(pool.map(fsync_path, dirs))  # after every file: a directory names durable files


def _raise(error: OSError) -> None:
    raise error


WRITER_MARK = "cairn-writer"  # the lock file: "<trainer pid> <writer pid> cairn-writer"


def _try_lock(fd: int) -> str | None:
    """Take the lock on `fd`: None, or what its holder wrote into the file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    return None


def _wait_for_writer(holder: str, timeout: float) -> bool:
    """If the lock file's `holder` text names a trainer that is gone and its writer process,
    which holds the lock while it commits what the trainer handed it, wait (up to `timeout`
    seconds) for the writer to exit; whether there was such a writer to wait for."""
    parts = holder.split()
    if (
        len(parts) != 3
        or parts[2] != WRITER_MARK
        or not all(p.isascii() and p.isdigit() for p in parts[:2])
    ):
        return False
    return wait_for_orphan(int(parts[0]), int(parts[1]), timeout)


class _DirectoryLock:
    """An advisory flock on ``<root>/.cairn.lock``, held while a writable manager is open.

    The lock belongs to the open file description, which a forked child would share; children
    close their copy at fork time, so a fork-started worker never keeps the directory locked.
    A manager dropped without close() releases it when garbage-collected.
    """

    _held: ClassVar[weakref.WeakSet[_DirectoryLock]] = weakref.WeakSet()

    def __init__(self, root: Path) -> None:
        path = root / LOCK
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:  # never through a link, never a FIFO or device: the pid is written into this file
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptCheckpointError(
                    f"{path} is a symbolic link; cairn never follows it (it would overwrite the "
                    "link's target). Remove it and try again"
                ) from None
            if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENOTDIR):
                raise CorruptCheckpointError(
                    f"{path} is not a regular file ({e.strerror}); remove it and try again"
                ) from None
            raise
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            why = (
                f"mode {stat.filemode(info.st_mode)}"
                if not stat.S_ISREG(info.st_mode)
                else f"{info.st_nlink} hard links: the same file has another name, which "
                "writing the holder's pid into it would overwrite"
            )
            raise CorruptCheckpointError(
                f"{path} is not a regular file of its own ({why}); remove it and try again"
            )
        holder = _try_lock(fd)
        if holder is not None and _wait_for_writer(holder, WRITER_WAIT_S):
            holder = _try_lock(fd)  # the writer is done, or it is still at it after the wait
        if holder is not None:
            os.close(fd)
            if holder.split()[0] == str(os.getpid()):
                who = "this process (a manager not closed?)"
            elif len(holder.split()) == 3 and holder.endswith(WRITER_MARK):
                trainer, writer = holder.split()[:2]
                who = (
                    f"pid {trainer} (with its writer process, pid {writer}; if that trainer "
                    f"ended, its writer was still committing after a wait of {WRITER_WAIT_S:g} s)"
                )
            else:
                who = f"pid {holder}"
            raise DirectoryLockedError(
                f"{root} is held by another writable CheckpointManager in {who}; "
                "open it with read_only=True to read alongside"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        _DirectoryLock._held.add(self)

    def release(self) -> None:
        if self.fd is not None:
            self.fd = None
            self._finalizer()  # closes the descriptor once

    @classmethod
    def _forget_in_child(cls) -> None:
        for lock in list(cls._held):
            lock.release()


os.register_at_fork(after_in_child=_DirectoryLock._forget_in_child)
