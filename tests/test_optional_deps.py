"""A missing optional library gives MissingDependencyError naming the pip extra.

Each case runs in a child Python in which the library cannot be imported: a meta-path finder,
installed by a sitecustomize.py first on PYTHONPATH, raises ModuleNotFoundError for it exactly
as an absent install does (the library stays installed for the rest of the suite).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_error_names_the_extra(tmp_path: Path, case: str) -> None:
    module, code, phrase = CASES[case]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
    env = dict(os.environ, CAIRN_TEST_ABSENT=module, PYTHONPATH=str(site))
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cairn.handlers.errors.MissingDependencyError:"), done.stderr[-3000:]
    assert phrase in last and "pip install 'cairn-ckpt[" in last, last


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
