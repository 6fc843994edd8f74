"""Read your own writes in one process (issue 43, point 4): a reader opened in a process whose
writable manager has accepted saves that are still being committed waits for them (bounded,
logged) and sees them. T5X's Checkpointer.save is synchronous, and T5X's own tests read the
directory right after it; under cairn the commit lands in the background.

Each test holds the commit on a gate, starts the reader on a thread, waits (on a log record, not
a sleep) until the reader is waiting for the writer, then releases the commit: the reader must
see the step. A reader that did not wait would have listed the directory before the commit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Gate

from cairn.handlers import InMemoryHandler, TrainStateHandler
from cairn.manager import CheckpointManager
from cairn.manager import t5x as checkpoints
from cairn.manager._surfaces.cli import main as cairn_main


class Waiting(logging.Handler):
    """Sets `seen` when a reader logs that it waits for this process's writer."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting for the saves this process's writer accepted" in record.getMessage():
            self.seen.set()


@pytest.fixture
def waiting() -> Iterator[Waiting]:
    handler = Waiting()
    logger = logging.getLogger("cairn")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def read_while_held(gate: Gate, waiting: Waiting, read: Callable[[], Any]) -> Any:
    """Run `read` on a thread while the commit is held; release it once the reader waits."""
    assert gate.entered.wait(30)
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(read()))
    thread.start()
    try:
        assert waiting.seen.wait(30), "the reader did not wait for this process's writer"
    finally:
        gate.release.set()
        thread.join(60)
    assert result, "the reader failed"
    return result[0]


def test_a_read_only_manager_sees_the_accepted_save(
    tmp_path: Path, gate: Gate, waiting: Waiting
) -> None:
    handlers = {"x": InMemoryHandler(on_write=gate)}
    with CheckpointManager(tmp_path, handlers=handlers) as writer:
        assert writer.save(1, {"x": "payload"})

        def read() -> Any:
            with CheckpointManager(tmp_path, read_only=True, handlers=handlers) as reader:
                return reader.all_steps(), reader.restore()["x"]

        assert read_while_held(gate, waiting, read) == ([1], "payload")


def test_t5x_functions_see_the_checkpointer_save(
    tmp_path: Path, gate: Gate, waiting: Waiting, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5X's checkpoint tests save with Checkpointer.save, then call latest_step, all_steps,
    find_checkpoint and load_t5x_checkpoint at once."""
    original = TrainStateHandler.snapshot

    def held(self: TrainStateHandler, obj: Any) -> Any:
        snap = original(self, obj)
        write = snap.write

        def gated(dest: Any) -> Any:
            gate()
            return write(dest)

        snap.write = gated
        return snap

    monkeypatch.setattr(TrainStateHandler, "snapshot", held)
    state = {"step": jnp.array(5, jnp.int32), "params": {"w": jnp.arange(4.0)}, "opt_state": {}}
    ckpt = checkpoints.Checkpointer(state, None, tmp_path)
    ckpt.save(state)

    def read() -> Any:
        loaded = checkpoints.load_t5x_checkpoint(tmp_path)
        return (
            checkpoints.latest_step(tmp_path),
            checkpoints.all_steps(tmp_path),
            checkpoints.find_checkpoint(tmp_path).endswith("checkpoint_5/_CHECKPOINT.json"),
            np.asarray(loaded["target"]["w"]).tolist(),
        )

    assert read_while_held(gate, waiting, read) == (5, [5], True, [0.0, 1.0, 2.0, 3.0])
    ckpt.close()


def test_the_cli_as_a_function_sees_the_save(
    tmp_path: Path, gate: Gate, waiting: Waiting, capsys: pytest.CaptureFixture[str]
) -> None:
    handlers = {"x": InMemoryHandler(on_write=gate)}
    with CheckpointManager(tmp_path, handlers=handlers) as writer:
        assert writer.save(3, {"x": "payload"})
        code = read_while_held(gate, waiting, lambda: cairn_main(["ls", str(tmp_path), "--json"]))
    assert code == 0 and '"step": 3' in capsys.readouterr().out


def test_nothing_waits_without_a_save_in_flight(tmp_path: Path, waiting: Waiting) -> None:
    with CheckpointManager(tmp_path) as writer:
        writer.save(1, {"s": {"x": np.arange(3)}})
        writer.wait_until_finished()
        with CheckpointManager(tmp_path, read_only=True) as reader:
            assert reader.all_steps() == [1]
    assert not waiting.seen.is_set()
