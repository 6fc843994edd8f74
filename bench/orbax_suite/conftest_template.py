"""Harness (copied as conftest.py by run.py): Orbax's checkpoint_manager_test.py, one process, CPU.

From docs/design/orbax-drop-in-research.md, appendix. The test module needs 8 devices (its
``setup_sharded_pytree`` reshapes them to (2, n/2)), flax/optax/chex (installed apart, in the
directory ``ORBAX_SUITE_SITE`` names), and ``orbax.checkpoint._src.testing.multiprocess_test``,
which the wheel does not ship: a stub stands in, whose temp dirs survive reruns in one
TEST_TMPDIR. The runner sets the environment too; the defaults here let the directory be run by
hand.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_SITE = os.environ.get("ORBAX_SUITE_SITE")
if _SITE and _SITE not in sys.path:
    sys.path.append(_SITE)  # after the venv: its own optax, jax and orbax win

import jax  # noqa: E402  (after XLA_FLAGS)
import orbax.checkpoint._src.testing as _testing  # noqa: E402
from absl import flags  # noqa: E402
from absl.testing import absltest  # noqa: E402
from orbax.checkpoint._src.multihost import multihost  # noqa: E402

_STUB_NAME = "orbax.checkpoint._src.testing.multiprocess_test"


class MultiProcessTest(absltest.TestCase):
    """The single-process part of Orbax's MultiProcessTest: per-test temp dirs."""

    def multiprocess_create_tempdir(self, name: str | None = None) -> str:
        directory = self._get_tempdir_path_test()
        if name is not None:
            directory = os.path.join(directory, name)
        shutil.rmtree(directory, ignore_errors=True)  # Orbax's makedirs has exist_ok=False
        os.makedirs(directory)
        return directory


_stub = types.ModuleType(_STUB_NAME)
_stub.MultiProcessTest = MultiProcessTest  # type: ignore[attr-defined]
_stub.main = absltest.main  # type: ignore[attr-defined]
sys.modules[_STUB_NAME] = _stub
_testing.multiprocess_test = _stub  # type: ignore[attr-defined]
multihost._RUNTIME_TO_DISTRIBUTED_ID = [0]


_reports: list[str | None] = [None]  # where to record reports: only in the controller


def pytest_configure(config: Any) -> None:
    """absl flags are read by the test module; under pytest nobody parses argv."""
    flags.FLAGS.mark_as_parsed()
    assert jax.device_count() == 8, f"need 8 CPU devices, have {jax.devices()}"
    if not hasattr(config, "workerinput"):  # xdist workers send their reports to the controller
        _reports[0] = os.environ.get("ORBAX_SUITE_REPORTS")


def pytest_runtest_logreport(report: Any) -> None:
    """One JSON line per report, subtests included: the junit xml folds a failing subtest into
    its test case, so a case that passed cannot be told from one whose subtest failed."""
    if _reports[0] is None or (report.when != "call" and report.outcome == "passed"):
        return
    context = getattr(report, "context", None)  # pytest's SubtestReport
    crash = getattr(report.longrepr, "reprcrash", None)
    error = getattr(crash, "message", None) or (str(report.longrepr) if report.failed else None)
    line = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "subtest": getattr(context, "msg", None) if context is not None else None,
        "is_subtest": context is not None,
        "error": error,
    }
    with open(_reports[0], "a") as out:
        out.write(json.dumps(line) + "\n")
