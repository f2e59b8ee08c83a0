"""The benchmark times every method on the state where the run trained it, and says so.

Lightning's teardown moves the module and the optimizer state to the CPU when ``fit`` returns: a
method timed after ``fit`` on a GPU run would time host tensors against our GPU rows. Every
figure of ``benchmarks.workloads.save_load`` records the device of the state it timed and
whether ``fit`` was running; here (gloo, a tiny state, the CPU) every one must name the device
the run trained on and have been taken inside ``fit``. The restart rows resume for real.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]

METHODS = (
    "ours-sync",
    "ours-async",
    "ours-async (megatron writer)",
    "raw dist_checkpointing",
    "torch.save (Lightning default)",
    "torch.distributed.checkpoint",
    "torch DCP async",
)
SIDE_BY_SIDE = ("ours", "ours, files not hashed", "plain DCP", "raw dist_checkpointing")


def _save_load(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from benchmarks import workloads

    figures: dict[str, Any] = workloads.save_load(rank, world, cfg)
    return figures


def _in_fit_then_after(rank: int, world: int, tmp: str) -> dict[str, bool]:
    sys.path.insert(0, str(ROOT))
    import lightning.pytorch as pl

    from benchmarks import workloads

    seen: dict[str, bool] = {}

    class Watch(pl.Callback):  # type: ignore[misc]
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            seen["on_train_end"] = workloads.in_fit(trainer)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            seen["callback teardown"] = workloads.in_fit(trainer)

    trainer = workloads._trainer(1, 1, 1, [Watch()], False)
    trainer.fit(workloads._module("quick"), train_dataloaders=workloads._loader())
    return {**seen, "fit returned": workloads.in_fit(trainer)}


# verify: the integrity figures (a load re-hashing every file, the re-hash, the unhashed round),
# which the GPU run leaves to the CPU run.
@pytest.mark.parametrize(("world", "verify"), [(1, True), (2, False)])
def test_every_method_is_timed_inside_fit_on_the_device_the_run_trained_on(
    tmp_path: Path, world: int, verify: bool
) -> None:
    progress = tmp_path / "progress.json"
    cfg = {
        "size": "quick",
        "repeats": 1,
        "saves": 2,
        "every": 2,  # the first save after the first optimizer step: it is planned ahead
        "dir": str(tmp_path / "scratch"),
        "device": "cpu",
        "verify": verify,
        "progress": str(progress),
    }
    figures = run_distributed(_save_load, world, cfg, timeout=800)[0]
    trained = "cpu"  # the strategy's root device on these ranks
    for name in METHODS:
        m = figures[name]
        assert "error" not in m, f"{name}: {m.get('error')}"
        assert m["device"] == trained, (name, m["device"])
        assert m["in_fit"] is True, name
        assert m["save_s"]["median"] > 0 and m["bytes"] > 0, name
    rounds = SIDE_BY_SIDE if verify else tuple(n for n in SIDE_BY_SIDE if "hashed" not in n)
    assert set(figures["side by side"]) == set(rounds)
    for name in rounds:
        side = figures["side by side"][name]
        assert (side["device"], side["in_fit"]) == (trained, True), name
    sync = figures["ours-sync"]
    assert (sync["load_device"], sync["load_in_fit"]) == (trained, True)
    assert sync["load_s"]["median"] > 0 and sync["trained_state_bytes"] > 0
    assert ("verified_load_s" in sync) is verify and ("rehash_s" in sync) is verify
    for name in ("raw dist_checkpointing", "torch.save (Lightning default)"):
        assert figures[name]["load_device"] == trained, name
    # What the GPU run's targets are judged with: measured on every device.
    asy = figures["ours-async"]
    assert asy["state_bytes"] > 0 and asy["peak_rss_extra"] >= 0
    # Host memory counts the staging of the saves, allocated when the first was planned ahead:
    # the probe starts there. (Its figure is resident memory: on CPU, a 5 MiB state's staging
    # can land in pages the sync run freed and read 1.5 MiB, so the start is what is checked;
    # on a GPU the staging is pinned and counted whole.)
    assert asy["rss_from"] == "plan ahead", asy
    assert asy["fixed_costs"]["blocking_s"]["median"] > 0
    assert asy["fixed_costs"]["bytes"] < asy["bytes"] / 2
    assert figures["torch DCP async"]["first_blocking_s"] > 0
    # Rank 0 wrote what it measured as it went: a run cut short keeps it.
    written = json.loads(progress.read_text())
    assert set(METHODS) | {"side by side"} <= set(written)
    assert not any(p.name.startswith(("ours-", "raw-", "dcp")) for p in tmp_path.rglob("*"))


def test_in_fit_is_true_at_train_end_and_false_from_the_strategy_teardown_on(
    tmp_path: Path,
) -> None:
    # What makes the flag above mean something: from the strategy's teardown on (which moves the
    # state to the CPU; callbacks' teardown hooks come after it, fit still running), it is False.
    seen = run_distributed(_in_fit_then_after, 1, str(tmp_path), timeout=300)[0]
    assert seen == {"on_train_end": True, "callback teardown": False, "fit returned": False}


def test_restart_rows_resume_for_real_and_time_the_first_step(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks import restart

    figures = restart.restart_times(tmp_path / "restart", "quick", "cpu", 1)
    rows = figures["rows"]
    assert set(rows) == set(restart.ROWS)
    # A fresh start runs step 1; both resumes run the step after the saved one.
    assert rows["fresh start"]["step"] == 1
    assert rows["ours, resumed"]["step"] == restart.STEPS + 1
    assert rows["Lightning default, resumed"]["step"] == restart.STEPS + 1
    for name, row in rows.items():
        assert (row["device"], row["in_fit"]) == ("cpu", True), name
        phases = [row["phases"][p] for p in restart.PHASES]
        assert phases == sorted(phases) and phases[0] >= 0, (name, phases)
        assert row["launch_to_first_step_s"]["median"] == phases[-1]
    # Lightning's default checkpoint is one torch.save file (a zip archive); ours a step.
    assert figures["bytes"]["Lightning default, resumed"] > 0
    assert figures["bytes"]["ours, resumed"] > 0
    (ckpt,) = (tmp_path / "restart" / "lightning").glob("*.ckpt")
    assert ckpt.read_bytes()[:2] == b"PK"
