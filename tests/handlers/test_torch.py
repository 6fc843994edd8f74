"""Torch modules, optimizers, schedulers and tensors saved by CheckpointManager, without pickle."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.fuzzutil import checked_json, record_for

from cairn.handlers import TorchStateHandler, handler_for
from cairn.manager import CheckpointManager, CorruptCheckpointError, MismatchError


class Net(torch.nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, width)
        self.fp16 = torch.nn.Parameter(torch.randn(2, 3).to(torch.float16))
        self.bf16 = torch.nn.Parameter(torch.randn(5).to(torch.bfloat16))
        self.norm = torch.nn.BatchNorm1d(width)  # buffers: running stats, an int64 counter
        self.register_buffer("table", torch.arange(6, dtype=torch.int32).reshape(2, 3).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)).sum() + self.fp16.float().sum() + self.bf16.float().sum()


def trained() -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(8, 3)).backward()
        opt.step()
        sched.step()
    return net, opt, sched


def same_state(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same_state(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert a == b and type(a) is type(b), (a, b)


def test_torch_objects_get_this_handler() -> None:
    net, opt, sched = trained()
    for obj in (net, opt, sched, torch.ones(2)):
        assert isinstance(handler_for(obj), TorchStateHandler), obj


def test_module_optimizer_scheduler_round_trip_in_place(tmp_path: Path) -> None:
    net, opt, sched = trained()
    want = (
        {k: v.clone() for k, v in net.state_dict().items()},
        opt.state_dict(),
        sched.state_dict(),
    )
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": net, "optim": opt, "sched": sched})
        with torch.no_grad():  # training goes on while the commit runs: the snapshot is a copy
            for p in net.parameters():
                p.add_(100)
        mgr.wait_until_finished()
        files = sorted(p.name for p in (tmp_path / "checkpoint_1").rglob("*") if p.is_file())
        assert not [f for f in files if f.endswith((".pt", ".pkl", ".pth"))], files
    torch.manual_seed(1)
    net2 = Net()
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=7)
    with CheckpointManager(tmp_path, read_only=True) as reader:
        got = reader.restore(1, {"model": net2, "optim": opt2, "sched": sched2})
        assert got["model"] is net2 and got["optim"] is opt2 and got["sched"] is sched2
        plain = reader.restore(1, {"model": None})["model"]  # no target: the state dict
    same_state(want[0], net2.state_dict())
    same_state(want[0], plain)
    same_state(want[1], opt2.state_dict())
    same_state(want[2], sched2.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] != 0.5  # from the checkpoint
    assert net2.bf16.dtype == torch.bfloat16 and net2.table.dtype == torch.int32
    assert net2.norm.num_batches_tracked.dtype == torch.int64


def test_sgd_momentum_and_a_tensor(tmp_path: Path) -> None:
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    t = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"opt": opt, "t": t})
    with CheckpointManager(tmp_path, read_only=True) as reader:
        fresh = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        reader.restore(1, {"opt": fresh})
        same_state(opt.state_dict(), fresh.state_dict())
        back = reader.restore(1, {"t": None})["t"]
        assert torch.equal(back, t)
        into = torch.zeros(4, 3)
        assert reader.restore(1, {"t": into})["t"] is into and torch.equal(into, t)


def test_values_json_cannot_hold_round_trip(tmp_path: Path) -> None:
    handler = TorchStateHandler()
    state = {
        "nan": float("nan"),
        "inf": -math.inf,
        3: (None, "x", True, [1, 2.5]),
        "t": torch.ones(1),
    }
    with CheckpointManager(tmp_path, handlers={"s": handler}) as mgr:
        mgr.save(1, {"s": state})
    with CheckpointManager(tmp_path, read_only=True) as reader:
        same_state(state, reader.restore(1)["s"])


def test_mismatches_name_the_key_path(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": Net(width=4)})
    with CheckpointManager(tmp_path, read_only=True) as reader:
        with pytest.raises(
            MismatchError, match=r"key 'lin.weight'.*float32\[4, 3\].*float32\[5, 3\]"
        ):
            reader.restore(1, {"model": Net(width=5)})
        wrong = Net()
        wrong.fp16 = torch.nn.Parameter(torch.zeros(2, 3))  # float32 instead of float16
        with pytest.raises(MismatchError, match=r"key 'fp16'.*float16.*float32"):
            reader.restore(1, {"model": wrong})
        with pytest.raises(TypeError, match="a target must be a torch module"):
            reader.restore(1, {"model": [1, 2]})


def test_what_it_refuses_to_save(tmp_path: Path) -> None:
    handler = TorchStateHandler()
    with CheckpointManager(tmp_path, handlers={"s": handler}) as mgr:
        with pytest.raises(TypeError, match=r"key 'a/b'.*object.*no pickle"):
            mgr.save(1, {"s": {"a": {"b": object()}}})
        with pytest.raises(TypeError, match=r"keys must be str or int"):
            mgr.save(1, {"s": {(1, 2): torch.ones(1)}})
        with pytest.raises(TypeError, match="not list"):
            mgr.save(1, {"s": [torch.ones(1)]})
        assert mgr.all_steps() == []


def resign(item: Path, relpath: str, data: bytes) -> None:
    """Replace a file of step 1's item and fix its manifest record: a crafted step whose
    checksums hold, as an attacker who read docs/format.md would write it."""
    (item / relpath).write_bytes(data)
    manifest = item.parent / "_CHECKPOINT.json"
    body = json.loads(manifest.read_text())
    files = body["items"][item.name]["files"]
    (i,) = [i for i, f in enumerate(files) if f["path"] == relpath]
    files[i] = record_for(files[i], data)
    manifest.write_bytes(checked_json(body))


@pytest.mark.parametrize(
    "crafted",
    [
        {"tensor": 99, "dtype": "float32", "shape": [4, 3]},  # a file the manifest lacks
        {"tensor": 0, "dtype": "object", "shape": [1]},
        {"tensor": 0, "dtype": "float32", "shape": [2, 2]},  # not what the file holds
        {"tensor": "../../x", "dtype": "float32", "shape": [1]},
        {"pickle": "cos\nsystem\n"},
        {"a": 1, "b": 2, "c": 3},  # three keys, none "tensor" (issue 42: a raw ValueError)
        {"dict": [], "list": [], "value": 1},
    ],
)
def test_crafted_structures_are_corrupt_steps(tmp_path: Path, crafted: dict[str, object]) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(3, 4)})
    item = tmp_path / "checkpoint_1" / "model"
    doc = json.loads((item / "state.json").read_text())
    doc["tree"]["dict"][0][1] = crafted
    resign(item, "state.json", json.dumps(doc).encode())
    with (
        CheckpointManager(tmp_path, read_only=True) as reader,
        pytest.raises(
            CorruptCheckpointError,
            match=r"(state\.json|tensors/\S+)(,| is not in the manifest| holds)",
        ) as raised,
    ):
        reader.restore(1, {"model": None})
    assert "checksum" not in str(raised.value)  # the handler's own check, not the manifest's


Tree = dict[str, list[list[object]]]
# state.json of a Linear(3, 4) edited (records recomputed) and restored into a Linear(3, 4):
# what can be no state dict is a damaged file, a state dict that does not fit is a mismatch
# (issue 42: raw TypeError, AttributeError and RuntimeError from load_state_dict before).
TARGET_CASES: dict[str, tuple[Callable[[Tree], object], type[Exception], str]] = {
    "a list": (
        lambda tree: {"list": []},
        CorruptCheckpointError,
        r"state\.json: the state is a list, not a state dict",
    ),
    "a key True": (
        lambda tree: {"dict": [[True, {"value": 1}]]},
        CorruptCheckpointError,
        r"state\.json, key '<root>': a dict entry is not",
    ),
    "a key 7": (
        lambda tree: {"dict": [*tree["dict"], [7, {"value": 1}]]},
        CorruptCheckpointError,
        r"state\.json: the state is a dict with keys that are not str",
    ),
    "bias missing": (
        lambda tree: {"dict": [e for e in tree["dict"] if e[0] != "bias"]},
        MismatchError,
        r"(?s)item 'model': Linear\.load_state_dict refuses .*Missing key\(s\).*\"bias\"",
    ),
    "a key more": (
        lambda tree: {"dict": [*tree["dict"], ["extra", {"value": 1}]]},
        MismatchError,
        r"Unexpected key\(s\).*\"extra\"",
    ),
    "weight a str": (
        lambda tree: {
            "dict": [[k, {"value": "x"}] if k == "weight" else [k, v] for k, v in tree["dict"]]
        },
        MismatchError,
        r"parameter named \"weight\"",
    ),
}


@pytest.mark.parametrize("case", sorted(TARGET_CASES))
def test_a_crafted_state_restored_into_a_target(tmp_path: Path, case: str) -> None:
    edit, error, message = TARGET_CASES[case]
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(3, 4)})
    item = tmp_path / "checkpoint_1" / "model"
    doc = json.loads((item / "state.json").read_text())
    doc["tree"] = edit(doc["tree"])
    resign(item, "state.json", json.dumps(doc).encode())
    target = torch.nn.Linear(3, 4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with CheckpointManager(tmp_path, read_only=True) as reader, pytest.raises(error, match=message):
        reader.restore(1, {"model": target})
    if error is CorruptCheckpointError:  # refused before load_state_dict
        same_state(before, target.state_dict())


def test_a_checkpoint_that_does_not_fit_the_target_is_a_mismatch(tmp_path: Path) -> None:
    """Intact checkpoints restored into a target of another kind: MismatchError, not torch's
    TypeError or ValueError."""
    net = Net()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"t": torch.ones(3), "model": net, "opt": torch.optim.SGD(net.parameters())})
    with CheckpointManager(tmp_path, read_only=True) as reader:
        with pytest.raises(
            MismatchError, match=r"item 't', key '<root>'.*tensor, the target a Net"
        ):
            reader.restore(1, {"t": Net()})
        with pytest.raises(MismatchError, match=r"item 'model', key '<root>'.*dict, the target a "):
            reader.restore(1, {"model": torch.ones(3)})
        fewer = torch.optim.SGD(torch.nn.Linear(3, 4).parameters())
        with pytest.raises(MismatchError, match=r"item 'opt': SGD\.load_state_dict refuses"):
            reader.restore(1, {"opt": fewer})


def test_importing_cairn_does_not_import_torch() -> None:
    code = "import sys, cairn.manager, cairn.handlers; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
