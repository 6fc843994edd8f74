"""Typed PRNG keys (``jax.random.key``) in a train state: stored as their key data, restored as
keys of their implementation again."""

from __future__ import annotations

import functools
import sys
from typing import Any

from cairn.handlers._files import StoredItem
from cairn.handlers._optional import optional
from cairn.handlers._tree import NONE, PRNG_IMPLS, TREE, KeyPath, keystr
from cairn.handlers.errors import CorruptCheckpointError, MismatchError


class _Keys:
    """Typed PRNG keys (``jax.random.key``) as a train state stores them: their key data (uint32,
    the keys' shape and the implementation's own trailing dimensions) in an array leaf whose
    ``tree.json`` node names the implementation (``"prng"``, `PRNG_IMPLS`); restored as keys
    of that implementation again (``jax.random.wrap_key_data``)."""

    def __init__(self, impl: str, data_shape: tuple[int, ...], path: KeyPath, stored: StoredItem):
        self.impl, self.path = impl, path
        self.dtype, trailing = _key_kind(impl)
        n = len(trailing)
        if data_shape[len(data_shape) - n :] != trailing:
            raise CorruptCheckpointError(
                f"{stored.describe_file(TREE)}: the PRNG keys at {keystr(path)} have data of "
                f"shape {data_shape}, which {impl} keys' data does not end in {trailing}"
            )
        self.shape = data_shape[: len(data_shape) - n]

    @staticmethod
    def of(dtype: Any) -> bool:
        """Whether `dtype` is a typed PRNG key dtype."""
        jax = sys.modules.get("jax")
        return jax is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))

    @staticmethod
    def impl_of(keys: Any, path: KeyPath) -> str:
        """The name of the implementation of `keys` (a jax key array); TypeError for keys of an
        implementation jax.random does not name (a custom one), which could not be restored."""
        jax = optional("jax", feature="typed PRNG keys")
        impl = str(jax.random.key_impl(keys))
        if impl not in PRNG_IMPLS or _key_kind(impl)[0] != keys.dtype:
            raise TypeError(
                f"the PRNG keys at {keystr(path)} are of implementation {impl!r}; a train state "
                f"stores keys of {sorted(PRNG_IMPLS)} (or save jax.random.key_data(keys))"
            )
        return impl

    def check(self, target: Any, path: KeyPath) -> None:
        """A target leaf (keys, or their ShapeDtypeStruct) must be keys of this implementation
        and shape; MismatchError naming the key path otherwise."""
        if target is NONE or target is None or not hasattr(target, "dtype"):
            return
        if not _Keys.of(target.dtype) or target.dtype != self.dtype:
            raise MismatchError(
                f"at {keystr(path)}: {self.impl} PRNG keys ({self.dtype}) in the checkpoint, "
                f"{target.dtype} in the target"
            )
        if tuple(target.shape) != self.shape:
            raise MismatchError(
                f"at {keystr(path)}: PRNG keys of shape {self.shape} in the checkpoint, "
                f"{tuple(target.shape)} in the target"
            )

    def wrap(self, data: Any) -> Any:
        jax = optional("jax", feature="typed PRNG keys")
        return jax.random.wrap_key_data(data, impl=self.impl)


@functools.cache
def _key_kind(impl: str) -> tuple[Any, tuple[int, ...]]:
    """The dtype of `impl` keys and the trailing shape of their data (no key is made)."""
    jax = optional("jax", feature="typed PRNG keys")
    keys = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    return keys.dtype, tuple(jax.eval_shape(jax.random.key_data, keys).shape)
