"""What the drop-in's constructor arguments set, as Orbax's constructor decides it: the
default-item mode, the items' kinds from handlers (or legacy Checkpointers), the step naming,
the directory, asynchrony and the barrier timeout."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cairn.manager._surfaces.orbax import args as A

ocp = A.ocp
DEFAULT_ITEM_NAME = "default"


class DefaultItem:
    """Whether this manager saves one unnamed item (Orbax's "default item" mode): fixed by the
    first save or restore, or by the constructor's arguments, then never changed."""

    def __init__(self, value: bool | None = None) -> None:
        self._value = value

    def get(self) -> bool | None:
        return self._value

    def set_if_none(self, value: bool) -> None:
        if self._value is None:
            self._value = value


def asynchronous(options: Any, checkpointers: Any) -> bool:
    """Orbax's legacy Checkpointers decide it by their class; else the option."""
    if checkpointers is None:
        return bool(options.enable_async_checkpointing)
    given = checkpointers.values() if isinstance(checkpointers, Mapping) else [checkpointers]
    return any(isinstance(c, ocp.AsyncCheckpointer) for c in given)


def item_modes(
    item_names: Sequence[str] | None, item_handlers: Any, registry: Any, checkpointers: Any
) -> tuple[DefaultItem, set[str] | None, dict[str, str]]:
    """Orbax's constructor modes: the default-item flag, the names allowed (None: any), and
    the items whose kind a handler fixes (legacy `checkpointers`: their handlers')."""
    if checkpointers is not None:
        if item_names is not None or item_handlers is not None or registry is not None:
            raise ValueError(
                "`checkpointers` should not be provided together with `item_names`, "
                "`item_handlers` or `handler_registry`."
            )
        if isinstance(checkpointers, Mapping):
            item_handlers = {n: getattr(c, "handler", c) for n, c in checkpointers.items()}
        else:
            item_handlers = getattr(checkpointers, "handler", checkpointers)
    single = isinstance(item_handlers, ocp.CheckpointHandler)
    if item_names is not None and single:
        raise ValueError(
            "`item_handlers` in default item mode and `item_names` should not be provided together."
        )
    if registry is not None and (item_names is not None or item_handlers is not None):
        raise ValueError(
            "`handler_registry` should not be provided together with `item_names` or "
            "`item_handlers`."
        )
    kinds: dict[str, str] = {}

    def kind(name: str, handler: Any) -> str:
        k = A.kind_of_handler(handler)
        if k is None:
            raise ValueError(
                f"item {name!r}: handler {type(handler).__qualname__} has no counterpart in "
                "cairn (Standard, PyTree, Json, Array and grain's handlers do)"
            )
        return k

    if single:
        kinds[DEFAULT_ITEM_NAME] = kind(DEFAULT_ITEM_NAME, item_handlers)
        return DefaultItem(True), {DEFAULT_ITEM_NAME}, kinds
    if registry is not None:
        for (name, _args_type), handler in registry.get_all_entries().items():
            if name is not None:
                kinds[name] = kind(name, handler)
        return DefaultItem(None), None, kinds
    if item_handlers is not None:
        if not isinstance(item_handlers, Mapping):
            raise TypeError(f"item_handlers must be a handler or a mapping, got {item_handlers!r}")
        for name, handler in item_handlers.items():
            kinds[name] = kind(name, handler)
    if item_names is None and item_handlers is None:
        return DefaultItem(None), None, kinds
    if isinstance(item_names, (str, bytes)) or not isinstance(item_names or (), Iterable):
        raise TypeError(f"item_names must be a sequence of names, got {item_names!r}")
    names = set(item_names or ()) | set(kinds)
    return DefaultItem(False), names, kinds


def naming(options: Any) -> tuple[str, int | None]:
    """cairn's step_prefix and step_digits for Orbax's naming options."""
    fmt = options.step_name_format
    prefix, digits = options.step_prefix, options.step_format_fixed_length
    if fmt is not None:
        if not (hasattr(fmt, "step_prefix") and hasattr(fmt, "step_format_fixed_length")):
            raise ValueError(
                f"step_name_format={fmt!r}: only orbax's standard_name_format(step_prefix, "
                "step_format_fixed_length) has a counterpart in cairn"
            )
        prefix, digits = fmt.step_prefix, fmt.step_format_fixed_length
    return prefix or "", digits


def directory(directory: Any, *, create: bool, read_only: bool) -> str:
    where = os.fspath(directory) if isinstance(directory, os.PathLike) else str(directory)
    if not create and not read_only and "://" not in where and not os.path.isdir(where):
        raise FileNotFoundError(
            f"{where} does not exist and options.create is False: create it, or pass create=True"
        )
    return where


def barrier_timeout(options: Any) -> float:
    async_options = options.async_options
    timeout = getattr(async_options, "timeout_secs", None) if async_options else None
    return float(timeout) if timeout else 300.0
