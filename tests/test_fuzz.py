"""Issue 17's fuzzer: committed directories mutated as a stranger could, every entry point run.

Each case copies a template directory (written once per process through the public API),
applies mutations drawn by Hypothesis (`fuzzutil.mutations`), then opens, lists, verifies,
restores, saves (start-up clean-up and retention included) and runs the ``cairn`` commands, and
checks what `fuzzutil` states: only documented errors, a sentinel tree beside the root untouched,
a bounded heap, no hang, and changed bytes detected. Families of templates: cairn's own steps,
a root shared with steps orbax-checkpoint wrote, a SpeechBrain checkpoint directory, and tf.data
iterator states (in a process of their own: TensorFlow's decoder is native code).

`make test` runs a fixed set of cases (derandomized: the same cases every run), `make soak`
25 to 200 times as many random ones, with up to three mutations each.
CAIRN_FUZZ_SUMMARY=<file> writes the number of cases per family and mutation kind as JSON.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from support import fuzzutil as fz

KINDS: collections.Counter[str] = collections.Counter()
QUICK = settings(
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a mutation is already one change
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SOAK = settings(QUICK, derandomize=False)
# Built on first use (the first draw), so that strategies can name the template's files.
TEMPLATES = {family: fz.Lazy(build) for family, build in fz.BUILDERS.items()}


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Iterator[Path]]:
    base = tmp_path_factory.mktemp("fuzz-cases")
    yield (base / f"case-{i}" for i in itertools.count())
    summary = os.environ.get("CAIRN_FUZZ_SUMMARY")
    if summary:
        Path(summary).write_text(json.dumps(dict(sorted(KINDS.items())), indent=1) + "\n")


def check(family: str, workdir: Path, muts: list[fz.Mutation]) -> None:
    KINDS[f"{family}: {fz.kind_of(muts)}"] += 1
    try:
        report = fz.run_case(TEMPLATES[family].get(), workdir, muts)
    finally:
        fz.remove_case(workdir)
    if report.failures:
        pytest.fail(f"{muts!r}:\n  " + "\n  ".join(report.failures), pytrace=False)


def fuzz(family: str, cases: int, *, soak: bool = False) -> Callable[..., None]:
    """A test of `cases` cases of `family`: one mutation each, or up to three in the soak."""
    one = st.deferred(lambda: fz.mutations(TEMPLATES[family].get()))
    drawn = st.lists(one, min_size=1, max_size=3 if soak else 1)

    @settings(SOAK if soak else QUICK, max_examples=cases)
    @given(mutations=drawn)
    def test(workdirs: Iterator[Path], mutations: list[fz.Mutation]) -> None:
        event(fz.kind_of(mutations))
        check(family, next(workdirs), mutations)

    return test


# The quick counts are a small fixed sample of each family's mutations, beside the fixed cases
# below; the soak twins run at least ten times the earlier quick counts, at random.
test_fuzz = fuzz("cairn", 30)  # 2000 in the soak (80 here until 2026-12-05)
test_fuzz_packed = fuzz("packed", 12)  # 500 in the soak (30 here until 2026-12-05)
test_fuzz_t5x = fuzz("t5x", 8)  # 300 in the soak (20 here until 2026-12-05)
test_fuzz_orbax = fuzz("orbax", 12)  # 300 in the soak (30 here until 2026-12-05)
test_fuzz_speechbrain = fuzz("speechbrain", 12)  # 300 in the soak (30 here until 2026-12-05)
SOAK_HOURS = pytest.mark.timeout(4 * 3600)
test_fuzz_soak = pytest.mark.slow(SOAK_HOURS(fuzz("cairn", 2000, soak=True)))
test_fuzz_packed_soak = pytest.mark.slow(SOAK_HOURS(fuzz("packed", 500, soak=True)))
test_fuzz_orbax_soak = pytest.mark.slow(SOAK_HOURS(fuzz("orbax", 300, soak=True)))
test_fuzz_speechbrain_soak = pytest.mark.slow(SOAK_HOURS(fuzz("speechbrain", 300, soak=True)))
test_fuzz_t5x_soak = pytest.mark.slow(SOAK_HOURS(fuzz("t5x", 300, soak=True)))


def fuzz_s3(cases: int, *, soak: bool = False) -> Callable[..., None]:
    """A test of `cases` cases of a cairn directory in a bucket of a real S3 server (moto)."""
    one = st.deferred(lambda: fz.s3_mutations(TEMPLATES["cairn"].get()))
    drawn = st.lists(one, min_size=1, max_size=3 if soak else 1)

    @settings(
        SOAK if soak else QUICK,
        max_examples=cases,
        suppress_health_check=[*QUICK.suppress_health_check, HealthCheck.function_scoped_fixture],
    )
    @given(mutations=drawn)
    def test(s3_bucket: str, workdirs: Iterator[Path], mutations: list[fz.Mutation]) -> None:
        event(fz.kind_of(mutations))
        KINDS[f"s3: {fz.kind_of(mutations)}"] += 1
        work = next(workdirs)
        try:
            report = fz.run_s3_case(TEMPLATES["cairn"].get(), work, mutations, s3_bucket)
        finally:
            fz.remove_case(work)
        if report.failures:
            pytest.fail(f"{mutations!r}:\n  " + "\n  ".join(report.failures), pytrace=False)

    return test


test_fuzz_s3 = fuzz_s3(2)  # 200 in the soak (4 here until 2026-12-05)
test_fuzz_s3_soak = pytest.mark.slow(SOAK_HOURS(fuzz_s3(200, soak=True)))


def survey_in_a_process(family: str, cases: int, seed: int | None, timeout: float) -> None:
    """`fuzzutil.main` in a child process: a crash (SIGSEGV in TensorFlow) is a failure that
    names the case it happened in, not the end of the test run."""
    argv = [sys.executable, fz.__file__, family, str(cases), *([str(seed)] if seed else [])]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    drawn = [line[5:] for line in out.stdout.splitlines() if line.startswith("CASE ")]
    for case in drawn:
        KINDS[f"{family}: {case.split('(', 1)[0]}"] += 1
    failures = [
        json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("FAIL ")
    ]
    if out.returncode < 0:
        pytest.fail(
            f"the {family} survey died of signal {-out.returncode} in case {drawn[-1:]}; "
            f"stderr ends: {out.stderr[-1500:]}",
            pytrace=False,
        )
    if out.returncode != 0 or len(drawn) < cases:
        lines = [f"{f['mutation']}:\n    " + "\n    ".join(f["failures"]) for f in failures]
        pytest.fail(
            f"{len(failures)} of {len(drawn)} {family} cases failed (exit status "
            f"{out.returncode}):\n  " + "\n  ".join(lines or [out.stderr[-1500:]]),
            pytrace=False,
        )


@pytest.mark.timeout(900)
def test_fuzz_tfdata() -> None:
    # Each restore into an iterator first tries the state in a probe process (importing
    # TensorFlow, seconds each): one case here (2 until 2026-12-05), 200 in the soak.
    survey_in_a_process("tfdata", 1, seed=None, timeout=840)


@pytest.mark.slow
@SOAK_HOURS
def test_fuzz_tfdata_soak() -> None:
    survey_in_a_process("tfdata", 200, seed=random.randrange(1, 2**32), timeout=4 * 3600 - 60)


M = fz.mutation
# The attacks issue 17 reports, each as a case of its own, whatever Hypothesis draws.
KEY_CASES = {
    "1: a dropped item named ../../sentinel/sub": M(
        "manifest.item_name", "checkpoint_1", item="config", name="../../sentinel/sub", dropped=True
    ),
    "1: a dropped item named ..": M(
        "manifest.item_name", "checkpoint_2", item="config", name="..", dropped=True
    ),
    "1: a dropped item named .": M(
        "manifest.item_name", "checkpoint_2", item="config", name=".", dropped=True
    ),
    "2: an item that is a step outside the root": M(
        "manifest.foreign_item",
        "checkpoint_3",
        name="../../sentinel/run/checkpoint_1/config",
        copy_of="config",
        dropped=False,
    ),
    "2: a file record leaving the item": M(
        "manifest.record",
        "checkpoint_3",
        item="config",
        op="path",
        index=0,
        other=0,
        value="../../../sentinel/run/checkpoint_1/config/data.json",
    ),
    "3: .cairn.lock linked to a dotfile": M(
        "fs.lock", fz.LOCK, what="link", to=".hidden", absolute=True
    ),
    "4: two chunks of one leaf swapped": M(
        "bytes.swap_chunks",
        "checkpoint_2/state/arrays/0/0.0",
        other="checkpoint_2/state/arrays/0/1.0",
    ),
    "4: a params chunk swapped with an optimizer chunk": M(
        "bytes.swap_chunks",
        "checkpoint_1/state/arrays/0/0.0",
        other="checkpoint_1/state/arrays/2/1.0",
    ),
    "4: a stale chunk from another step": M(
        "bytes.stale", "checkpoint_3/state/arrays/0/1.0", source="checkpoint_2/state/arrays/0/1.0"
    ),
    "5: a negative shape": M(
        "tree.edit", "checkpoint_3/state/tree.json", field="shape", pick=0, value=[-4, 8]
    ),
    "5: an object dtype": M(
        "tree.edit", "checkpoint_3/state/tree.json", field="dtype", pick=0, value="|O"
    ),
    "5: a 64 TiB shape": M(
        "tree.edit", "checkpoint_3/state/tree.json", field="shape", pick=0, value=[2**40, 8]
    ),
    "5: a 256 MiB shape in zarr.json": M(
        "zarr.edit",
        "checkpoint_3/state/arrays/0/zarr.json",
        field="shape",
        pick=0,
        value=[2**14, 2**12],
    ),
    "10: a FIFO for a manifest": M("fs.fifo", "checkpoint_3/_CHECKPOINT.json"),
    "10: a FIFO for tree.json": M("fs.fifo", "checkpoint_3/state/tree.json"),
    "10: a FIFO for metrics.json": M("fs.fifo", "checkpoint_1/metrics.json"),
    "10: a FIFO for .cairn.lock": M("fs.fifo", fz.LOCK),
    "11: a manifest nested 100,000 deep": M(
        "manifest.whole", "checkpoint_3", text=fz.deep(100_000).text
    ),
    "11: a 5,000-digit integer in data.json": M(
        "data.edit", "checkpoint_3/config/data.json", pick=1, value=fz.Raw("1" + "0" * 5000)
    ),
    "11: started_at of 10**400": M(
        "manifest.field", "checkpoint_3", field="started_at", value=10**400
    ),
    "12: a metric name with escape sequences": M(
        "manifest.user_values", "checkpoint_3", where="metrics", key="\x1b[31mred", value=1.0
    ),
    "12: a NaN metric": M(
        "manifest.user_values", "checkpoint_3", where="metrics", key="loss", value=float("nan")
    ),
    "a dropped item's directory linked into the sentinel": M(
        "fs.dropped_dir", "checkpoint_1/extra", what="link", to="sub"
    ),
    "a step directory linked to a step outside": M(
        "fs.symlink", "checkpoint_1", to="run/checkpoint_1", absolute=False, other=""
    ),
    "a .trash- leftover linked into the sentinel": M(
        "fs.extra", "", name=".trash-checkpoint_1-" + "b" * 32, what="link", to="sub"
    ),
    "a .tmp- leftover linked into the sentinel": M(
        "fs.extra", "", name="checkpoint_4.tmp-" + "a" * 32, what="link", to="sub"
    ),
    "a manifest replacement leftover linked to a sentinel file": M(
        "fs.extra",
        "checkpoint_2",
        name="._CHECKPOINT.json.tmp-" + "c" * 32,
        what="link",
        to="a.txt",
    ),
}


@pytest.mark.parametrize("mutation", list(KEY_CASES.values()), ids=list(KEY_CASES))
def test_key_case(workdirs: Iterator[Path], mutation: fz.Mutation) -> None:
    check("cairn", next(workdirs), [mutation])


# The attacks issue 42 reports: on the packed layout (the index, and the incremental save that
# the harness makes of the newest step's state), on the lock, and on an object store's lease.
PACKED_KEY_CASES = {
    "42.1: the newest step's index points a chunk at another's bytes": M(
        "index.lie", "checkpoint_3/state/packs/index.0.json", pick=1, to="other chunk", by=1
    ),
    "42.1: an older step's index shifted by a byte": M(
        "index.lie", "checkpoint_2/state/packs/index.0.json", pick=5, to="shifted", by=1
    ),
    "42.1: an entry past the end of its pack": M(
        "index.lie", "checkpoint_3/state/packs/index.0.json", pick=0, to="past the end", by=3
    ),
    "42.2: .cairn.lock a hard link to a file beside the root": M(
        "fs.lock", fz.LOCK, what="hardlink", to="a.txt", absolute=False
    ),
}


@pytest.mark.parametrize("mutation", list(PACKED_KEY_CASES.values()), ids=list(PACKED_KEY_CASES))
def test_packed_key_case(workdirs: Iterator[Path], mutation: fz.Mutation) -> None:
    check("packed", next(workdirs), [mutation])


T5X_KEY_CASES = {
    "42.5: a chunk key '\u00b2' (a digit to str.isdigit, not to int)": M(
        "t5x.chunk_key", "checkpoint_200/checkpoint", pick=0, key="\u00b2", value=0, whole=0
    ),
    "42.5: a chunk key of 5,000 digits": M(
        "t5x.chunk_key", "checkpoint_200/checkpoint", pick=1, key="9" * 5000, value=0, whole=0
    ),
    "42.5: a msgpack file 100,000 lists deep": M(
        "t5x.whole", "checkpoint_200/checkpoint", pick=0, key="", value=0, whole=0
    ),
}


@pytest.mark.parametrize("mutation", list(T5X_KEY_CASES.values()), ids=list(T5X_KEY_CASES))
def test_t5x_key_case(workdirs: Iterator[Path], mutation: fz.Mutation) -> None:
    check("t5x", next(workdirs), [mutation])


LEASES = ["lease_infinity", "lease_nan", "lease_1e300", "lease_digits", "lease_deep", "lease_ahead"]


@pytest.mark.parametrize("content", LEASES)
def test_s3_lease_key_case(s3_bucket: str, workdirs: Iterator[Path], content: str) -> None:
    """42.5: a lease object of impossible numbers or 100,000-deep JSON: a damaged lease, taken
    over with a warning (or, one from a clock far ahead, DirectoryLockedError), never a raw
    OverflowError or RecursionError."""
    work = next(workdirs)
    try:
        report = fz.run_s3_case(
            TEMPLATES["cairn"].get(), work, [M("s3.key", fz.LOCK, content=content)], s3_bucket
        )
    finally:
        fz.remove_case(work)
    if report.failures:
        pytest.fail("\n  ".join(report.failures), pytrace=False)
