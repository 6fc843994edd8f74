"""The classification of Orbax's ``checkpoint_manager_test.py`` cases, as data.

From docs/design/orbax-drop-in-research.md section 3.3 (orbax-checkpoint 0.12.8, google/orbax
``main`` 3ff7b24a): P = public behaviour only; P* = public plus a private attribute a drop-in can
cheaply mirror; L = the legacy ``checkpointers=`` API with Orbax ``Checkpointer`` objects;
I = internal (patches Orbax privates, reads Orbax's internal files, Orbax-only handlers,
telemetry or log formats). Kept as data so that the runner can count per class and check that
the collected cases are the 163 the research classified.
"""

from __future__ import annotations

import re

P, P_STAR, LEGACY, INTERNAL = "P", "P*", "L", "I"
CLASSES: tuple[str, ...] = (P, P_STAR, LEGACY, INTERNAL)
PUBLIC: tuple[str, ...] = (P, P_STAR)
UNKNOWN = "?"

# Cases per class over the whole file (section 3.4), checked against a full collection.
EXPECTED_COUNTS: dict[str, int] = {P: 104, P_STAR: 13, LEGACY: 8, INTERNAL: 38}

# test method -> (number of parameterized cases, class).
METHODS: dict[str, tuple[int, str]] = {
    "test_save_restore": (3, P),  # the async case (index 2) is I: see CASE_OVERRIDES
    "test_save_restore_with_concurrent_wait_until_finished": (2, P),
    "test_file_format": (4, P),
    "test_save_restore_no_kwargs": (1, P),
    "test_save_restore_invalid_item": (1, P),
    "test_new_and_legacy_api_confusion": (1, P),
    "test_legacy_api_timeout": (1, INTERNAL),
    "test_incorrect_single_usage": (1, P),
    "test_incorrect_composite_usage": (1, P),
    "test_all_steps": (3, P),
    "test_all_steps_reload": (1, P),
    "test_lightweight_intialize_loads_without_metadata_read": (1, P_STAR),
    "test_latest_step": (2, P),
    "test_latest_step_restore": (1, P),
    "test_no_overwrite_existing": (1, P),
    "test_removes_old_saves": (8, P),
    "test_max_to_keep_zero": (2, P),
    "test_max_to_keep_zero_other_conditions": (2, P),
    "test_removes_old_saves_keep_period": (4, P),
    "test_removes_old_saves_time_interval": (2, P_STAR),
    "test_removes_old_saves_time_interval_metrics": (2, P),
    "test_save_interval": (1, P),
    "test_save_on_steps": (1, P),
    "test_save_same_step": (2, P),
    "test_save_interval_force": (1, P),
    "test_save_preempted": (3, P),
    "test_save_preempted_mock": (8, INTERNAL),
    "test_save_restore_gcs": (2, INTERNAL),
    "test_save_preempted_gcs": (2, INTERNAL),
    "test_save_default_item": (2, P_STAR),
    "test_multiple_items": (1, P),
    "test_save_gcs_with_unfinalized_checkpoints": (1, INTERNAL),
    "test_save_best": (8, P),
    "test_save_best_delete_no_metrics": (2, P),
    "test_save_best_some_metrics": (2, P),
    "test_flax_train_state": (1, P),
    "test_restore_independent": (1, P),
    "test_save_on_preemption": (1, P),
    "test_init_telemetry_continuous_checkpointing": (2, INTERNAL),
    "test_metadata": (1, P_STAR),
    "test_empty_metadata": (1, P_STAR),
    "test_checkpoint_args_mismatch_item_handlers": (1, P),
    "test_item_names_with_single_item_handler": (1, P),
    "test_default_item_metadata_with_new_checkpoint_manager": (1, INTERNAL),
    "test_directory_creation": (1, P),
    "test_delete": (1, P),
    "test_delete_with_todelete_subdir": (1, P),
    "test_async_finalize": (1, P),
    "test_async_is_save_in_progress": (1, P),
    "test_sync_is_save_in_progress": (1, P),
    "test_should_save_with_option_should_save_fn_empty_root_dir": (1, P),
    "test_should_save_without_option_should_save_fn_empty_root_dir": (1, P),
    "test_should_save_returns_false_when_read_only": (1, P),
    "test_save_returns_false_when_read_only": (1, P),
    "test_restore_works_normally_when_read_only": (1, P),
    "test_delete_skipped_when_read_only": (1, P),
    "test_metadata_save_skipped_when_always_read_only": (2, P_STAR),
    "test_metadata_save_skipped_with_write_and_read_only": (2, P_STAR),
    "test_custom_metadata_with_metadata_store": (1, INTERNAL),
    "test_custom_metadata_with_legacy_metadata_file": (1, INTERNAL),
    "test_async_error_subsequent_save": (2, INTERNAL),
    "test_async_error_wait_until_finished": (2, INTERNAL),
    "test_async_error_multiple_steps": (2, INTERNAL),
    "test_legacy_handler_default_item": (1, LEGACY),
    "test_legacy_handler_multiple_items": (1, LEGACY),
    "test_save_restore_legacy_init": (2, LEGACY),
    "test_save_restore_default_item_legacy_init": (2, LEGACY),
    "test_multiple_items_legacy_init": (2, LEGACY),
    "test_save_restore_local_fs": (2, P),
    "test_save_and_restore_composite_logger": (1, INTERNAL),
    "test_save_and_restore_standard_logger": (1, INTERNAL),
    "test_configure_atomicity": (1, INTERNAL),
    "test_multi_item_mode_with_handler_registry": (1, P),
    "test_default_init_default_item": (2, P_STAR),
    "test_default_init_multi_item": (2, P),
    "test_default_init_multi_item_dynamic_items": (1, P),
    "test_save_root_metadata": (1, INTERNAL),
    "test_save_root_metadata_disabled": (1, INTERNAL),
    "test_save_step_metadata": (1, INTERNAL),
    "test_metadata_save_preemption": (2, INTERNAL),
    "test_metadata_finalize_preemption": (2, INTERNAL),
    "test_item_metadata_access_with_no_handlers": (2, P),
    "test_restore_with_no_handlers": (2, P),
    "test_item_metadata_access_no_handlers_and_default_item": (2, P),
    "test_root_metadata_save": (1, P),
    "test_read_only_manager_does_not_save_root_metadata": (1, P),
    "test_root_metadata_does_not_overwrite": (1, P),
    "test_save_decision_policy": (2, P),
    "test_sync_continuous_checkpointing": (1, P),
    "test_async_continuous_checkpointing": (1, INTERNAL),
    "test_slow_save_logs_warning": (1, INTERNAL),
    "test_preservation_joint_policy": (1, P),
    "test_sync_continuous_checkpointing_with_minimum_interval_secs": (1, P),
    "test_initial_save": (2, P),
    "test_single_host_load_and_broadcast": (1, P),  # its broadcast_impl subtest is I
    "test_partial_restore_with_placeholder": (1, P),
    "test_partial_restore_with_omission": (1, P),
    "test_save_with_global_mesh": (2, P),
}

# Cases whose class differs from their method's: (method, case index) -> class.
# test_save_restore's parameters are (False, 8), (False, None), (True, None); the async one
# asserts manager._checkpointer is an AsyncCheckpointer with a 500 s timeout.
CASE_OVERRIDES: dict[tuple[str, int], str] = {("test_save_restore", 2): INTERNAL}

# Subtests whose class differs from their case's: (method, subtest message) -> class.
SUBTEST_OVERRIDES: dict[tuple[str, str], str] = {
    ("test_single_host_load_and_broadcast", "broadcast_impl"): INTERNAL,
}

# Failures Orbax itself has in this harness (one process), excluded when comparing.
KNOWN_SINGLE_PROCESS_FAILURES: dict[tuple[str, str], str] = {
    ("test_single_host_load_and_broadcast", "broadcast_impl"): (
        "expects two multihost.broadcast_one_to_all calls, which happen only with >1 process"
    ),
}

_INDEXED = re.compile(r"^(?P<method>test_\w+?)(?P<index>\d+)$")


def split_case(name: str) -> tuple[str, int | None]:
    """A case name -> its method and parameter index (None for a single or named case).

    absl's ``parameterized.parameters`` appends the index (``test_save_restore2``),
    ``named_parameters`` appends ``_<name>`` (``test_save_best_min_sync_delete``): the longest
    method that prefixes the name wins. No method of this file ends in a digit.
    """
    if name in METHODS:
        return name, None
    match = _INDEXED.match(name)
    if match is not None and match["method"] in METHODS:
        return match["method"], int(match["index"])
    named = [m for m in METHODS if name.startswith(m + "_")]
    if named:
        return max(named, key=len), None
    return name, None


def classify(name: str, subtest: str | None = None) -> str:
    """The class of a case name (``test_save_best3``), or of one of its subtests."""
    method, index = split_case(name)
    if method not in METHODS:
        return UNKNOWN
    if subtest is not None and (method, subtest) in SUBTEST_OVERRIDES:
        return SUBTEST_OVERRIDES[(method, subtest)]
    if index is not None and (method, index) in CASE_OVERRIDES:
        return CASE_OVERRIDES[(method, index)]
    return METHODS[method][1]


def expected_cases() -> int:
    """How many cases the classified file expands to (163)."""
    return sum(n for n, _ in METHODS.values())
