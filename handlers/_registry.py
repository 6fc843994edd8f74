"""Which handler saves an item: an explicit choice, else the item's type (MRO), else an error.

The registry is a private dict with a read-only view. Handlers are also found by `id` when a
step is restored, from what its manifest recorded.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from cairn.handlers._protocol import Handler
from cairn.handlers.errors import UnsupportedFormatError

__all__ = ["handler_by_id", "handler_for", "register", "registered_types"]

_BY_TYPE: dict[type | str, Handler] = {}
_BY_ID: dict[str, Handler] = {}
_BY_METHODS: list[tuple[Callable[[Any], bool], Handler]] = []


def register(handler: Handler, *types_: type | str, replace: bool = False) -> None:
    """Make `handler` known by its id and, for each type given, the default for that type.

    A type may be given by its full name, ``"module.QualName"`` (as ``type.__module__`` and
    ``__qualname__`` spell it), so that a library need not be imported to register its types:
    TensorFlow's iterator is registered this way and TensorFlow loads only when one is saved.
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
        if not isinstance(typ, (type, str)) or typ == "":
            raise TypeError(f"register() takes types or type names after the handler, got {typ!r}")
    old = _BY_ID.get(hid)
    if old is not None and old is not handler and not replace:
        raise ValueError(f"handler id {hid!r} is already registered ({old!r}); pass replace=True")
    taken = [t for t in types_ if t in _BY_TYPE and _BY_TYPE[t] is not handler]
    if taken and not replace:
        raise ValueError(
            f"type {taken[0] if isinstance(taken[0], str) else taken[0].__qualname__} already has handler {_BY_TYPE[taken[0]].id!r}; "
            "pass replace=True"
        )
    _BY_ID[hid] = handler
    for typ in types_:
        _BY_TYPE[typ] = handler


def register_by_methods(handler: Handler, has_methods: Callable[[Any], bool]) -> None:
    """The handler for objects of any type without a handler that `has_methods` accepts
    (duck typing, tried after types and pytrees). Private: the built-ins use it."""
    register(handler, replace=True)
    _BY_METHODS.append((has_methods, handler))


def registered_types() -> Mapping[type | str, Handler]:
    """A read-only view of type (or type name) -> default handler."""
    return types.MappingProxyType(_BY_TYPE)


def _name(typ: type | str) -> str:
    return typ if isinstance(typ, str) else f"{typ.__module__}.{typ.__qualname__}"


def handler_for(obj: Any) -> Handler:
    """The default handler for `obj`'s type, walking its MRO; TypeError if there is none.

    With JAX loaded, a ``jax.Array`` or any node type registered with ``jax.tree_util`` (a flax
    struct, a registered dataclass) that has no handler of its own goes to the handler of ``dict``,
    the pytree handler. Then objects with state methods (``get_state``/``set_state`` or
    ``state_dict``/``load_state_dict``) go to StatefulIteratorHandler.
    """
    for typ in type(obj).__mro__:
        handler = _BY_TYPE.get(typ) or _BY_TYPE.get(_name(typ))
        if handler is not None:
            return handler
    jax = sys.modules.get("jax")
    if jax is not None and dict in _BY_TYPE:
        is_pytree = jax.tree_util.default_registry.flatten_one_level(obj) is not None
        if is_pytree or isinstance(obj, jax.Array):
            return _BY_TYPE[dict]
    for has_methods, handler in _BY_METHODS:
        if has_methods(obj):
            return handler
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
