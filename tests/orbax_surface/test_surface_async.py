"""Async saving: progress, waiting from several threads, closing, and the cached step list."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax_surface.surface_util import assert_same_tree, jax_state, opts, save_all, steps_on_disk


def test_saving_is_not_in_progress_after_wait_until_finished(impl: Any, root: Path) -> None:
    with impl(root) as manager:
        assert manager.is_saving_in_progress() is False
        save_all(manager, [0])
        assert manager.all_steps() == [0]  # listed as soon as save() returns
        manager.wait_until_finished()
        assert manager.is_saving_in_progress() is False
        manager.check_for_errors()
        save_all(manager, [1])
        manager.wait_until_finished()
        assert manager.is_saving_in_progress() is False
        assert manager.all_steps() == [0, 1]
    assert steps_on_disk(root) == [0, 1]


def test_wait_until_finished_from_several_threads_at_once(impl: Any, root: Path) -> None:
    errors: list[BaseException] = []
    with impl(root) as manager:
        save_all(manager, [0])
        start = threading.Barrier(4)

        def wait() -> None:
            try:
                start.wait(timeout=60)
                manager.wait_until_finished()
                assert manager.is_saving_in_progress() is False
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=wait) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == []
        assert manager.all_steps() == [0]
    assert steps_on_disk(root) == [0]


def test_leaving_the_context_manager_commits_the_pending_save(impl: Any, root: Path) -> None:
    state = jax_state(6.0)
    with impl(root) as manager:
        assert isinstance(manager, impl)
        manager.save(0, args=ocp.args.StandardSave(state))  # no wait: __exit__ must finish it
    assert steps_on_disk(root) == [0]
    with impl(root, options=opts(read_only=True)) as reader:
        assert reader.all_steps() == [0]
        assert_same_tree(reader.restore(0), state)


def test_close_commits_the_pending_save(impl: Any, root: Path) -> None:
    manager = impl(root)
    save_all(manager, [0, 1])
    manager.close()
    assert steps_on_disk(root) == [0, 1]


def test_all_steps_is_cached_until_reload(impl: Any, root: Path) -> None:
    with impl(root) as writer:
        save_all(writer, [0])
        writer.wait_until_finished()
        with impl(root, options=opts(read_only=True)) as reader:
            assert reader.all_steps() == [0]
            save_all(writer, [1, 2])
            writer.wait_until_finished()
            writer.delete(0)
            assert reader.all_steps() == [0]  # cached
            assert reader.latest_step() == 0
            reader.reload()
            assert reader.all_steps() == [1, 2]
            assert reader.latest_step() == 2
            restored = reader.restore(
                None, args=ocp.args.Composite(state=ocp.args.StandardRestore())
            )
            assert_same_tree(restored.state, jax_state(2))


def test_reload_sees_steps_another_writer_saved(impl: Any, root: Path) -> None:
    with impl(root) as first:
        save_all(first, [0])
    with impl(root, options=opts(read_only=True)) as reader:
        assert reader.all_steps() == [0]
        with impl(root, options=opts(max_to_keep=2)) as writer:
            save_all(writer, [1, 2])
        assert reader.all_steps() == [0]
        reader.reload()
        assert reader.all_steps() == [1, 2]
        assert reader.latest_step() == 2
        restored = reader.restore(None, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        assert_same_tree(restored.state, jax_state(2))
