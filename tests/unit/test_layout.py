"""The directory layout: completeness, tracker, "last" resolution, retention, removal."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lightning_mcore_ckpt.format import layout, markers, retention
from lightning_mcore_ckpt.storage import atomic as _atomic


def _step(root: Path, step: int, complete: bool = True, monitor: float | None = None) -> Path:
    d = layout.step_dir(root, step)
    (d / "model").mkdir(parents=True)
    if complete:
        # Lists no contents: these tests are about naming and ordering, not verification.
        meta = {"format_version": 1, "global_step": step, "contents": [], "monitor": None}
        if monitor is not None:
            meta["monitor"] = {"name": "val_loss", "value": monitor}
        _atomic.write_json(d / markers.METADATA_FILE, meta)
    return d


def test_complete_means_a_readable_metadata_json(tmp_path: Path) -> None:
    done = _step(tmp_path, 2)
    half = _step(tmp_path, 4, complete=False)
    garbled = _step(tmp_path, 6, complete=False)
    (garbled / markers.METADATA_FILE).write_text("{not json")
    (tmp_path / "global_step_x").mkdir()  # not ours
    (tmp_path / "notes").mkdir()
    assert layout.is_complete(done) and not layout.is_complete(half)
    assert [s.step for s in layout.complete_steps(tmp_path)] == [2]
    assert [s.step for s in layout.incomplete_steps(tmp_path)] == [4, 6]


def test_atomic_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    _atomic.write_json(tmp_path / "m.json", {"a": 1})
    layout.write_tracker(tmp_path, 12)
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1}
    assert layout.read_tracker(tmp_path) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest_checkpointed_iteration.txt",
        "m.json",
    ]


def test_leftovers_are_a_files_unrenamed_temporaries_only(tmp_path: Path) -> None:
    tracker = tmp_path / layout.TRACKER_FILE

    def killed(f: object) -> None:
        raise KeyboardInterrupt  # an error removes the temporary: the kill is simulated below

    with pytest.raises(KeyboardInterrupt):
        _atomic.write_with(tracker, killed)
    assert _atomic.leftovers(tracker) == []
    left = tmp_path / f".{layout.TRACKER_FILE}.tmp.4242.0badcafe"  # as a killed writer leaves
    left.write_text("4\n")
    (tmp_path / ".m.json.tmp.4242.0badcafe").write_text("{}")  # another file's
    (tmp_path / f"{layout.TRACKER_FILE}.tmp.1.2").write_text("")  # not write_with's name
    assert _atomic.leftovers(tracker) == [left]
    assert _atomic.leftovers(tmp_path / "missing" / layout.TRACKER_FILE) == []


def test_last_follows_the_tracker(tmp_path: Path) -> None:
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    layout.write_tracker(tmp_path, 4)
    assert layout.resolve_last(tmp_path) == layout.step_dir(tmp_path, 4)


def test_last_without_tracker_scans(tmp_path: Path) -> None:
    _step(tmp_path, 2)
    _step(tmp_path, 10)
    _step(tmp_path, 12, complete=False)
    assert layout.resolve_last(tmp_path) == layout.step_dir(tmp_path, 10)


@pytest.mark.parametrize(
    ("tracker", "why"),
    [
        ("12\n", "incomplete or missing"),
        ("garbage", "unreadable"),
        ("30\n", "incomplete or missing"),
    ],
)
def test_last_with_a_bad_tracker_scans_and_says_why(
    tmp_path: Path, tracker: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    _step(tmp_path, 10)
    _step(tmp_path, 12, complete=False)
    (tmp_path / layout.TRACKER_FILE).write_text(tracker)
    with caplog.at_level(logging.WARNING):
        assert layout.resolve_last(tmp_path) == layout.step_dir(tmp_path, 10)
    assert why in caplog.text and "global_step_10" in caplog.text


def test_last_of_an_empty_or_missing_dirpath_is_none(tmp_path: Path) -> None:
    assert layout.resolve_last(tmp_path) is None
    assert layout.resolve_last(tmp_path / "nope") is None


def test_resolve_checkpoint_accepts_a_dirpath_or_a_step(tmp_path: Path) -> None:
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    assert layout.resolve_checkpoint(tmp_path) == layout.step_dir(tmp_path, 4)
    assert layout.resolve_checkpoint(layout.step_dir(tmp_path, 2)) == layout.step_dir(tmp_path, 2)


def test_resolve_checkpoint_refuses_an_incomplete_step_and_lists_the_complete_ones(
    tmp_path: Path,
) -> None:
    _step(tmp_path, 2)
    half = _step(tmp_path, 4, complete=False)
    with pytest.raises(FileNotFoundError, match=r"global_step_4 is incomplete.*global_step_2"):
        layout.resolve_checkpoint(half)


def test_resolve_checkpoint_of_a_dirpath_without_complete_steps_fails(tmp_path: Path) -> None:
    _step(tmp_path, 4, complete=False)
    with pytest.raises(
        FileNotFoundError, match=r"no complete checkpoint.*incomplete, ignored: global_step_4"
    ):
        layout.resolve_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        layout.resolve_checkpoint(tmp_path / "missing")


def _steps(root: Path, values: dict[int, float | None]) -> list[layout.StepDir]:
    for step, value in values.items():
        _step(root, step, monitor=value)
    return layout.complete_steps(root)


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    steps = _steps(tmp_path, dict.fromkeys([1, 2, 3, 4, 5]))
    doomed = retention.retention_plan(steps, max_to_keep=2)
    assert [s.step for s in doomed] == [1, 2, 3]
    assert retention.retention_plan(steps, max_to_keep=None) == []


def test_retention_keeps_what_lightnings_bookkeeping_names_on_top_of_the_newest(
    tmp_path: Path,
) -> None:
    steps = _steps(tmp_path, dict.fromkeys([1, 2, 3, 4, 5]))
    best = [layout.step_dir(tmp_path, 2), layout.step_dir(tmp_path, 1)]
    doomed = retention.retention_plan(steps, max_to_keep=1, keep=best)
    assert [s.step for s in doomed] == [3, 4]  # keeps 5 (newest), 2 and 1 (named)


def test_retention_deletes_what_lightning_let_go_unless_still_kept(tmp_path: Path) -> None:
    steps = _steps(tmp_path, dict.fromkeys([1, 2, 3, 4, 5]))
    asked = [layout.step_dir(tmp_path, n) for n in (1, 2, 4, 5)]
    named = [layout.step_dir(tmp_path, 2)]
    # No limit of its own: only what was let go, minus what is named, the newest two or
    # protected.
    doomed = retention.retention_plan(steps, max_to_keep=None, remove=asked, keep=named)
    assert [s.step for s in doomed] == [1, 4, 5]
    doomed = retention.retention_plan(steps, max_to_keep=2, remove=asked, keep=named, protect={1})
    assert [s.step for s in doomed] == [3]


def test_retention_never_deletes_protected_steps(tmp_path: Path) -> None:
    steps = _steps(tmp_path, dict.fromkeys([1, 2, 3]))
    assert [s.step for s in retention.retention_plan(steps, max_to_keep=1, protect={1})] == [2]


def test_remove_step_drops_the_marker_first_and_refuses_other_directories(tmp_path: Path) -> None:
    d = _step(tmp_path, 3)
    retention.remove_step(d)
    assert not d.exists()
    other = tmp_path / "data"
    other.mkdir()
    with pytest.raises(ValueError, match="not a global_step_<N> directory"):
        retention.remove_step(other)
    assert other.exists()


def test_a_step_in_a_newer_format_is_refused_naming_both_versions(tmp_path: Path) -> None:
    d = _step(tmp_path, 3)
    meta = markers.read_metadata(d)
    assert meta is not None
    layout.check_format(d)  # this format: accepted
    _atomic.write_json(d / markers.METADATA_FILE, {**meta, "format_version": 99})
    reads = f"format 99; this lightning-mcore-ckpt reads format {layout.METADATA_FORMAT_VERSION}"
    with pytest.raises(ValueError, match=reads):
        layout.check_format(d)
