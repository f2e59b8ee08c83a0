"""Save figures, metadata encoding, the report command (pure logic, fabricated directories)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.cli import report
from lightning_mcore_ckpt.cli.entry import main as cli_main
from lightning_mcore_ckpt.format import layout, markers, metrics


@pytest.mark.parametrize("data_bytes", [0, 7, 9_000, 99_380, 999_400, 123_456_789_012])
def test_metadata_size_counts_its_own_bytes(data_bytes: int) -> None:
    meta = {"global_step": 3, "write_time_s": 0.25, "blocking_time_s": 0.1}
    text, filled = metrics.encode_metadata(meta, data_bytes)
    assert filled["size_bytes"] == data_bytes + len(text.encode("utf-8"))
    assert json.loads(text) == filled
    assert filled["throughput_gbps"] == pytest.approx(filled["size_bytes"] / 0.25 / 1e9, rel=1e-5)


def test_metadata_without_write_time_has_no_throughput() -> None:
    text, filled = metrics.encode_metadata({"global_step": 1, "write_time_s": None}, 10)
    assert filled["throughput_gbps"] is None
    assert filled["size_bytes"] == 10 + len(text)


def test_save_metrics_are_the_numeric_figures_under_checkpoint() -> None:
    meta = {
        "blocking_time_s": 0.5,
        "total_time_s": 2,
        "write_time_s": 1.5,
        "size_bytes": 100,
        "throughput_gbps": None,
        "hf_export_time_s": None,
        "async": True,
        "global_step": 4,
    }
    assert metrics.save_metrics(meta) == {
        "checkpoint/blocking_time_s": 0.5,
        "checkpoint/total_time_s": 2.0,
        "checkpoint/write_time_s": 1.5,
        "checkpoint/size_bytes": 100.0,
    }


def test_tree_bytes_counts_files_and_skips_excluded_top_level(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.distcp").write_bytes(b"x" * 100)
    (tmp_path / "model" / "deep").mkdir()
    (tmp_path / "model" / "deep" / "b").write_bytes(b"y" * 23)
    (tmp_path / "metadata.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "model" / "a.distcp")
    assert metrics.tree_bytes(tmp_path, exclude=["metadata.json"]) == 123
    assert metrics.tree_bytes(tmp_path) == 125


def _step(root: Path, step: int, **figures: Any) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    path = layout.step_dir(root, step)
    for sub in ("model", "optim"):  # small but real dist-checkpoints, so the steps verify
        dcp.save({"w": torch.zeros(256)}, checkpoint_id=str(path / sub), no_dist=True)
        config = '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
        (path / sub / "metadata.json").write_text(config)  # as Megatron-Core writes it
    meta = {
        "global_step": step,
        "saved_at": "2026-11-22T10:00:00+00:00",
        "contents": ["model", "optimizer"],
        "async": True,
        "parallel_layout": {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1,
            "context_parallel_size": 1,
            "expert_model_parallel_size": 1,
            "data_parallel_size": 4,
        },
        "blocking_time_s": 0.125,
        "total_time_s": 3.5,
        "write_time_s": 2.0,
    }
    meta.update(figures)
    text, _ = metrics.encode_metadata(meta, metrics.tree_bytes(path))
    (path / markers.METADATA_FILE).write_text(text)
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    # A directory resumed under a newer megatron-core: each step names what wrote it.
    _step(root, 10, versions={"megatron_core": "0.16.1", "torch": "2.13.0"}, writer="mcore")
    _step(
        root,
        20,
        blocking_time_s=0.5,
        versions={"megatron_core": "0.19.2", "torch": "2.13.0", "transformers": "5.23.0"},
        writer="nvrx",
        **{"async": False},
    )
    (layout.step_dir(root, 30) / "model").mkdir(parents=True)  # crashed mid-write
    garbled = layout.step_dir(root, 40)
    garbled.mkdir()
    (garbled / markers.METADATA_FILE).write_text("{ not json")
    layout.write_tracker(root, 20)
    return root


def test_report_lists_complete_steps_and_names_incomplete_ones(run_dir: Path) -> None:
    result = report.collect(run_dir)
    assert [m["global_step"] for m in result.complete] == [10, 20]
    assert [s.step for s in result.incomplete] == [30, 40]
    assert result.last == 20
    lines = report.format_table(result).splitlines()
    assert lines[0] == f"{run_dir}: 2 complete step(s)"
    assert lines[1].split()[:3] == ["step", "saved", "at"]
    rows = [line.split() for line in lines[3:5]]
    assert rows[0] == [
        "10",
        "2026-11-22",
        "10:00:00",
        "model,optimizer",
        *report.human_bytes(result.complete[0]["size_bytes"]).split(),
        "0.125",
        "3.500",
        f"{result.complete[0]['throughput_gbps']:.3g}",
        "async",
        "tp2",
        "pp1",
        "cp1",
        "ep1",
        "dp4",
    ]
    assert rows[1][0] == "20*" and rows[1][6] == "0.500" and rows[1][9] == "sync"
    assert lines[-3:] == [
        "step(s) 10 written by megatron-core 0.16.1, torch 2.13.0 (writer: mcore)",
        "step(s) 20 written by megatron-core 0.19.2, torch 2.13.0, transformers 5.23.0 "
        "(writer: nvrx)",
        "incomplete (never committed, not resumable): global_step_30, global_step_40",
    ]


def test_report_cli_prints_the_table_and_draws_the_plot(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "plot.png"
    assert cli_main(["report", str(run_dir), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "global_step_30" in out and f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_a_missing_directory_is_a_clear_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["report", str(missing)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "not a directory" in err


@pytest.mark.parametrize("command", ["report", "ls"])
def test_each_command_names_itself_for_a_missing_directory(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main([command, str(tmp_path / "nope")])
    assert exit_info.value.code == 2
    assert f"error: {command}: {str(tmp_path / 'nope')!r} is not a directory" in (
        capsys.readouterr().err
    )


def _hf_export(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize("command", ["report", "ls"])
@pytest.mark.parametrize(
    ("what", "hint"),
    [
        ("empty", "(the directory holding its global_step_<N> directories)"),
        ("a step", "this looks like one step: its run is the directory above it"),
        ("an export", "this looks like a Hugging Face model directory"),
    ],
)
def test_a_directory_holding_no_run_is_refused_with_a_hint(
    command: str,
    what: str,
    hint: str,
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = {
        "empty": lambda: tmp_path / "empty",
        "a step": lambda: layout.step_dir(run_dir, 20),
        "an export": lambda: _hf_export(tmp_path / "hf"),
    }[what]()
    path.mkdir(exist_ok=True)
    assert cli_main([command, str(path)]) == 2
    captured = capsys.readouterr()
    assert "complete step(s)" not in captured.out
    assert f"error: {command}: {path} holds no run: no global_step_<N> directory" in captured.err
    assert hint in captured.err
    if what == "a step":
        assert f"({run_dir})" in captured.err and "inspect STEP" in captured.err


@pytest.mark.parametrize(
    "only",
    ["an incomplete step", "the tracker", "the fast tier's record"],
)
def test_a_run_without_a_complete_step_is_still_a_run(
    only: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if only == "an incomplete step":
        (layout.step_dir(tmp_path, 5) / "model").mkdir(parents=True)
    elif only == "the tracker":
        layout.write_tracker(tmp_path, 5)
    else:
        (tmp_path / "fast_tier.jsonl").write_text('{"kind": "fast_save", "step": 3}\n')
    assert cli_main(["report", str(tmp_path)]) == 0
    assert f"{tmp_path}: 0 complete step(s)" in capsys.readouterr().out


def test_report_plot_into_a_missing_directory_fails_before_reading(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["report", str(run_dir), "--plot", str(tmp_path / "no" / "p.png")])
    assert exit_info.value.code == 2
    assert "--plot" in capsys.readouterr().err


def test_report_plot_with_nothing_complete_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (layout.step_dir(tmp_path, 5) / "model").mkdir(parents=True)
    assert cli_main(["report", str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 1
    captured = capsys.readouterr()
    assert "0 complete step(s)" in captured.out
    assert "global_step_5" in captured.out
    assert "no complete step" in captured.err
    assert not (tmp_path / "p.png").exists()


def test_report_runs_as_the_installed_command(run_dir: Path) -> None:
    exe = Path(sys.executable).with_name("lightning-mcore-ckpt")
    proc = subprocess.run(
        [str(exe), "report", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert "2 complete step(s)" in proc.stdout


def test_a_failed_background_commit_is_raised_on_the_training_thread(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.callback._commit import Committer
    from lightning_mcore_ckpt.callback._intent import Intent
    from lightning_mcore_ckpt.strategy import CheckpointSaveError, SaveRecord

    reported: list[tuple[Path, BaseException]] = []
    committer = Committer(
        tmp_path,
        is_global_zero=True,
        save_contents=("model",),
        hf_export=None,
        max_to_keep=None,
        keep=set,
        on_committed=lambda metadata: None,
        on_failed=lambda path, error: reported.append((path, error)),
    )
    # The commit of a step directory that is gone fails on the commit thread.
    target = layout.step_dir(tmp_path, 7)
    record = SaveRecord(
        path=target,
        contents=("model",),
        asynchronous=True,
        writer="mcore",
        parallel_layout={},
        blocking_time_s=0.1,
        write_time_s=0.2,
        total_time_s=0.3,
        finalized_at=time.perf_counter(),
    )
    committer._intents[target] = Intent(
        step=7, epoch=0, contents=("model",), monitor=None, export=False
    )
    committer.saved(record)
    committer.process(wait=True)
    ((path, error),) = reported
    assert path == target and isinstance(error, CheckpointSaveError)
    assert re.search(r"committing .*global_step_7 failed: .*No such file", str(error))
    assert not layout.is_complete(target) and layout.read_tracker(tmp_path) is None


def test_ls_lists_contents_and_exports(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf_copy = layout.step_dir(run_dir, 20) / "huggingface"
    hf_copy.mkdir()
    (hf_copy / "config.json").write_text("{}")
    assert cli_main(["ls", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run_dir}: 2 complete step(s)"
    size = report.human_bytes(
        json.loads((layout.step_dir(run_dir, 10) / "metadata.json").read_text())["size_bytes"]
    )
    assert lines[1].split() == ["global_step_10", *size.split(), "model,", "optimizer"]
    assert lines[2] == "      written by megatron-core 0.16.1, torch 2.13.0 (writer: mcore)"
    assert lines[3].split()[0] == "global_step_20"
    assert lines[3].endswith("model, optimizer, huggingface  (last)")
    assert lines[4].startswith("      written by megatron-core 0.19.2, torch 2.13.0")
    assert lines[5:] == [
        "  global_step_30  incomplete (never committed)",
        "  global_step_40  incomplete (never committed)",
    ]


def _fast_save(step: int, complete: bool = True, **figures: Any) -> dict[str, Any]:
    """A line of ``fast_tier.jsonl`` as ``callback/fast_tier.py`` writes it."""
    return {
        "kind": "fast_save",
        "step": step,
        "complete": complete,
        "fast_blocking_time_s": 0.01 * step,
        "fast_total_time_s": 0.1 * step,
        "fast_write_time_s": 0.05 * step,
        "fast_replication_time_s": 0.02 * step,
        "fast_size_bytes": 3 * 1024 * 1024,
        "copied_bytes": 3 * 1024 * 1024,
        "errors": [] if complete else ["rank 3 (node1): keeping rank 1's copy: disk full", "2nd"],
        **figures,
    }


def _recovery(tier: str, step: int | None, from_peers: int, skipped: list[str]) -> dict[str, Any]:
    return {
        "kind": "recovery",
        "tier": tier,
        "step": step,
        "ranks": 4 if tier == "fast" else 0,
        "ranks_from_peers": from_peers,
        "skipped": skipped,
        "time_s": 1.25,
        "persistent_step": 10,
    }


def _write_records(run: Path, lines: list[Any]) -> None:
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    (run / "fast_tier.jsonl").write_text(text)


def test_report_lists_the_fast_tiers_saves_and_recoveries(run_dir: Path) -> None:
    _write_records(
        run_dir,
        [
            _fast_save(20),
            _fast_save(40, complete=False),
            _fast_save(60),
            _fast_save(80),
            _recovery("fast", 60, 2, ["fast step 80: no whole copy of rank(s) [1]"]),
            _recovery("persistent", None, 0, ["fast step 60: no node holds rank(s) [0, 1]"]),
        ],
    )
    result = report.collect(run_dir)
    assert result.fast is not None
    assert [s["step"] for s in result.fast.saves] == [20, 40, 60, 80]
    assert [r["tier"] for r in result.fast.recoveries] == ["fast", "persistent"]
    assert result.fast.malformed == []
    lines = report.format_table(result).splitlines()
    # After the persistent steps' table and its incomplete steps: the fast tier, per tier.
    start = lines.index("") + 1
    assert lines[start - 2].startswith("incomplete (never committed")
    section = lines[start:]
    # Medians of the complete saves only (20, 60, 80): blocking 0.6, total 6.0, copies 1.2.
    assert section[0] == (
        "fast tier (fast_tier.jsonl): 4 fast save(s), 1 failed; median of the complete ones: "
        "blocking 0.600 s, total 6.000 s, replication 1.200 s"
    )
    assert section[1].split() == [
        "step",
        "blocking",
        "s",
        "total",
        "s",
        "write",
        "s",
        "replication",
        "s",
        "size",
        "outcome",
    ]
    rows = section[3:7]
    assert rows[0].split() == ["20", "0.200", "2.000", "1.000", "0.400", "3.0", "MiB", "complete"]
    assert rows[1].split()[:7] == ["40", "0.400", "4.000", "2.000", "0.800", "3.0", "MiB"]
    assert rows[1].endswith("FAILED: rank 3 (node1): keeping rank 1's copy: disk full")  # first
    assert [r.split()[0] for r in rows[2:]] == ["60", "80"]
    assert section[7] == '2 recovery(ies) with ckpt_path="last"'
    assert section[8].split() == ["tier", "step", "ranks", "from", "peers", "time", "s", "skipped"]
    assert section[10].split()[:6] == ["fast", "60", "2", "of", "4", "1.250"]
    assert section[10].endswith("fast step 80: no whole copy of rank(s) [1]")
    # A resume from the persistent tier names the persistent step it read.
    assert section[11].split()[:4] == ["persistent", "10", "-", "1.250"]
    assert section[11].endswith("fast step 60: no node holds rank(s) [0, 1]")
    assert len(section) == 12


@pytest.mark.parametrize(
    "bad",
    [
        '{"kind": "fast_save", "step": 6',  # torn by a crash mid-append
        "not json at all",
        "[1, 2, 3]",  # JSON, not a record
        '{"kind": "upload", "step": 6}',  # a kind the report does not know
        '{"kind": "fast_save", "step": "six"}',  # no step number
        '{"kind": "fast_save"}',
    ],
)
def test_a_malformed_fast_tier_line_is_skipped_and_named(
    run_dir: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_records(run_dir, [_fast_save(20), bad, "", _recovery("fast", 20, 0, [])])
    result = report.collect(run_dir)
    assert result.fast is not None
    assert [s["step"] for s in result.fast.saves] == [20]
    assert len(result.fast.recoveries) == 1
    assert result.fast.malformed == [2]  # the blank line 3 is no record, and no mistake
    assert cli_main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "skipped 1 malformed line(s) of fast_tier.jsonl: 2"
    assert "1 fast save(s), 0 failed" in "\n".join(out)
    assert out[-2].split()[:6] == ["fast", "20", "0", "of", "4", "1.250"]


def test_a_report_without_fast_tier_records_has_no_fast_tier_section(run_dir: Path) -> None:
    result = report.collect(run_dir)
    assert result.fast is None
    assert "fast tier" not in report.format_table(result)
    # An empty record (a run that configured the tier and never saved in it) says so.
    _write_records(run_dir, [])
    section = report.format_table(report.collect(run_dir)).split("\n\n", 1)[1].splitlines()
    assert section == [
        "fast tier (fast_tier.jsonl): 0 fast save(s), 0 failed; median of the complete ones: "
        "blocking - s, total - s, replication - s",
        '0 recovery(ies) with ckpt_path="last"',
    ]


def test_the_report_reads_the_records_the_fast_tier_writes(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lines come from the callback's own code (``FastTierRun``, ``FastSave``,
    ``Recovery``): the report and the writer cannot drift apart."""
    from types import SimpleNamespace

    from lightning_mcore_ckpt.callback.fast_records import FastRecords
    from lightning_mcore_ckpt.callback.fast_tier import RECORDS, FastTierRun
    from lightning_mcore_ckpt.fast import FastTier
    from lightning_mcore_ckpt.fast.recovery import Recovery
    from lightning_mcore_ckpt.fast.writer import FastSave

    assert RECORDS == report.FAST_TIER_RECORDS
    trainer = SimpleNamespace(is_global_zero=True, loggers=[])
    run = FastTierRun(
        trainer,  # type: ignore[arg-type]
        FastTier(run_dir.parent / "fast"),
        writer=None,  # type: ignore[arg-type]
        persistent_last=lambda: 10,
        records=FastRecords(run_dir),
        persistent=str(run_dir),
    )
    run._report(FastSave(20, True, 0.25, 2.0, 1.5, 0.25, 4096, 4096))
    run._report(FastSave(40, False, 0.5, 3.0, 2.0, 0.5, 4096, 0, ("rank 1 (n1): no room",)))
    found = Recovery(20, run_dir.parent / "fast" / "fast_step_20", {0: 0, 1: 0}, ["why 40"])
    found.time_s = 0.75
    run._records.append({"kind": "recovery", **found.record(), "persistent_step": 10})
    result = report.collect(run_dir)
    assert result.fast is not None and result.fast.malformed == []
    section = report.format_table(result).split("\n\n", 1)[1].splitlines()
    assert section[0].startswith("fast tier (fast_tier.jsonl): 2 fast save(s), 1 failed;")
    assert "blocking 0.250 s, total 2.000 s, replication 0.250 s" in section[0]
    assert section[3].split() == [
        "20",
        "0.250",
        "2.000",
        "1.500",
        "0.250",
        "4.0",
        "KiB",
        "complete",
    ]
    assert section[4].endswith("FAILED: rank 1 (n1): no room")
    assert section[-1].split() == ["fast", "20", "1", "of", "2", "0.750", "why", "40"]
