"""A missing optional library gives MissingDependencyError naming the pip extra.

Each case runs in a child Python in which the library cannot be imported: a meta-path finder,
installed by a sitecustomize.py first on PYTHONPATH, raises ModuleNotFoundError for it exactly
as an absent install does (the library stays installed for the rest of the suite).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cairn.handlers._optional import EXTRAS

BLOCKER = """
import importlib.abc, os, sys

class _Absent(importlib.abc.MetaPathFinder):
    blocked = set(os.environ["CAIRN_TEST_ABSENT"].split(","))

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""

CASES = {
    "tensorboard": (
        "tensorboard",
        "from cairn.manager import CheckpointManager\n"
        "CheckpointManager('run', tensorboard_dir='tb')",
        "tensorboard_dir= needs tensorboard",
    ),
    "tensorstore": (
        "tensorstore",
        "from cairn.manager import CheckpointManager\n"
        "CheckpointManager('s3://bucket/run', storage_options={'endpoint': 'http://127.0.0.1:9'})",
        "an object-store directory (s3://) needs tensorstore",
    ),
    "orbax": (
        "orbax",
        "import numpy as np\n"
        "from cairn.manager import CheckpointManager\n"
        "from cairn.manager.orbax import export_step\n"
        "with CheckpointManager('run') as mgr:\n"
        "    mgr.save(1, {'state': {'w': np.ones(2)}})\n"
        "export_step('run', 1, 'out')",
        "needs orbax",
    ),
    "tensorflow": (
        "tensorflow",
        "from cairn.handlers._iterators import TfDataIteratorHandler\n"
        "TfDataIteratorHandler().snapshot(object())",
        "tf.data iterator state needs tensorflow",
    ),
}


# Steps written first, by a child Python that has every library (the test process imports none).
WRITERS = {
    "tf.data iterator": (
        "import tensorflow as tf\n"
        "from cairn.manager import CheckpointManager\n"
        "it = iter(tf.data.Dataset.range(10))\n"
        "next(it)\n"
        "with CheckpointManager('run') as mgr:\n"
        "    mgr.save(1, {'data': it})"
    ),
    "jax train state": (
        "import jax.numpy as jnp\n"
        "from cairn.manager import CheckpointManager\n"
        "with CheckpointManager('run') as mgr:\n"
        "    mgr.save(1, {'state': {'w': jnp.arange(4.0)}})"
    ),
    "orbax step": (
        "import numpy as np, orbax.checkpoint as ocp\n"
        "opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)\n"
        "import os\nwith ocp.CheckpointManager(os.path.abspath('run'), options=opts) as mgr:\n"
        "    mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({'w': np.ones(2)})))"
    ),
}

# Restoring those steps in a Python without the library that reads them.
READERS = {
    "tf.data iterator": (
        "tensorflow",
        "from cairn.manager import CheckpointManager\n"
        "with CheckpointManager('run', read_only=True) as mgr:\n"
        "    mgr.restore(1)",
        "tf.data iterator state needs tensorflow",
        "tf",
    ),
    "jax train state": (
        "jax",
        "from cairn.manager import CheckpointManager\n"
        "with CheckpointManager('run', read_only=True) as mgr:\n"
        "    mgr.restore(1)",
        "a JAX train state needs jax",
        "jax",
    ),
    "orbax step": (
        "orbax",
        "from cairn.manager import CheckpointManager\n"
        "with CheckpointManager('run', read_only=True, step_prefix='') as mgr:\n"
        "    mgr.restore(1)",
        "reading a step orbax-checkpoint wrote needs orbax",
        "orbax",
    ),
}

# Exception lines of a traceback: "module.Name: message" or "Name: message".
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Warning)):", re.M)


def child(
    tmp_path: Path, code: str, absent: str | None, *, argv: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `code` (or `argv`) in a child Python in `tmp_path`, `absent` made unimportable."""
    env = dict(os.environ)
    if absent is not None:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
        env.update(CAIRN_TEST_ABSENT=absent, PYTHONPATH=str(site))
    return subprocess.run(
        argv or [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_names_the_extra(done: subprocess.CompletedProcess[str], phrase: str, extra: str) -> None:
    """The child failed with MissingDependencyError naming `extra`, caused by the absent module
    alone: no exception of another kind anywhere in its traceback."""
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cairn.handlers.errors.MissingDependencyError:"), done.stderr[-3000:]
    assert phrase in last and f"pip install 'cairn-ckpt[{extra}]'" in last, last
    kinds = set(EXCEPTION_LINE.findall(done.stderr))
    assert kinds <= {"ModuleNotFoundError", "cairn.handlers.errors.MissingDependencyError"}, kinds


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_error_names_the_extra(tmp_path: Path, case: str) -> None:
    module, code, phrase = CASES[case]
    extra = EXTRAS[module]
    assert_names_the_extra(child(tmp_path, code, module), phrase, extra)


@pytest.mark.parametrize("case", sorted(READERS))
def test_restoring_without_the_library_names_the_extra(tmp_path: Path, case: str) -> None:
    """A step saved where the library was installed, restored where it is not."""
    wrote = child(tmp_path, WRITERS[case], None)
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    module, code, phrase, extra = READERS[case]
    assert_names_the_extra(child(tmp_path, code, module), phrase, extra)


def test_the_command_line_says_it_in_one_line(tmp_path: Path) -> None:
    """cairn metrics --plot without matplotlib, cairn ls of a bucket without tensorstore: one
    line on stderr naming what to install, status 2, no traceback."""
    cairn = str(Path(sys.executable).with_name("cairn"))
    wrote = child(
        tmp_path,
        "from cairn.manager import CheckpointManager\n"
        "with CheckpointManager('run') as mgr:\n"
        "    mgr.save(1, {'s': [1]}, metrics={'loss': 0.5})",
        None,
    )
    assert wrote.returncode == 0, wrote.stderr
    plot = child(
        tmp_path,
        "",
        "matplotlib",
        argv=[cairn, "metrics", "run", "--plot", "m.png", "--mode", "min"],
    )
    assert plot.returncode == 2 and plot.stdout == "", plot
    assert plot.stderr.splitlines() == [
        "cairn: error: cairn metrics --plot needs matplotlib, which is not installed in this "
        "Python (No module named 'matplotlib'); install it with: pip install 'cairn-ckpt[plot]'"
    ]
    assert not (tmp_path / "m.png").exists()
    bucket = child(tmp_path, "", "tensorstore", argv=[cairn, "ls", "s3://bucket/run"])
    assert bucket.returncode == 2 and "Traceback" not in bucket.stderr, bucket
    (line,) = bucket.stderr.splitlines()
    assert "needs tensorstore" in line and "pip install 'cairn-ckpt[jax]'" in line, line


def test_the_blocker_blocks(tmp_path: Path) -> None:
    """The finder makes an installed library look absent (so the cases above test something)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
    env = dict(os.environ, CAIRN_TEST_ABSENT="tensorboard", PYTHONPATH=str(site))
    done = subprocess.run(
        [sys.executable, "-c", "import tensorboard"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "ModuleNotFoundError" in done.stderr
