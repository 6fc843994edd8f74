"""Untrusted names in a directory (StepStore): only canonical step names are steps, names in a
manifest are checked, a claim at a manifest key is no step, keys with dot segments (object stores)
stay inside; nothing outside the directory is read, written or removed. On every backend
(tests/contracts/storage.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cairn.manager import CorruptCheckpointError
from cairn.manager._format import MANIFEST
from contracts.storage import (
    CLAIM,
    NAMES,
    GcsBackend,
    KvRaw,
    MemoryBackend,
    Place,
    PosixBackend,
    S3Backend,
    StorageContract,
    beside,
    check_restored,
    crafted_manifest,
    items,
    json_item,
    minimal_manifest,
    stored_keys,
)


class NamesContract(StorageContract):
    """Names read from the store are untrusted."""

    # ------------------------------------------------------------------ untrusted names

    def test_only_canonical_step_names_are_steps(self, place: Place) -> None:
        """Names that are not the canonical spelling of a step are no steps: never listed,
        read or removed, by a reader or a writer."""
        with place.writer() as mgr:
            mgr.save(1, items(1))
        strays = {
            f"{name}/{MANIFEST}": minimal_manifest(step)
            for name, step in [
                ("checkpoint_01", 1),
                ("checkpoint_-1", 1),
                ("checkpoint_5x", 5),
                ("checkpoint_+6", 6),
                ("checkpoint_\u0667", 7),  # ARABIC-INDIC DIGIT SEVEN
                ("Checkpoint_8", 8),
                ("checkpoint_9.tmp", 9),
                ("checkpoint 10", 10),
            ]
        }
        strays["checkpoint_11/../x"] = b"not a step"  # a key, on stores with keys
        strays = {k: v for k, v in strays.items() if self.can_store(k)}
        for key, data in strays.items():
            place.raw.plant(key, data)
        before = place.raw.dump()
        with place.reader() as reader:
            assert reader.all_steps() == [1]
            assert [listed.step for listed in place.storage().scan(NAMES)] == [1]
        with place.writer() as mgr:
            assert mgr.all_steps() == [1]
            mgr.save(2, items(2))
            mgr.delete(1)
            mgr.wait_until_finished()
            assert mgr.all_steps() == [2]
            kept = stored_keys(mgr, lock=self.lock_stays)
        assert place.raw.all_keys() == sorted({*kept, *strays})
        after = place.raw.dump()
        assert {k: after.get(k) for k in strays} == {k: before[k] for k in strays}

    def test_names_in_a_manifest_are_checked(self, place: Place) -> None:
        """Manifests naming an item ``..`` or ``a/b``, a file ``../../../x``, or another step
        than their own: each such step is damaged (a clear CorruptCheckpointError from restore
        and verify) and nothing outside the directory is read, written or deleted, by a reader,
        by a writer's start, or by deleting the damaged steps."""
        place.outside.write("x", b"sentinel")
        place.outside.write("data.json", b"{}")
        with place.writer() as mgr:
            mgr.save(1, items(1))
        crafted = {
            2: (crafted_manifest(2, {"..": json_item()}), "bad item name '..'"),
            3: (crafted_manifest(3, {"a/b": json_item()}), "bad item name 'a/b'"),
            4: (crafted_manifest(4, {"cfg": json_item("../../../x")}), "must be relative"),
            5: (crafted_manifest(5, {"cfg": json_item("../data.json")}), "must be relative"),
            6: (crafted_manifest(7, {"cfg": json_item()}), "says step 7"),
        }
        place.raw.write_many({f"checkpoint_{s}/{MANIFEST}": m for s, (m, _) in crafted.items()})
        place.raw.write_many({f"checkpoint_{s}/cfg/data.json": b"{}" for s in crafted})
        outside = place.outside.dump()
        with self.watch(place) as touched:
            with place.reader() as reader:
                assert reader.all_steps() == [1, *crafted]
                for step, (_, message) in crafted.items():
                    with pytest.raises(CorruptCheckpointError, match=message):
                        reader.restore(step, fallback=False)
                    problems = reader.verify(step)
                    assert len(problems) == 1 and message in problems[0], problems
                check_restored(reader.restore(), 1, live=["state", "extra"])  # falls back
            with place.writer() as mgr:
                assert mgr.all_steps() == [1, *crafted]
                for step in crafted:
                    mgr.delete(step)
                mgr.wait_until_finished()
                assert mgr.all_steps() == [1]
                kept = stored_keys(mgr, lock=self.lock_stays)
        assert place.raw.all_keys() == kept
        assert touched == []
        assert beside(place.outside.dump()) == beside(outside)

    def test_a_claim_at_a_manifest_key(self, place: Place) -> None:
        """What a save that died leaves at the manifest's key (object stores: its claim) is
        no step: a reader ignores it, or lists the step as damaged; the writer removes it
        where it is cairn's own leftover."""
        with place.writer() as mgr:
            mgr.save(1, items(1))
        place.raw.write_many({f"checkpoint_9/{MANIFEST}": CLAIM, "checkpoint_9/state/x": b"x"})
        with place.reader() as reader:
            if self.claims_at_prepare:  # a claim: ignored
                assert reader.all_steps() == [1]
            else:  # a manifest that does not parse: a damaged step
                assert reader.all_steps() == [1, 9]
                with pytest.raises(CorruptCheckpointError, match="crc32c"):
                    reader.restore(9, fallback=False)
            check_restored(reader.restore(), 1, live=["state", "extra"])
        with place.writer() as mgr:
            if self.claims_at_prepare:
                assert mgr.all_steps() == [1]
                assert place.raw.all_keys() == stored_keys(mgr, lock=True)
            else:
                assert mgr.all_steps() == [1, 9]
                assert place.raw.read(f"checkpoint_9/{MANIFEST}") == CLAIM  # not cairn's
                mgr.delete(9)
                mgr.wait_until_finished()
                kept = stored_keys(mgr, lock=self.lock_stays)
        if not self.claims_at_prepare:
            assert place.raw.all_keys() == kept


class ObjectStoreNamesContract(NamesContract):
    """Backends over TensorStore's kvstore: keys may hold any characters, dot segments too."""

    def test_keys_with_dot_segments_stay_inside(self, places: Callable[[str], Place]) -> None:
        """Keys under step prefixes whose dot segments lead outside the directory (left by a
        tool that writes keys verbatim): a reader, a writer's start (which removes a dead
        save's claimed prefix) and a deletion never read or remove what lies beside."""
        place, neighbour = places("ckpt"), places("ckpt2")
        assert isinstance(place.raw, KvRaw)
        with neighbour.writer() as mgr:
            mgr.save(1, items(1))
        place.outside.write_many(
            {"sentinel": b"S", "ckpt0": b"after ckpt/", "ckpt.x": b"before ckpt/", "x": b"X"}
        )
        with place.writer() as mgr:
            mgr.save(1, items(1))
            mgr.save(4, items(4))
        planted = {
            "checkpoint_5/../x": b"inside",
            "checkpoint_5/../../sentinel": b"beside",
            "checkpoint_5/.claim": b"deleting",  # a deletion that died: cairn's to remove
            f"checkpoint_6/{MANIFEST}": CLAIM,  # a save that died: cairn's to remove
            "checkpoint_6/../../ckpt2/checkpoint_1/_CHECKPOINT.json": b"beside",
            "checkpoint_4/../../x": b"beside",  # inside a committed step
        }
        for key, data in planted.items():
            place.raw.plant(key, data)
        outside = place.outside.dump()
        neighbour_keys = neighbour.raw.dump()
        with place.reader() as reader:
            assert reader.all_steps() == [1, 4]
            check_restored(reader.restore(4), 4, live=["state", "extra"])
        with place.writer() as mgr:
            assert mgr.all_steps() == [1, 4]
            mgr.delete(4)
            mgr.save(7, items(7))
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 7]
        after, before = beside(place.outside.dump()), beside(outside)
        assert sorted(set(before) - set(after)) == [], "objects beside the directory were deleted"
        assert after == before
        assert neighbour.raw.dump() == neighbour_keys
        with neighbour.reader() as reader:
            check_restored(reader.restore(1), 1, live=["state", "extra"])


class TestPosix(PosixBackend, NamesContract):
    """NamesContract on Posix."""


class TestMemory(MemoryBackend, ObjectStoreNamesContract):
    """NamesContract on Memory."""


class TestS3(S3Backend, ObjectStoreNamesContract):
    """NamesContract on S3."""


class TestGcs(GcsBackend, ObjectStoreNamesContract):
    """NamesContract on Gcs."""
