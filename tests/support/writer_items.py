"""Items whose write misbehaves in a writer process (``writer="process"``); importable there,
so without jax."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

from cairn.handlers import FileRecord


class _Misbehaving:
    version = 1

    def restore(self, stored: Any, target: Any = None) -> Any:
        return None

    def describe(self, stored: Any) -> dict[str, Any]:
        return {}


class Killer(_Misbehaving):
    """An item whose write SIGKILLs the process that writes it, after a first file; saved as
    "spare", it writes nothing and kills nobody (the other processes of a multi-process run)."""

    id = "test.killer"

    def snapshot(self, obj: Any) -> KillerSnapshot:
        return KillerSnapshot(spare=obj == "spare")


class KillerSnapshot:
    def __init__(self, *, spare: bool = False) -> None:
        self.spare = spare

    def write(self, dest: Any) -> Sequence[FileRecord]:
        if self.spare:
            return []
        dest.write_file("half.bin", b"x" * 4096)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


class Raiser(_Misbehaving):
    """An item whose write raises ValueError in the process that writes it."""

    id = "test.raiser"

    def snapshot(self, obj: Any) -> RaiserSnapshot:
        return RaiserSnapshot(os.getpid())


class RaiserSnapshot:
    def __init__(self, trainer: int) -> None:
        self.trainer = trainer

    def write(self, dest: Any) -> Sequence[FileRecord]:
        raise ValueError(f"boom in pid {os.getpid()}, handed over by pid {self.trainer}")


class Gated(_Misbehaving):
    """An item whose write waits until someone opens the FIFO its object names for writing."""

    id = "test.gated"

    def snapshot(self, obj: Any) -> GatedSnapshot:
        return GatedSnapshot(str(obj))


class GatedSnapshot:
    def __init__(self, fifo: str) -> None:
        self.fifo = fifo

    def write(self, dest: Any) -> Sequence[FileRecord]:
        with open(self.fifo, "rb") as gate:  # blocks until the test opens it for writing
            gate.read(1)
        return [dest.write_file("passed.txt", b"the gate opened")]
