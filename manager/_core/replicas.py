"""Moving a local tier's parts between processes: who holds whose part (`Ring`), a part as one
payload (its manifest and files, `pack_part` / `unpack_part`), a restore's transfer
(`exchange`), and the job that commits a received part (`received_job`), whose files must hash
as the owner's manifest says before it is committed. (Replicas sent after a save travel over
`post.Post`, in the background.)

A restore's bytes move through JAX's own cross-process collectives: a ``ppermute`` of uint8
pieces over a mesh of one device per process (gloo between CPU processes, the accelerator
interconnect elsewhere), no wire protocol of ours. Every process makes the same calls in the
same order on its caller thread, blocking on each piece: two threads issuing collectives can
pair them up differently on two processes and deadlock, and undrained dispatches pile up
(research, docs/design/multitier-research.md section 4).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cairn.handlers import Destination, FileRecord
from cairn.handlers.errors import CorruptCheckpointError
from cairn.handlers.io import optional
from cairn.manager._core import commit as _commit
from cairn.manager._format import Manifest

PIECE_BYTES = 64 << 20  # sent per collective call: bounds the device memory a transfer takes
_HEADER = struct.Struct("<Q")


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


def pack_part(manifest: Manifest, files: Sequence[tuple[str, str, bytes]]) -> bytes:
    """One payload: a header (the manifest's bytes, each file's item, path and size), then the
    files' bytes, in order."""
    header = json.dumps(
        {
            "step": manifest.step,
            "manifest": manifest.to_bytes().decode(),
            "files": [[item, path, len(data)] for item, path, data in files],
        }
    ).encode()
    return b"".join([_HEADER.pack(len(header)), header, *(data for _, _, data in files)])


def unpack_part(
    payload: bytes | memoryview,
) -> tuple[dict[str, Any], list[tuple[str, str, memoryview]]]:
    """The header and (item, path, bytes) of each file of a payload; CorruptCheckpointError if
    it does not hold together (its sizes, its JSON)."""
    view = memoryview(payload)
    try:
        (size,) = _HEADER.unpack_from(view)
        header = json.loads(bytes(view[_HEADER.size : _HEADER.size + size]))
        at = _HEADER.size + size
        files = []
        for item, path, n in header["files"]:
            if not (isinstance(item, str) and isinstance(path, str) and isinstance(n, int)):
                raise ValueError(f"file entry {item!r}, {path!r}, {n!r}")
            files.append((item, path, view[at : at + n]))
            at += n
        if at != len(view) or any(
            len(data) != n for (_, _, data), (_, _, n) in zip(files, header["files"], strict=True)
        ):
            raise ValueError(f"{len(view)} bytes, the header accounts for {at}")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise CorruptCheckpointError(
            f"a part received from another process is damaged: {e}"
        ) from None
    return header, files


def exchange(
    procs: Any, pairs: Sequence[tuple[int, int]], payload: bytes, sizes: Sequence[int]
) -> memoryview | None:
    """One round of transfers: each (source, destination) pair sends the source's `payload`
    (`sizes[p]` bytes on process p, known to all) to the destination, every process calling
    alike. Sources are distinct, and so are destinations. Returns what this process received,
    or None."""
    jax = optional("jax", feature="a local tier with replicas")
    count, me = procs.count, procs.index
    pairs = tuple(sorted(pairs))
    sending = {s for s, _ in pairs}
    largest = max((sizes[s] for s in sending), default=0)
    if largest == 0:
        return memoryview(b"") if any(d == me for _, d in pairs) else None
    piece = min(PIECE_BYTES, -(-largest // 4096) * 4096)
    mesh, device = _mesh(count, me)
    step = _permute(mesh, pairs, piece)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    source = next((s for s, d in pairs if d == me), None)
    out = np.empty(sizes[source], np.uint8) if source is not None else None
    data = np.frombuffer(payload, np.uint8) if me in sending else np.empty(0, np.uint8)
    buffer = np.zeros(piece, np.uint8)
    for k in range(math.ceil(largest / piece)):
        chunk = data[k * piece : (k + 1) * piece]
        if len(chunk) == piece:  # sent as it is: device_put copies it
            local = jax.device_put(chunk, device)
        else:
            buffer[: len(chunk)] = chunk
            buffer[len(chunk) :] = 0
            local = jax.device_put(buffer, device)
        whole = jax.make_array_from_single_device_arrays((count * piece,), sharding, [local])
        got = step(whole)
        got.block_until_ready()  # one piece at a time: undrained dispatches pile up
        if out is not None:
            start = k * piece
            end = min(len(out), start + piece)
            if end > start:
                out[start:end] = np.asarray(got.addressable_data(0))[: end - start]
    return out.data if out is not None else None


@functools.cache
def _mesh(count: int, me: int) -> tuple[Any, Any]:
    """A mesh of one device per process (each process's first), and this process's device."""
    jax = optional("jax", feature="a local tier with replicas")
    first = [
        min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        for p in range(count)
    ]
    return jax.sharding.Mesh(np.array(first), ("p",)), first[me]


@functools.lru_cache(maxsize=32)
def _permute(mesh: Any, pairs: tuple[tuple[int, int], ...], piece: int) -> Any:
    jax = optional("jax", feature="a local tier with replicas")
    spec = jax.sharding.PartitionSpec("p")

    def shift(x: Any) -> Any:
        return jax.lax.ppermute(x, "p", list(pairs))

    return jax.jit(jax.shard_map(shift, mesh=mesh, in_specs=spec, out_specs=spec))


class _Stand:
    """The owner's handler, as the manifest names it (the holder writes its files as they are)."""

    def __init__(self, handler_id: str, version: int) -> None:
        self.id, self.version = handler_id, version


class _Files:
    """An item's files as received: each written, then checked against the owner's record."""

    def __init__(self, files: list[tuple[str, memoryview]], records: Mapping[str, FileRecord]):
        self._files, self._records = files, records

    def write(self, dest: Destination) -> list[FileRecord]:
        written = []
        if {path for path, _ in self._files} != set(self._records):
            raise CorruptCheckpointError(
                "a received part does not hold the files its manifest lists"
            )
        for path, data in self._files:
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


def received_job(files: list[tuple[str, str, memoryview]], manifest: Manifest) -> _commit.SaveJob:
    """A save job that commits a received part as its owner committed it: the same items,
    files, metrics and metadata; each file checked against the owner's manifest."""
    by_item: dict[str, list[tuple[str, memoryview]]] = {}
    for item, path, data in files:
        by_item.setdefault(item, []).append((path, data))
    snapshots: dict[str, Any] = {}
    for item, entry in manifest.items.items():
        if entry.dropped:
            continue
        records = {f.path: f for f in entry.files}
        snapshots[item] = (
            _Stand(entry.handler, entry.version),
            _Files(by_item.pop(item, []), records),
        )
    if by_item:
        raise CorruptCheckpointError(
            f"a received part has files of items its manifest lacks: {sorted(by_item)}"
        )
    return _commit.SaveJob(
        step=manifest.step,
        tmp_name=None,
        snapshots=snapshots,
        metrics=dict(manifest.metrics),
        metadata=dict(manifest.metadata),
        started_at=manifest.started_at,
        blocked_s=0.0,
    )
