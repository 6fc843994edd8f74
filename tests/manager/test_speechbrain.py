"""cairn.manager.speechbrain: SpeechBrain's recoverables API, its docstring examples with only the
import changed, and the atomicity and safety SpeechBrain lacks."""

from __future__ import annotations

import doctest
import json
import logging
import pathlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cairn.manager import CorruptCheckpointError
from cairn.manager.speechbrain import (
    DEFAULT_LOAD_HOOKS,
    DEFAULT_SAVE_HOOKS,
    Checkpoint,
    Checkpointer,
    average_checkpoints,
    average_state_dicts,
    ckpt_recency,
    get_default_hook,
    mark_as_loader,
    mark_as_saver,
    mark_as_transfer,
    register_checkpoint_hooks,
    torch_recovery,
)

# The seed's docstring examples (speechbrain/utils/checkpoints.py), with only the import changed.
SEED_EXAMPLES = {
    "module": """
>>> import torch
>>> from cairn.manager.speechbrain import *
>>> class Recoverable(torch.nn.Module):
...     def __init__(self, param):
...         super().__init__()
...         self.param = torch.nn.Parameter(torch.tensor([param]))
...     def forward(self, x):
...         return x * self.param
>>> model = Recoverable(1.)
>>> tempdir = getfixture('tmpdir')
>>> checkpointer = Checkpointer(tempdir, {"network": model})
>>> checkpointer.recover_if_possible()
>>> data = [(0.1, 0.9), (0.3, 0.8)]
>>> for example, target in data:
...     loss = (model(example) - target)**2
...     ckpt = checkpointer.save_and_keep_only()
""",
    "register_checkpoint_hooks": """
>>> from cairn.manager.speechbrain import *
>>> @register_checkpoint_hooks
... class CustomRecoverable:
...     def __init__(self, param):
...         self.param = int(param)
...
...     @mark_as_saver
...     def save(self, path):
...         with open(path, "w", encoding="utf-8") as fo:
...             fo.write(str(self.param))
...
...     @mark_as_loader
...     def load(self, path, end_of_epoch):
...         del end_of_epoch  # Unused here
...         with open(path, encoding="utf-8") as fi:
...             self.param = int(fi.read())
""",
    "get_default_hook": """
>>> import torch
>>> from cairn.manager.speechbrain import *
>>> a = torch.nn.Module()
>>> get_default_hook(a, DEFAULT_SAVE_HOOKS) == torch_save
True
""",
    "Checkpointer": """
>>> import torch
>>> from cairn.manager.speechbrain import *
>>> tempdir = getfixture('tmpdir')
>>> class Recoverable(torch.nn.Module):
...     def __init__(self, param):
...         super().__init__()
...         self.param = torch.nn.Parameter(torch.tensor([param]))
...     def forward(self, x):
...         return x * self.param
>>> recoverable = Recoverable(1.)
>>> recoverables = {'recoverable': recoverable}
>>> checkpointer = Checkpointer(tempdir, recoverables)
>>> first_ckpt = checkpointer.save_checkpoint()
>>> recoverable.param.data = torch.tensor([2.])
>>> loaded_ckpt = checkpointer.recover_if_possible()
>>> assert recoverable.param.data == torch.tensor([1.])
>>> checkpointer.save_and_keep_only()
>>> assert first_ckpt not in checkpointer.list_checkpoints()
""",
    "average_checkpoints": """
>>> import torch
>>> from cairn.manager.speechbrain import *
>>> class Recoverable(torch.nn.Module):
...     def __init__(self, param):
...         super().__init__()
...         self.param = torch.nn.Parameter(torch.tensor([param]))
...     def forward(self, x):
...         return x * self.param
>>> model = Recoverable(1.)
>>> tempdir = getfixture('tmpdir')
>>> checkpointer = Checkpointer(tempdir, {"model": model})
>>> for new_param in range(10):
...     model.param.data = torch.tensor([float(new_param)])
...     _ = checkpointer.save_checkpoint()  # Suppress output with assignment
>>> ckpt_list = checkpointer.find_checkpoints(max_num_checkpoints = 3)
>>> averaged_state = average_checkpoints(ckpt_list, "model")
>>> _ = model.load_state_dict(averaged_state)  # Suppress output
>>> model.param.data
tensor([8.])
""",
    "torch_recovery": """
>>> import torch
>>> from cairn.manager.speechbrain import *
>>> DEFAULT_LOAD_HOOKS[torch.nn.Module] = torch_recovery
""",
}


@pytest.mark.parametrize("name", sorted(SEED_EXAMPLES))
def test_seed_docstring_examples(name: str, tmp_path: Path) -> None:
    test = doctest.DocTestParser().get_doctest(
        SEED_EXAMPLES[name],
        {"getfixture": lambda fixture: tmp_path / name},
        name,
        None,
        0,
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


class Net(torch.nn.Module):
    def __init__(self, value: float = 1.0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        with torch.no_grad():
            self.lin.weight.fill_(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Counter:
    """An epoch counter with get_state/set_state (cairn's default for such objects)."""

    def __init__(self) -> None:
        self.current = 0

    def get_state(self) -> dict[str, Any]:
        return {"current": self.current, "history": (1, 2)}

    def set_state(self, state: dict[str, Any]) -> None:
        self.current = state["current"]
        assert state["history"] == (1, 2)


def test_torch_objects_state_objects_and_pytrees_round_trip(tmp_path: Path) -> None:
    net = Net(1.0)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    counter, stats = Counter(), {"mean": np.arange(4.0), "count": np.array(3)}
    counter.current = 7
    ckpt_dir = tmp_path / "ckpts"
    with Checkpointer(ckpt_dir, {"net": net, "opt": opt, "sched": sched}) as ckpter:
        ckpter.add_recoverables({"counter": counter, "stats": stats})
        saved = ckpter.save_checkpoint(meta={"loss": np.float32(0.5), "epoch": torch.tensor(3)})
    assert saved.meta["loss"] == 0.5 and saved.meta["epoch"] == 3
    assert saved.paramfiles["net"] == ckpt_dir / "CKPT_0" / "net" / "net.ckpt"
    assert torch.load(saved.paramfiles["net"], weights_only=True)["lin.weight"].shape == (2, 3)
    want_opt = json.dumps(opt.state_dict(), default=lambda t: t.tolist())

    net2, counter2, stats2 = Net(0.0), Counter(), {"mean": np.zeros(4), "count": np.array(0)}
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    recoverables = {"net": net2, "opt": opt2, "sched": sched2, "counter": counter2, "stats": stats2}
    with Checkpointer(ckpt_dir, recoverables) as ckpter:
        assert ckpter.recover_if_possible() == saved
    assert torch.equal(net2.lin.weight, net.lin.weight)
    assert json.dumps(opt2.state_dict(), default=lambda t: t.tolist()) == want_opt
    assert sched2.state_dict() == sched.state_dict()
    assert counter2.current == 7
    np.testing.assert_array_equal(stats2["mean"], np.arange(4.0))  # in place, same dict
    assert int(stats2["count"]) == 3


def test_custom_and_registered_hooks(tmp_path: Path) -> None:
    calls = []

    @register_checkpoint_hooks
    class Text:
        def __init__(self, text: str) -> None:
            self.text = text

        @mark_as_saver
        def save(self, path: pathlib.Path) -> None:
            pathlib.Path(path).write_text(self.text)

        @mark_as_loader
        def load(self, path: pathlib.Path, end_of_epoch: bool) -> None:
            calls.append(end_of_epoch)
            self.text = pathlib.Path(path).read_text()

    class Child(Text):  # found through the MRO
        pass

    def save_list(obj: list[int], path: pathlib.Path) -> None:
        pathlib.Path(path).write_text(",".join(map(str, obj)))

    def load_list(obj: list[int], path: pathlib.Path, end_of_epoch: bool) -> None:
        obj[:] = [int(x) for x in pathlib.Path(path).read_text().split(",")]

    items: list[int] = [1, 2, 3]
    with Checkpointer(
        tmp_path,
        {"child": Child("hello"), "items": items},
        custom_save_hooks={"items": save_list},
        custom_load_hooks={"items": load_list},
    ) as ckpter:
        ckpter.save_checkpoint(end_of_epoch=False)
        ckpter.recoverables["child"].text = "changed"
        items.append(4)
        ckpter.recover_if_possible()
        assert ckpter.recoverables["child"].text == "hello" and items == [1, 2, 3]
    assert calls == [False]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".trash")]  # staging is gone


def test_hook_signature_checks() -> None:
    with pytest.raises(TypeError, match=r"saver must match signature \(instance, path\)"):
        mark_as_saver(lambda self: None)
    with pytest.raises(TypeError, match=r"loader must have signature \(self, path, end_of_epoch\)"):
        mark_as_loader(lambda self, path: None)
    with pytest.raises(TypeError, match=r"Transfer hook must have signature \(self, path\)"):
        mark_as_transfer(lambda self, path, extra: None)
    assert get_default_hook(torch.nn.Linear(1, 1), DEFAULT_LOAD_HOOKS) is torch_recovery
    assert get_default_hook(object(), DEFAULT_SAVE_HOOKS) is None


def test_a_failing_save_leaves_nothing(tmp_path: Path) -> None:
    """SpeechBrain writes the meta file first: a crash leaves a checkpoint with meta but no
    payload. Here a failing hook leaves no checkpoint and no staging directory."""

    def broken(obj: Any, path: pathlib.Path) -> None:
        pathlib.Path(path).write_text("half")
        raise OSError("disk full")

    with Checkpointer(tmp_path, {"net": Net(), "x": [1]}, custom_save_hooks={"x": broken}) as c:
        with pytest.raises(OSError, match="disk full"):
            c.save_checkpoint()
        assert c.list_checkpoints() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cairn.lock"]

    def wrong_path(obj: Any, path: pathlib.Path) -> None:
        pathlib.Path(path).with_suffix(".other").write_text("x")

    with (
        Checkpointer(tmp_path, {"x": [1]}, custom_save_hooks={"x": wrong_path}) as c,
        pytest.raises(RuntimeError, match=r"must write exactly the path it is given"),
    ):
        c.save_checkpoint()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cairn.lock"]


def test_missing_recoverables(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, {"net": Net()}) as c:
        c.save_checkpoint()
    with (
        Checkpointer(tmp_path, {"net": Net(), "extra": Counter()}) as c,
        pytest.raises(RuntimeError, match="missing a load path for extra"),
    ):
        c.recover_if_possible()
    with Checkpointer(tmp_path, {"net": Net(), "extra": Counter()}, allow_partial_load=True) as c:
        assert c.recover_if_possible() is not None
    with Checkpointer(tmp_path, {"net": Net()}) as c:
        c.add_recoverable("scaler", Counter(), optional_load=True)
        with pytest.warns(UserWarning, match="missing a load path for scaler"):
            c.recover_if_possible()


def test_find_and_delete_by_meta(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, {"c": Counter()}) as c:
        for i, (loss, wer) in enumerate([(3.0, 9.0), (1.0, 7.0), (2.0, 8.0), (4.0, 5.0)]):
            c.save_checkpoint(meta={"loss": loss, "wer": wer, "i": i})
        c.save_checkpoint(meta={"note": "no metrics"})
        assert c.find_checkpoint(min_key="loss").meta["i"] == 1
        assert c.find_checkpoint(max_key="loss").meta["i"] == 3
        assert c.find_checkpoint().meta == {**c.list_checkpoints()[-1].meta}  # the newest
        assert [x.meta["i"] for x in c.find_checkpoints(min_key="wer", max_num_checkpoints=2)] == [
            3,
            1,
        ]
        only_even = c.find_checkpoints(
            importance_key=lambda x: -x.meta["loss"],
            ckpt_predicate=lambda x: x.meta.get("i", 1) % 2 == 0,
        )
        assert [x.meta["i"] for x in only_even] == [2, 0]
        with pytest.raises(ValueError, match="Must specify only one of"):
            c.find_checkpoint(max_key="loss", min_key="wer")
        with pytest.raises(ValueError, match="must be positive"):
            c.delete_checkpoints(num_to_keep=-1)
        c.delete_checkpoints(num_to_keep=1, min_keys=["loss"])  # keeps best loss + the newest
        left = sorted((x.meta.get("i", "newest") for x in c.list_checkpoints()), key=str)
        assert left == [1, "newest"]


def test_save_and_keep_only_keeps_recent_and_best(tmp_path: Path) -> None:
    """Also: the default importance_keys list is never mutated (SpeechBrain appends to it)."""
    with Checkpointer(tmp_path, {"c": Counter()}) as c:
        for i, loss in enumerate([5.0, 1.0, 3.0, 4.0, 6.0]):
            c.save_and_keep_only(meta={"loss": loss, "i": i}, num_to_keep=1, min_keys=["loss"])
        assert sorted(x.meta["i"] for x in c.list_checkpoints()) == [1, 4]
        # No importance order left: nothing is deleted. (In SpeechBrain the default list would
        # still hold ckpt_recency, appended by the calls before, and this would delete 1 and 4.)
        c.save_and_keep_only(meta={"loss": 9.0, "i": 5}, num_to_keep=1, keep_recent=False)
        assert [x.meta["i"] for x in c.list_checkpoints()] == [1, 4, 5]


def test_order_is_the_save_sequence_not_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1000.0)  # two saves within one clock tick
    with Checkpointer(tmp_path, {"c": Counter()}) as c:
        c.save_checkpoint(meta={"i": 0})
        c.save_checkpoint(meta={"i": 1})
        assert c.find_checkpoint().meta["i"] == 1
        assert ckpt_recency(c.find_checkpoint()) == (1, 1000.0)


def test_async_saves_capture_at_once(tmp_path: Path) -> None:
    net = Net(1.0)
    with Checkpointer(tmp_path, {"net": net}, async_save=True) as c:
        saved = c.save_checkpoint()
        with torch.no_grad():
            net.lin.weight.fill_(5.0)  # after save_checkpoint returned, maybe before the commit
        assert c.list_checkpoints() == [saved]  # waits for the pending save
        c.load_checkpoint(saved)
    assert torch.all(net.lin.weight == 1.0)


def test_damaged_file_is_detected_before_loading(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, {"net": Net()}) as c:
        saved = c.save_checkpoint()
    data = bytearray(saved.paramfiles["net"].read_bytes())
    data[len(data) // 2] ^= 0x01
    saved.paramfiles["net"].write_bytes(bytes(data))
    with (
        Checkpointer(tmp_path, {"net": Net()}) as c,
        pytest.raises(
            CorruptCheckpointError, match=r"net\.ckpt (fails its crc32c|is not the file)"
        ),
    ):
        c.recover_if_possible()


def test_speechbrain_written_checkpoints_are_read_safely(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory SpeechBrain wrote is listed and loaded; its yaml is data only: a yaml that
    would construct Python objects is skipped, never executed."""
    old = tmp_path / "CKPT+2024-01-01+00-00-00+00"
    old.mkdir()
    (old / "CKPT.yaml").write_text(
        "# yamllint disable\nend-of-epoch: true\nloss: 0.25\nunixtime: 5.0\n"
    )
    torch.save(Net(3.0).state_dict(), old / "net.ckpt")
    evil = tmp_path / "CKPT+2024-01-02+00-00-00+00"
    evil.mkdir()
    (evil / "CKPT.yaml").write_text("unixtime: !!python/object/apply:os.system ['echo pwned']\n")
    net = Net(0.0)
    with (
        caplog.at_level(logging.WARNING, logger="cairn"),
        Checkpointer(tmp_path, {"net": net}) as c,
    ):
        found = c.list_checkpoints()
        assert [x.path for x in found] == [old]
        assert found[0].meta == {"end-of-epoch": True, "loss": 0.25, "unixtime": 5.0}
        c.recover_if_possible()
        assert torch.all(net.lin.weight == 3.0)
        new = c.save_checkpoint()  # newer than every SpeechBrain checkpoint
        assert c.find_checkpoint() == new
        c.delete_checkpoints(num_to_keep=1)
        assert c.list_checkpoints() == [new] and not old.exists()
    assert "its meta does not parse" in caplog.text


def test_averaging_streams_and_checks(tmp_path: Path) -> None:
    state = {"w": np.zeros(3), "n": np.array(0)}
    with Checkpointer(tmp_path, {"state": state}) as c:
        for value in (1.0, 2.0, 6.0):
            state["w"][:] = value
            state["n"][...] = int(value)
            c.save_checkpoint()
        averaged = average_checkpoints(c.find_checkpoints(), "state")
    np.testing.assert_array_equal(averaged["w"], np.full(3, 3.0))
    assert float(averaged["n"]) == 3.0
    with pytest.raises(ValueError, match="No state dicts to average"):
        average_state_dicts([])
    with pytest.raises(ValueError, match="has keys"):
        average_state_dicts([{"a": np.ones(1)}, {"b": np.ones(1)}])
    seen = []

    def loader(path: Any, map_location: str) -> dict[str, Any]:
        seen.append(len(seen))
        return {"x": np.full(2, float(len(seen)))}

    fake = [Checkpoint(Path(f"/c{i}"), {"unixtime": i}, {"m": Path(f"/c{i}/m")}) for i in range(4)]
    np.testing.assert_array_equal(average_checkpoints(fake, "m", loader)["x"], np.full(2, 2.5))
    with pytest.raises(KeyError, match="'other' is not saved"):
        average_checkpoints(fake, "other")


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(AttributeError, match="Checkpointer needs a mapping"):
        Checkpointer(tmp_path / "a", [Net()])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bad item name '\.\./x'"):
        Checkpointer(tmp_path / "b", {"../x": Net()})
    with (
        Checkpointer(tmp_path / "c", {"o": object()}) as c,
        pytest.raises(RuntimeError, match="Don't know how to save <class 'object'>"),
    ):
        c.save_checkpoint()
    with Checkpointer(tmp_path / "d", {"n": Net()}) as c:
        with pytest.raises(
            TypeError, match=r"meta\['f'\] is a builtin_function_or_method; meta values must be"
        ):
            c.save_checkpoint(meta={"f": print})
        with pytest.raises(ValueError, match="'unixtime' is set by the checkpointer"):
            c.save_checkpoint(meta={"unixtime": 1})
        assert c.list_checkpoints() == []


def test_two_ddp_processes_share_one_directory(tmp_path: Path) -> None:
    """torch.distributed with 2 gloo processes: the main one writes, the other reads the same
    directory (no lock conflict), both see every save and deletion, and a second launch resumes."""
    import socket
    import subprocess
    import sys

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    worker = Path(__file__).parents[1] / "sb_ddp_worker.py"

    def launch() -> list[str]:
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), str(rank), port, str(tmp_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            outs.append(out)
        return outs

    first = launch()
    for out in first:
        assert "resumed None" in out
        assert "epoch 2 listed [2]" in out and "epoch 0 listed [0]" in out
    assert [p.name for p in tmp_path.glob("CKPT_*")] == ["CKPT_2"]
    for out in launch():
        assert "resumed 2" in out and "epoch 5 listed [5]" in out
        assert "counter 3" in out  # SpeechBrain's EpochCounter, loaded on both processes


def test_parameter_transfer_is_not_strict(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from cairn.manager.speechbrain import DEFAULT_TRANSFER_HOOKS, torch_parameter_transfer

    class Bigger(Net):
        def __init__(self) -> None:
            super().__init__(0.0)
            self.head = torch.nn.Linear(2, 1)

    with Checkpointer(tmp_path, {"net": Net(4.0)}) as c:
        saved = c.save_checkpoint()
    target = Bigger()
    assert get_default_hook(target, DEFAULT_TRANSFER_HOOKS) is torch_parameter_transfer
    with caplog.at_level(logging.WARNING, logger="cairn"):
        torch_parameter_transfer(target, saved.paramfiles["net"])
    assert torch.all(target.lin.weight == 4.0)
    assert "no parameters for 'head.weight'" in caplog.text


# A fresh process: import cairn.handlers, note its registry, then import the manager modules and
# save through a Checkpointer; the registry must not change, so the handler of SpeechBrain items
# is a built-in of cairn.handlers. (The id registry is private; a test may read it.)
_WRITER = """
import sys
import numpy as np
import torch
import cairn.handlers
from cairn.handlers import _registry

def registry():
    return dict(cairn.handlers.registered_types()), dict(_registry._BY_ID)

builtins = registry()
assert type(builtins[1]["cairn.speechbrain"]) is cairn.handlers.SpeechBrainHandler
import cairn.manager
import cairn.manager.speechbrain
from cairn.manager.speechbrain import Checkpointer
assert registry() == builtins, "importing cairn.manager registered a handler"

class Counter:
    def get_state(self):
        return {"current": 7, "history": (1, 2)}
    def set_state(self, state):
        raise AssertionError("not loaded here")

def hook(obj, path):
    path.write_text("written by a hook")

net = torch.nn.Linear(3, 2)
recoverables = {"net": net, "counter": Counter(), "tree": {"w": np.ones(3)}, "custom": object()}
with Checkpointer(sys.argv[1], recoverables, custom_save_hooks={"custom": hook}) as c:
    c.save_checkpoint(meta={"loss": 0.5})
torch.save(net.state_dict(), sys.argv[2])
assert registry() == builtins, "the Checkpointer registered a handler"
"""

# Another fresh process reads the step with a plain read-only CheckpointManager, cairn.manager's
# SpeechBrain modules replaced by empty ones before cairn.manager is imported: none of their code
# runs, so only a built-in handler of cairn.handlers can restore the step.
_READER = """
import json, sys, types
for name in ("cairn.manager.speechbrain", "cairn.manager._surfaces.speechbrain"):
    sys.modules[name] = types.ModuleType(name)
from cairn.manager import CheckpointManager
with CheckpointManager(sys.argv[1], read_only=True, step_prefix="CKPT") as mgr:
    info = mgr.info(0)
    restored = mgr.restore(0)
assert not hasattr(sys.modules["cairn.manager._surfaces.speechbrain"], "Checkpointer")
print(json.dumps({
    "handlers": {n: [i.handler, i.version] for n, i in info.items.items()},
    "paths": {n: str(restored[n]) for n in ("net", "counter", "custom")},
    "tree": restored["tree"]["w"].tolist(),
}))
"""


def test_importing_the_manager_registers_nothing_and_a_bare_reader_restores(
    tmp_path: Path,
) -> None:
    """Importing cairn.manager and cairn.manager.speechbrain, and saving with a Checkpointer,
    register no handler beyond cairn.handlers' built-ins; a read-only CheckpointManager in a
    fresh process where the SpeechBrain surface never ran restores the step (handler
    "cairn.speechbrain", version 1), and the files are what the Checkpointer saved."""
    import subprocess
    import sys

    root, expected = tmp_path / "ckpts", tmp_path / "net.pt"
    for script, args in ((_WRITER, [root, expected]), (_READER, [root])):
        run = subprocess.run(
            [sys.executable, "-c", script, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    handlers = got["handlers"]
    assert handlers.pop("tree")[0] != "cairn.speechbrain"  # a pytree: the train-state handler
    assert handlers == {n: ["cairn.speechbrain", 1] for n in ("net", "counter", "custom")}
    assert got["tree"] == [1.0, 1.0, 1.0]
    paths = {name: Path(p) for name, p in got["paths"].items()}
    assert paths["net"] == root / "CKPT_0" / "net" / "net.ckpt"
    saved = torch.load(paths["net"], weights_only=True)
    for key, value in torch.load(expected, weights_only=True).items():
        assert torch.equal(saved[key], value)
    assert paths["custom"].read_text() == "written by a hook"
    counter = Counter()  # the saved state loads as any recoverable's does
    with Checkpointer(root, {"counter": counter}, allow_partial_load=True) as c:
        c.recover_if_possible()
    assert counter.current == 7
