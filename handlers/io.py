"""What cairn.manager needs of cairn.handlers beyond its public names (the protocol and a
handler's own toolkit, `Destination`, `Source`, `StoredItem`, `ChecksummedFile`, `write_file`,
..., are `cairn.handlers`'s), and nothing else: test_layers checks that the manager uses each.

Reading: `parse_json` (JSON from a checkpoint, every failure a CorruptCheckpointError),
`chunks_by_pack` (what a packed item's indexes say each pack holds, for ``verify``). Names read
from a checkpoint: `check_relative`, `within`, `open_regular`, `read_no_follow`. Threads and
processes: `lower_thread_priority`, `BACKGROUND_NICE`. Durability: `fsync_dir`,
`fsync_path`.
Saving cheaply: `StagingPool` and `staging_for` (the host buffers snapshots copy arrays into,
kept across saves), `WriteBudget` (``max_write_bytes_per_s``), `KnownFiles` (what incremental
saves know of files written before), `RangeHashes` (a file's content hash and its `Ranges`', on
one read, before an incremental save links it).
Array dtypes as ``tree.json`` names them: `dtype_name`, `dtype_from_name`. Object states
(``get_state()``/``state_dict()``) as JSON: `has_state_methods`, `encode_state`, `decode_state`.
Steps that orbax-checkpoint wrote: `ORBAX_COMMIT_SUCCESS`, `ORBAX_STEP_METADATA`,
`orbax_listing_kind`, and around orbax's own reads of one (the Orbax surface's):
`check_orbax_tree`, `orbax_reads_finish`. Optional libraries: `optional` (a missing one raises
MissingDependencyError naming the pip extra). The protocol's optional hooks, as the manager calls
them (nothing, or the handler's own value, where a snapshot or handler lacks one):
`settle_snapshot`, `release_snapshot`, `snapshot_version`, `share_snapshot`, `check_item`.
A local tier's parts (each process's own shards of a step): `as_parts`, `MemorySource` (a part
received for a restore, read from memory), and `PagePool` with `in_memory_directory` (on a RAM
disk, a deleted step's files written over by the next steps').
"""

from cairn.handlers._files import (
    BACKGROUND_NICE,
    KnownFiles,
    MemorySource,
    PagePool,
    RangeHashes,
    Ranges,
    WriteBudget,
    aligned_empty,
    as_parts,
    check_relative,
    fsync_dir,
    fsync_path,
    in_memory_directory,
    lower_thread_priority,
    open_regular,
    parse_json,
    read_direct,
    read_no_follow,
    resident,
    within,
)
from cairn.handlers._iterators import decode_state, encode_state, has_state_methods
from cairn.handlers._optional import optional
from cairn.handlers._orbax import COMMIT_SUCCESS as ORBAX_COMMIT_SUCCESS
from cairn.handlers._orbax import STEP_METADATA as ORBAX_STEP_METADATA
from cairn.handlers._orbax import check_tree as check_orbax_tree
from cairn.handlers._orbax import orbax_listing_kind, orbax_reads_finish
from cairn.handlers._packs import chunks_by_pack
from cairn.handlers._protocol import (
    check_item,
    release_snapshot,
    settle_snapshot,
    share_snapshot,
    snapshot_version,
)
from cairn.handlers._staging import Slab, StagingPool, round_up, staging_for
from cairn.handlers._tree import dtype_from_name, dtype_name

__all__ = [
    "BACKGROUND_NICE",
    "ORBAX_COMMIT_SUCCESS",
    "ORBAX_STEP_METADATA",
    "KnownFiles",
    "MemorySource",
    "PagePool",
    "RangeHashes",
    "Ranges",
    "Slab",
    "StagingPool",
    "WriteBudget",
    "aligned_empty",
    "as_parts",
    "check_item",
    "check_orbax_tree",
    "check_relative",
    "chunks_by_pack",
    "decode_state",
    "dtype_from_name",
    "dtype_name",
    "encode_state",
    "fsync_dir",
    "fsync_path",
    "has_state_methods",
    "in_memory_directory",
    "lower_thread_priority",
    "open_regular",
    "optional",
    "orbax_listing_kind",
    "orbax_reads_finish",
    "parse_json",
    "read_direct",
    "read_no_follow",
    "release_snapshot",
    "resident",
    "round_up",
    "settle_snapshot",
    "share_snapshot",
    "snapshot_version",
    "staging_for",
    "within",
]
