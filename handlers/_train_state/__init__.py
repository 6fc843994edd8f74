"""TrainStateHandler: JAX train states (pytrees of jax.Array / np.ndarray), in packs or as zarr3.

Layouts of one item (docs/format.md): the packed layout (the default, version 2; its files in
`cairn.handlers._packs`) keeps `tree.json` and puts the chunks of every leaf into a few pack
files per process, found through an index; the zarr layout (``layout="zarr"``, version 1)::

    tree.json                   structure, key paths, per leaf: shape, dtype, chunk shape, file
    arrays/<i>/zarr.json        zarr v3 metadata of leaf i (bytes + crc32c codecs, "." keys)
    arrays/<i>/<c0>.<c1>...     chunk files: the raw little-endian bytes, then their crc32c

Chunks tile each process's shards (so processes never write the same chunk) and are split along
their first axis to at most `chunk_bytes`, so large arrays write and read in parallel. The zarr
layout's files are standard zarr v3: TensorStore (or any zarr v3 reader) opens them. Restore
reads the chunks itself, each device only the chunks its slices overlap, and checks each against
its content hash (the manifest's, or the index's) before its bytes are used.

The modules, each importing only those listed before it:

- `layout`: chunk geometry, the bytes of a chunk as stored, zarr metadata;
- `threads`: the shared thread pools, and the tickets that bound casts in flight;
- `prng`: typed PRNG keys, stored as their key data;
- `staging`: a snapshot's leaves, the unchanged ones of an incremental save, the copies into the
  staging pool's slab;
- `write`: the write phase (`_StateSnapshot`): packs or chunk files, linked where unchanged;
- `read`: reading a stored leaf back, its chunks checked;
- `restore`: lazy leaves, reads for targets and their shardings, T5X's transforms and fallback;
- `handler`: `TrainStateHandler` (the snapshot on the caller thread, restore, check) and
  `TrainStateRestore`.
"""

from cairn.handlers._train_state.handler import TrainStateHandler, TrainStateRestore
from cairn.handlers._train_state.restore import LazyArray

__all__ = ["LazyArray", "TrainStateHandler", "TrainStateRestore"]
