"""The file toolkit of cairn.handlers, for handlers and for the storages of cairn.manager.

Writing: `Destination` (what a write phase writes through), `LocalDestination`, `write_file`,
`ChecksummedFile`, `content_hash`. Reading: `Source`, `LocalSource`, `StoredItem`,
`parse_json` (JSON from a checkpoint, every failure a CorruptCheckpointError),
`chunks_by_pack` (what a packed item's indexes say each pack holds, for ``verify``). Names read from
a checkpoint: `check_relative`, `within`, `open_regular`, `read_no_follow`. Threads and
processes: `lower_thread_priority`, `writing_as`, `writing_process`. Durability: `fsync_dir`, `fsync_path`.
Saving cheaply: `StagingPool` and `staging_for` (the host buffers snapshots copy arrays into,
kept across saves), `WriteBudget` (``max_write_bytes_per_s``), `KnownFiles` (what incremental
saves know of files written before), `RangeHashes` (a file's content hash and its `Ranges`', on
one read, before an incremental save links it).
Array dtypes as ``tree.json`` names them: `dtype_name`, `dtype_from_name`. Object states
(``get_state()``/``state_dict()``) as JSON: `has_state_methods`, `encode_state`, `decode_state`.
Steps that orbax-checkpoint wrote: `ORBAX_COMMIT_SUCCESS`, `ORBAX_STEP_METADATA`, `orbax_items`,
`read_orbax_metadata`. Optional libraries: `optional` (a missing one raises
MissingDependencyError naming the pip extra). The protocol's optional hooks, as the manager calls
them (nothing, or the handler's own value, where a snapshot or handler lacks one):
`settle_snapshot`, `release_snapshot`, `snapshot_version`, `check_item`.
"""

from cairn.handlers._files import (
    BACKGROUND_NICE,
    CONTENT_HASH,
    BufferedFile,
    ChecksummedFile,
    Destination,
    FileRecord,
    KnownFiles,
    LocalDestination,
    LocalSource,
    RangeHashes,
    Ranges,
    Source,
    StoredItem,
    WriteBudget,
    as_destination,
    check_relative,
    content_hash,
    fsync_dir,
    fsync_path,
    hash_file,
    lower_thread_priority,
    open_regular,
    parse_json,
    read_no_follow,
    within,
    write_file,
    writing_as,
    writing_process,
)
from cairn.handlers._iterators import decode_state, encode_state, has_state_methods
from cairn.handlers._optional import optional
from cairn.handlers._orbax import COMMIT_SUCCESS as ORBAX_COMMIT_SUCCESS
from cairn.handlers._orbax import STEP_METADATA as ORBAX_STEP_METADATA
from cairn.handlers._orbax import orbax_items
from cairn.handlers._orbax import read_metadata as read_orbax_metadata
from cairn.handlers._packs import chunks_by_pack
from cairn.handlers._protocol import (
    check_item,
    release_snapshot,
    settle_snapshot,
    snapshot_version,
)
from cairn.handlers._staging import Slab, StagingPool, staging_for
from cairn.handlers._tree import dtype_from_name, dtype_name

__all__ = [
    "BACKGROUND_NICE",
    "CONTENT_HASH",
    "ORBAX_COMMIT_SUCCESS",
    "ORBAX_STEP_METADATA",
    "BufferedFile",
    "ChecksummedFile",
    "Destination",
    "FileRecord",
    "KnownFiles",
    "LocalDestination",
    "LocalSource",
    "RangeHashes",
    "Ranges",
    "Slab",
    "Source",
    "StagingPool",
    "StoredItem",
    "WriteBudget",
    "as_destination",
    "check_item",
    "check_relative",
    "chunks_by_pack",
    "content_hash",
    "decode_state",
    "dtype_from_name",
    "dtype_name",
    "encode_state",
    "fsync_dir",
    "fsync_path",
    "has_state_methods",
    "hash_file",
    "lower_thread_priority",
    "open_regular",
    "optional",
    "orbax_items",
    "parse_json",
    "read_no_follow",
    "read_orbax_metadata",
    "release_snapshot",
    "settle_snapshot",
    "snapshot_version",
    "staging_for",
    "within",
    "write_file",
    "writing_as",
    "writing_process",
]
