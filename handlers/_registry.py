"""Which handler saves an item: an explicit choice, else the item's type (MRO), else an error.

The registry is a private dict with a read-only view. Handlers are also found by `id` when a
step is restored, from what its manifest recorded.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from typing import Any

from cairn.handlers._protocol import Handler
from cairn.handlers.errors import UnsupportedFormatError

__all__ = ["handler_by_id", "handler_for", "register", "registered_types"]

_BY_TYPE: dict[type, Handler] = {}
_BY_ID: dict[str, Handler] = {}


def register(handler: Handler, *types_: type, replace: bool = False) -> None:
    """Make `handler` known by its id and, for each type given, the default for that type.

    A type (or id) already taken by another handler raises ValueError unless `replace=True`.
    A type's subclasses get the handler too, unless they have one of their own (MRO order).
    """
    hid = getattr(handler, "id", None)
    if not isinstance(hid, str) or not hid:
        raise TypeError(f"handler {handler!r} has no string `id`")
    if not isinstance(getattr(handler, "version", None), int):
        raise TypeError(f"handler {hid!r} has no integer `version`")
    for name in ("snapshot", "restore", "describe"):
        if not callable(getattr(handler, name, None)):
            raise TypeError(f"handler {hid!r} has no `{name}` method")
    for typ in types_:
        if not isinstance(typ, type):
            raise TypeError(f"register() takes types after the handler, got {typ!r}")
    old = _BY_ID.get(hid)
    if old is not None and old is not handler and not replace:
        raise ValueError(f"handler id {hid!r} is already registered ({old!r}); pass replace=True")
    taken = [t for t in types_ if t in _BY_TYPE and _BY_TYPE[t] is not handler]
    if taken and not replace:
        raise ValueError(
            f"type {taken[0].__qualname__} already has handler {_BY_TYPE[taken[0]].id!r}; "
            "pass replace=True"
        )
    _BY_ID[hid] = handler
    for typ in types_:
        _BY_TYPE[typ] = handler


def registered_types() -> Mapping[type, Handler]:
    """A read-only view of type -> default handler."""
    return types.MappingProxyType(_BY_TYPE)


def handler_for(obj: Any) -> Handler:
    """The default handler for `obj`'s type, walking its MRO; TypeError if there is none.

    With JAX loaded, a ``jax.Array`` or any node type registered with ``jax.tree_util`` (a flax
    struct, a registered dataclass) that has no handler of its own goes to the handler of ``dict``,
    the pytree handler.
    """
    for typ in type(obj).__mro__:
        handler = _BY_TYPE.get(typ)
        if handler is not None:
            return handler
    jax = sys.modules.get("jax")
    if jax is not None and dict in _BY_TYPE:
        is_pytree = jax.tree_util.default_registry.flatten_one_level(obj) is not None
        if is_pytree or isinstance(obj, jax.Array):
            return _BY_TYPE[dict]
    raise TypeError(
        f"no handler is registered for {type(obj).__qualname__}; pass handlers={{name: handler}} "
        "(JSON data goes through an explicit JsonHandler) or register one with "
        "cairn.handlers.register"
    )


def handler_by_id(hid: str) -> Handler:
    """The handler registered under `hid`; UnsupportedFormatError if this cairn does not know it."""
    handler = _BY_ID.get(hid)
    if handler is None:
        known = ", ".join(sorted(_BY_ID)) or "none"
        raise UnsupportedFormatError(
            f"no handler with id {hid!r} is registered (known: {known}); pass it with handlers="
        )
    return handler
