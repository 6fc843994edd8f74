"""An object-store save and restore stage nothing on local disk and hold no second copy.

A child process whose only temporary space is a 64 MiB tmpfs (TMPDIR, hence `tempfile`) saves a
train state of 256 MiB (1 GiB in the soak) to the moto S3 server and restores it. Anything
staged locally (a step written to disk before its upload, a download cache) would fill the
tmpfs and fail with ENOSPC. Peak RSS is read from the kernel (VmHWM in /proc/self/status, reset
through /proc/self/clear_refs before each phase), so no sample can miss it: during the save it
stays within the RSS before plus the snapshot (the handler copies NumPy leaves) plus 256 MiB;
during the restore within the RSS before plus the restored state plus 256 MiB.

The tmpfs is mounted here when the tests run as root (and unmounted in a finally); otherwise
in a private mount namespace of the child (``unshare --user --map-root-user --mount``).
"""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

MiB = 1 << 20
TMPFS_BYTES = 64 * MiB
RSS_SLACK = 256 * MiB


# ----------------------------------------------------------------------------- the child


def _status(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset the kernel's peak RSS (VmHWM) to the RSS now; the RSS now."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _state(nbytes: int) -> dict[str, Any]:
    """A T5X-like train state of float32 NumPy arrays, at least `nbytes` in all: params and
    Adam's mu and nu, each an embedding larger than a chunk file (64 MiB, so it is split),
    square kernels and small norm scales."""
    import numpy as np

    rng = np.random.default_rng(7)
    d = 1024
    third = -(-nbytes // 3)
    vocab = int(third * 0.85) // (4 * d)
    layer = 4 * d * d + 4 * d
    layers = -(-(third - vocab * d * 4) // layer)

    def part(scale: float) -> dict[str, Any]:
        embedding = rng.standard_normal((vocab, d), dtype=np.float32)
        embedding *= np.float32(scale)
        return {
            "embedding": embedding,
            "layers": [
                {
                    "kernel": rng.standard_normal((d, d), dtype=np.float32),
                    "scale": rng.standard_normal((d,), dtype=np.float32),
                }
                for _ in range(layers)
            ],
        }

    return {
        "step": np.int32(3),
        "params": part(0.02),
        "opt_state": {"mu": part(1e-3), "nu": part(1e-6)},
    }


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, list):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


def _used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def child(url: str, nbytes: int) -> dict[str, Any]:
    """Save and restore a state of `nbytes` under `url`; what was measured."""
    import numpy as np

    from cairn.manager import CheckpointManager

    tmp = tempfile.gettempdir()
    if os.path.realpath(tmp) != os.path.realpath(os.environ["TMPDIR"]):
        raise RuntimeError(f"tempfile uses {tmp}, not TMPDIR={os.environ['TMPDIR']}")
    st = os.statvfs(tmp)
    out: dict[str, Any] = {"tmpfs_bytes": st.f_blocks * st.f_frsize}
    # The bound is real: a file one byte larger than the tmpfs does not fit.
    try:
        with tempfile.TemporaryFile() as f:
            f.write(b"\0" * (TMPFS_BYTES + 1))
            f.flush()
            os.fsync(f.fileno())
        out["overfill"] = "fitted"
    except OSError as e:
        out["overfill"] = errno.errorcode.get(e.errno or 0, str(e.errno))

    state = _state(nbytes)
    out["state_bytes"] = sum(np.asarray(a).nbytes for a in _leaves(state))
    with CheckpointManager(url) as mgr:
        before = _reset_peak()
        t0 = time.perf_counter()
        mgr.save(3, {"state": state})
        mgr.wait_until_finished()
        out["save_s"] = time.perf_counter() - t0
        out["save_peak_extra"] = _status("VmHWM") - before
        out["tmp_used_after_save"] = _used(tmp)
    with CheckpointManager(url, read_only=True) as reader:
        before = _reset_peak()
        t0 = time.perf_counter()
        got = reader.restore(3)["state"]
        out["restore_s"] = time.perf_counter() - t0
        out["restore_peak_extra"] = _status("VmHWM") - before
        out["tmp_used_after_restore"] = _used(tmp)
    want, have = _leaves(state), _leaves(got)
    out["equal"] = len(want) == len(have) and all(
        np.asarray(w).dtype == np.asarray(h).dtype and np.array_equal(w, h)
        for w, h in zip(want, have, strict=True)
    )
    return out


# ----------------------------------------------------------------------------- the test


def _run_in_tmpfs(
    tmpfs: Path, argv: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run `argv` with a 64 MiB tmpfs mounted at `tmpfs` as its TMPDIR."""
    env = {**env, "TMPDIR": str(tmpfs)}
    options = f"size={TMPFS_BYTES},mode=0700"
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(tmpfs)], check=True)
        try:
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=540)
        finally:
            subprocess.run(["umount", str(tmpfs)], check=True)
    # Not root: a tmpfs in a mount namespace of the child's own, gone when it exits.
    script = 'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"'
    wrapped = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]
    return subprocess.run(
        [*wrapped, options, str(tmpfs), *argv], env=env, capture_output=True, text=True, timeout=540
    )


@pytest.mark.parametrize(
    "nbytes", [256 * MiB, pytest.param(1024 * MiB, marks=pytest.mark.slow)], ids=["256M", "1G"]
)
def test_save_and_restore_stage_nothing_locally(
    s3_bucket: str, tmp_path: Path, nbytes: int
) -> None:
    import tensorstore as ts

    from cairn.manager._storage.objectstore import ObjectStore, StorageOptions

    tmpfs = tmp_path / "tmpfs"
    tmpfs.mkdir()
    url = f"{s3_bucket}/bounds"
    argv = [sys.executable, "-W", "error", __file__, url, str(nbytes)]
    try:
        res = _run_in_tmpfs(tmpfs, argv, dict(os.environ))
    finally:  # moto keeps the objects: free them for the rest of the session
        store = ObjectStore(s3_bucket, StorageOptions())
        store._kv.delete_range(ts.KvStore.KeyRange()).result()
    assert res.returncode == 0, (
        f"the child failed (ENOSPC means something was staged):\n{res.stderr[-6000:]}"
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(got))  # shown with -s, or -rP
    assert got["tmpfs_bytes"] == TMPFS_BYTES, got
    assert got["overfill"] == "ENOSPC", got  # the tmpfs really bounds what can be staged
    assert got["equal"], "the restored state differs from the saved one"
    assert got["state_bytes"] >= nbytes, got
    assert got["tmp_used_after_save"] < TMPFS_BYTES and got["tmp_used_after_restore"] < TMPFS_BYTES
    # The snapshot copies every NumPy leaf once; beyond that, at most RSS_SLACK.
    snapshot = got["state_bytes"]
    assert got["save_peak_extra"] <= snapshot + RSS_SLACK, (
        f"save: peak RSS {got['save_peak_extra'] / MiB:.0f} MiB above the RSS before, "
        f"more than the snapshot ({snapshot / MiB:.0f} MiB) + {RSS_SLACK // MiB} MiB"
    )
    assert got["restore_peak_extra"] <= got["state_bytes"] + RSS_SLACK, (
        f"restore: peak RSS {got['restore_peak_extra'] / MiB:.0f} MiB above the RSS before, "
        f"more than the restored state ({got['state_bytes'] / MiB:.0f} MiB) + {RSS_SLACK // MiB} MiB"
    )


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], int(sys.argv[2]))))
