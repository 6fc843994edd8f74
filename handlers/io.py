"""The file toolkit of cairn.handlers, for handlers and for the storages of cairn.manager.

Writing: `Destination` (what a write phase writes through), `LocalDestination`, `write_file`,
`ChecksummedFile`, `content_hash`. Reading: `Source`, `LocalSource`, `StoredItem`,
`parse_json` (JSON from a checkpoint, every failure a CorruptCheckpointError). Names read from
a checkpoint: `check_relative`, `within`, `open_regular`, `read_no_follow`. Threads and
processes: `lower_thread_priority`, `writing_as`, `writing_process`. Durability: `fsync_dir`.
"""

from cairn.handlers._files import (
    CONTENT_HASH,
    BufferedFile,
    ChecksummedFile,
    Destination,
    FileRecord,
    LocalDestination,
    LocalSource,
    Source,
    StoredItem,
    as_destination,
    check_relative,
    content_hash,
    fsync_dir,
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

__all__ = [
    "CONTENT_HASH",
    "BufferedFile",
    "ChecksummedFile",
    "Destination",
    "FileRecord",
    "LocalDestination",
    "LocalSource",
    "Source",
    "StoredItem",
    "as_destination",
    "check_relative",
    "content_hash",
    "fsync_dir",
    "hash_file",
    "lower_thread_priority",
    "open_regular",
    "parse_json",
    "read_no_follow",
    "within",
    "write_file",
    "writing_as",
    "writing_process",
]
