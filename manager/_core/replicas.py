"""Moving a local tier's parts between processes: who holds whose part (`Ring`), a part as
the pieces `post.Post` sends (its manifest, then its files: `pack_part` / `unpack_part`), a
part received checked against its owner's manifest (`check_files`), and the job that commits
a received part (`received_job`), whose files must hash as the owner's manifest says before it
is committed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from cairn.handlers import Destination, FileRecord
from cairn.handlers.errors import CorruptCheckpointError
from cairn.manager._core import commit as _commit
from cairn.manager._core.post import Piece, Received
from cairn.manager._format import PART, Manifest


@dataclasses.dataclass(frozen=True)
class Ring:
    """Who holds whose part: the processes in an order that alternates their failure domains,
    each part held by the processes that follow its owner in that order (the k-th holder k
    places on). Built from every process's domain (`Ring.of`), the same on every process.

    Round k of a transfer sends every part to its k-th holder: a permutation, so each process
    sends one part and receives one. With D domains of equal size, the first D - 1 holders of
    a part are each in another domain than its owner (and than each other)."""

    order: tuple[int, ...]

    @classmethod
    def of(cls, domains: Sequence[Sequence[str]]) -> Ring:
        """The ring of processes 0..n-1 whose failure domains are `domains[p]`, outermost first
        (e.g. (slice, host)): the processes of each outer domain, ordered alike by the inner
        ones, taken in turn from each outer domain. A domain's name does not change the ring,
        only who shares it: domains are ordered by their lowest process index, so a replaced
        host with a new name but the same processes keeps the ring."""
        return cls(tuple(_alternate(list(range(len(domains))), domains, 0)))

    def holder(self, owner: int, k: int) -> int:
        """The process that holds `owner`'s part as its k-th holder (k >= 1)."""
        at = self.order.index(owner)
        return self.order[(at + k) % len(self.order)]

    def owner(self, holder: int, k: int) -> int:
        """The process whose part `holder` holds as its k-th holder."""
        at = self.order.index(holder)
        return self.order[(at - k) % len(self.order)]

    def sharing(self, domains: Sequence[Sequence[str]], replicas: int) -> int:
        """How many of the parts' `replicas` holders share their owner's outermost domain that
        tells any two processes apart (none tell them apart: 0)."""
        level = next(
            (
                i
                for i in range(len(domains[0]) if domains else 0)
                if len({d[i] for d in domains}) > 1
            ),
            None,
        )
        if level is None:
            return 0
        return sum(
            domains[self.holder(p, k)][level] == domains[p][level]
            for p in self.order
            for k in range(1, replicas + 1)
        )


def _alternate(procs: list[int], domains: Sequence[Sequence[str]], level: int) -> list[int]:
    """`procs` in turn from each of their domains at `level` (each group ordered by the next
    levels), groups ordered by their lowest process index."""
    if len(procs) <= 1 or not domains or level >= len(domains[procs[0]]):
        return sorted(procs)
    groups: dict[str, list[int]] = {}
    for p in sorted(procs):
        groups.setdefault(domains[p][level], []).append(p)
    ordered = [_alternate(g, domains, level + 1) for g in groups.values()]
    out: list[int] = []
    for i in range(max(len(g) for g in ordered)):
        out += [g[i] for g in ordered if i < len(g)]
    return out


def pack_part(manifest: Manifest, files: Sequence[tuple[str, str, Piece]]) -> list[Piece]:
    """A part as the pieces `post.Post` sends: a header (the manifest's bytes, each file's item
    and path), then each file (bytes, or a `FilePiece` sent straight from the disk)."""
    header = json.dumps(
        {
            "step": manifest.step,
            "manifest": manifest.to_bytes().decode(),
            "files": [[item, path] for item, path, _ in files],
        }
    ).encode()
    return [header, *(data for _, _, data in files)]


#: a part's files, by item and path
Files = dict[str, dict[str, memoryview]]


def unpack_part(pieces: Sequence[memoryview]) -> tuple[dict[str, Any], Files]:
    """The header and the files of a part received; CorruptCheckpointError if it does not hold
    together (its JSON, a file per piece, no file twice)."""
    try:
        if not pieces:
            raise ValueError("no header")
        header = json.loads(bytes(pieces[0]))
        if not isinstance(header, dict) or not isinstance(header.get("manifest"), str):
            raise ValueError(f"header {header!r:.80}")
        entries = header["files"]
        if not isinstance(entries, list) or len(entries) != len(pieces) - 1:
            raise ValueError(f"{len(pieces) - 1} files, the header lists {entries!r:.80}")
        files: Files = {}
        for entry, data in zip(entries, pieces[1:], strict=True):
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and all(isinstance(name, str) for name in entry)
            ):
                raise ValueError(f"file entry {entry!r:.80}")
            item, path = entry
            if path in files.setdefault(item, {}):
                raise ValueError(f"file {path!r:.80} of item {item!r:.80} comes twice")
            files[item][path] = data
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(
            f"a part received from another process is damaged: {e}"
        ) from None
    return header, files


def check_files(files: Files, manifest: Manifest, *, content: bool) -> None:
    """A received part holds the files its manifest lists for each live item, and no other
    (CorruptCheckpointError); with `content`, each of its recorded size and content hash."""
    live = {n: e for n, e in manifest.items.items() if not e.dropped}
    for item in set(files) | set(live):
        records = {f.path: f for f in live[item].files} if item in live else {}
        got = files.get(item, {})
        if set(got) != set(records):
            raise CorruptCheckpointError(
                f"a received part of step {manifest.step} holds files {sorted(got)[:5]} of item "
                f"{item!r}; its manifest lists {sorted(records)[:5]}"
            )
        if content:
            for path, data in got.items():
                records[path].check(data, f"file {path} of item {item!r} of a received part")


def hashed_whole(files: Files, manifest: Manifest, part: Received) -> dict[str, frozenset[str]]:
    """The files of a part sent back (`files`, views of `part`'s pieces) whose bytes hashed, as
    they arrived, to what their owner's manifest records (size and XXH3-128), by item: a read
    of them need not hash them again."""
    digests = {id(piece): digest for piece, digest in zip(part, part.digests, strict=False)}
    out = {}
    for item, paths in files.items():
        entry = manifest.items.get(item)
        records = {f.path: f for f in entry.files} if entry is not None else {}
        out[item] = frozenset(
            path
            for path, view in paths.items()
            if (record := records.get(path)) is not None
            and record.size == view.nbytes
            and record.xxh3_128 is not None
            and digests.get(id(view)) == record.xxh3_128
        )
    return out


class _Stand:
    """The owner's handler, as the manifest names it (the holder writes its files as they are)."""

    def __init__(self, handler_id: str, version: int) -> None:
        self.id, self.version = handler_id, version


class _Files:
    """An item's files as received: each written, then checked against the owner's record."""

    def __init__(self, files: Mapping[str, memoryview], records: Mapping[str, FileRecord]):
        self._files, self._records = files, records

    def write(self, dest: Destination) -> list[FileRecord]:
        written = []
        for path, data in self._files.items():
            record = dest.write_file(path, data)
            want = self._records[path]
            if (record.size, record.crc32c, record.xxh3_128) != (
                want.size,
                want.crc32c,
                want.xxh3_128,
            ):
                raise CorruptCheckpointError(
                    f"file {path} of a received part does not hash as its owner's manifest says"
                )
            written.append(record)
        return written


def received_job(manifest: Manifest, files: Files, *, holder: int) -> _commit.SaveJob:
    """A save job that commits a received part as its owner committed it: the same items,
    files, metrics and metadata, but for the part record's `holder`, the process committing
    this copy; each file checked against the owner's manifest."""
    check_files(files, manifest, content=False)  # the content: as each file is written
    part = manifest.metadata.get(PART)
    if not isinstance(part, dict):
        raise CorruptCheckpointError(f"a received part of step {manifest.step} has no part record")
    snapshots: dict[str, Any] = {
        item: (
            _Stand(entry.handler, entry.version),
            _Files(files.get(item, {}), {f.path: f for f in entry.files}),
        )
        for item, entry in manifest.items.items()
        if not entry.dropped
    }
    return _commit.SaveJob(
        step=manifest.step,
        tmp_name=None,
        snapshots=snapshots,
        metrics=dict(manifest.metrics),
        metadata={**manifest.metadata, PART: {**part, "holder": holder}},
        started_at=manifest.started_at,
        blocked_s=0.0,
    )
