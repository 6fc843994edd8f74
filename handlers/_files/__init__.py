"""Files with checksums computed while writing, verified reads, and fsync helpers.

A handler's write phase returns one `FileRecord` per file it wrote; the manager puts them in the
manifest, and `StoredItem.read_bytes` checks the size and the content hash (XXH3-128; CRC-32C in
format-1 manifests) on the way back in. The hash is computed from the bytes as they are written
(the packed layout hashes a pack after writing it, from memory), never by reading the file again.

The modules, each using only those before it: `records` (file records, content hashes, the
checks on names and JSON read from a checkpoint), `localio` (no-follow reads, `within`,
`ChecksummedFile`, fsync), `threads` (writing processes, background priority, `WriteBudget`),
`source` (`Source`, `LocalSource`, `StoredItem`), `destination` (`Destination`, `write_file`) and
`disk` (`LocalDestination`, `KnownFiles`, `PagePool`).
"""

from cairn.handlers._files.destination import BufferedFile, Destination, write_file
from cairn.handlers._files.disk import (
    DIRECT_MIN,
    KnownFiles,
    LocalDestination,
    PagePool,
    aligned_empty,
    as_destination,
    in_memory_directory,
    read_direct,
    resident,
    resident_pages,
)
from cairn.handlers._files.localio import (
    ChecksummedFile,
    fsync_dir,
    fsync_path,
    hash_file,
    open_regular,
    read_no_follow,
    within,
)
from cairn.handlers._files.records import (
    CONTENT_HASH,
    NOT_THE_CHUNK,
    FileRecord,
    RangeHashes,
    Ranges,
    check_relative,
    content_hash,
    parse_json,
)
from cairn.handlers._files.source import LocalSource, MemorySource, Source, StoredItem
from cairn.handlers._files.threads import (
    BACKGROUND_NICE,
    WriteBudget,
    as_parts,
    in_parts,
    io_priority,
    lower_thread_priority,
    writing_as,
    writing_process,
)

__all__ = [
    "BACKGROUND_NICE",
    "CONTENT_HASH",
    "DIRECT_MIN",
    "NOT_THE_CHUNK",
    "BufferedFile",
    "ChecksummedFile",
    "Destination",
    "FileRecord",
    "KnownFiles",
    "LocalDestination",
    "LocalSource",
    "MemorySource",
    "PagePool",
    "RangeHashes",
    "Ranges",
    "Source",
    "StoredItem",
    "WriteBudget",
    "aligned_empty",
    "as_destination",
    "as_parts",
    "check_relative",
    "content_hash",
    "fsync_dir",
    "fsync_path",
    "hash_file",
    "in_memory_directory",
    "in_parts",
    "io_priority",
    "lower_thread_priority",
    "open_regular",
    "parse_json",
    "read_direct",
    "read_no_follow",
    "resident",
    "resident_pages",
    "within",
    "write_file",
    "writing_as",
    "writing_process",
]
