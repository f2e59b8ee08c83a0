"""Steps written by an earlier version of the package still load, and resume exactly.

``fixtures/v0_1/ckpt`` holds ``global_step_4`` of a tiny run written by lightning-mcore-ckpt
0.1.0 (before the callback composed Lightning's ``ModelCheckpoint``: its state then held only
``dirpath`` and ``last_global_step_saved``), with megatron-core 0.19.2 and torch 2.13 on CPU
(``_old_run.train`` is the run, unchanged since; ``expected.json`` records it uninterrupted).

Exact on any CPU, with no tolerance. CPUs round float32 arithmetic differently (this one's run
differs from the recorded one in the last bit from step 3 on), so the recorded run is no
reference here. Instead:

- the fixture's shards load exactly: every tensor the load restores (weights, Adam moments) is
  the one torch's own reader finds in the fixture's files;
- what else the step holds (the commit marker, ``extra/``: RNG, loops, schedulers, the old
  callback state; the shards' non-tensor state) is integers, the same on every CPU: the
  fixture with *this* CPU's step-4 shards in place of its own is then a step in 0.1's format of
  this CPU's run (0.1 wrote with Megatron-Core's writer, as that run does here), and it resumes
  bit-identically to the same run from scratch on this CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt import _compat
from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(400)

FIXTURE = Path(__file__).parent / "fixtures" / "v0_1"
STEP = 4
"""The fixture's step."""
SHARDS = ("model", "optim")


def _files(step: Path) -> list[str]:
    return sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file())


def _stored(directory: Path, scratch: Path) -> dict[str, Any]:
    """A dist-checkpoint's contents as torch's own reader finds them (not this package's)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{directory.parent.name}-{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(out))
    loaded: dict[str, Any] = torch.load(out, weights_only=False)  # written just now, by torch
    return loaded


def _objects(stored: dict[str, Any]) -> dict[str, Any]:
    """A dist-checkpoint's non-tensor contents, less the ``content_metadata`` that writers add
    to the optimizer's since 0.1 (the fixture's own optimizer loads without it: part 1)."""
    out = {}
    for key, value in stored.items():
        if not isinstance(value, torch.Tensor):
            out[key] = [
                {k: v for k, v in item.items() if k != "content_metadata"}
                if isinstance(item, dict)
                else item
                for item in value
            ]
    return out


def _exact_state(extra: Path) -> dict[str, Any]:
    """What a step's ``extra/`` holds that a resume continues from (RNG, loops, schedulers),
    whatever the ``extra/`` format: integers only, the same on every CPU."""
    payload = torch.load(extra, weights_only=False)
    rng, lightning = payload["rng"], payload["lightning"]
    numpy = rng["numpy"]
    if isinstance(numpy, tuple):  # format 1: numpy's get_state() tuple
        numpy = {"key": torch.from_numpy(numpy[1].astype("int64")), "pos": numpy[2]}
    return {
        "python": rng["python"],
        "numpy": (numpy["key"].tolist(), numpy["pos"]),
        "torch_cpu": rng["torch_cpu"].tolist(),
        "megatron": {k: v.tolist() for k, v in rng["megatron_tracker"].items()},
        "loops": repr(lightning["loops"]),
        "lr_schedulers": lightning["lr_schedulers"],
        "global_step": lightning["global_step"],
        "epoch": lightning["epoch"],
    }


def _loaded(rank: int, world_size: int, step: str) -> dict[str, Any]:
    """What a load of ``step`` restores, as training starts: weights, the optimizer's tensors,
    its parameter groups and step counts."""
    import lightning.pytorch as pl
    from _trainer import gathered_optimizer, gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    seen: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            (optimizer,) = trainer.strategy._torch_optimizers()  # type: ignore[attr-defined]
            seen.update(
                start=trainer.global_step,
                weights=gathered_weights(trainer),
                optim=gathered_optimizer(trainer),
                groups=[
                    {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
                ],
                steps=sorted({float(s["step"]) for s in optimizer.state.values()}),
            )

    trainer = make_trainer(STEP + 1, MegatronStrategy(), world_size, callbacks=[Capture()])
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(32, 2, shuffle=True), ckpt_path=step)
    return seen


def _assert_loaded_exactly(loaded: dict[str, Any], step: Path, scratch: Path) -> None:
    """What ``_loaded`` restored from ``step`` is what torch's own reader finds in its files."""
    assert loaded["start"] == STEP
    for part, got in (("model", loaded["weights"]), ("optim", loaded["optim"])):
        stored = _stored(step / part, scratch)
        tensors = {k for k, v in stored.items() if isinstance(v, torch.Tensor)}
        assert set(got) == tensors, (part, sorted(set(got) ^ tensors))
        for key, tensor in got.items():
            assert torch.equal(tensor, stored[key]), (part, key)
    # The optimizer's parameter groups (learning rate, Adam's settings) and step counts.
    (common,) = _stored(step / "optim", scratch)["common_state/shard_0_1"]
    (saved,) = common["optimizer_0"]["param_groups"]
    assert loaded["steps"] == [saved["scalar_step"]] == [float(STEP)]
    assert loaded["groups"] == [{k: v for k, v in saved.items() if k != "scalar_step"}]


@pytest.mark.skipif(
    not _compat._mcore_at_least("0.17"),
    reason="written by megatron-core 0.19, which 0.16 cannot read (refused, tested elsewhere)",
)
def test_a_step_written_by_0_1_resumes_exactly(tmp_path: Path) -> None:
    import _old_run

    assert json.loads((FIXTURE / "expected.json").read_text())["interrupted_at"] == STEP
    fixture_step = FIXTURE / "ckpt" / f"global_step_{STEP}"

    # 1) The fixture's shards load exactly.
    (loaded,) = run_distributed(_loaded, 1, str(fixture_step), timeout=300)
    _assert_loaded_exactly(loaded, fixture_step, tmp_path)

    # 2) The same run from scratch on this CPU, uninterrupted, writing as 0.1 did.
    here_dir = tmp_path / "here"
    (here,) = run_distributed(
        _old_run.train, 1, str(here_dir), _old_run.MAX_STEPS, None, "megatron", timeout=300
    )
    # The fixture with this CPU's step-4 shards: a 0.1 step of this CPU's run. Nothing else
    # differs: the same files, the shards' non-tensor state, the RNG, loops and schedulers.
    dirpath = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", dirpath)
    old, ours = layout.step_dir(dirpath, STEP), layout.step_dir(here_dir, STEP)
    for part in SHARDS:
        shutil.rmtree(old / part)
        shutil.copytree(ours / part, old / part)
        theirs, mine = _stored(fixture_step / part, tmp_path), _stored(ours / part, tmp_path)
        assert _objects(theirs) == _objects(mine), part
    assert _files(old) == _files(fixture_step)
    extra = Path("extra") / "rank_00000.pt"
    assert _exact_state(fixture_step / extra) == _exact_state(ours / extra)
    assert json.loads((old / "metadata.json").read_text())["format_version"] == 1
    (resumed,) = run_distributed(
        _old_run.train, 1, str(dirpath), _old_run.MAX_STEPS, "last", timeout=300
    )
    assert resumed["start"] == STEP
    assert resumed["losses"] == here["losses"][STEP:]
    assert resumed["weights"] == here["weights"]
    assert [s.step for s in layout.complete_steps(dirpath)] == [STEP, 6]
    meta = markers.read_metadata(layout.step_dir(dirpath, 6))
    assert meta is not None and meta["format_version"] == layout.METADATA_FORMAT_VERSION


def test_the_callback_state_of_0_1_loads(tmp_path: Path) -> None:
    from lightning_mcore_ckpt import MegatronCheckpoint

    callback = MegatronCheckpoint(tmp_path)
    callback.load_state_dict({"dirpath": str(tmp_path), "last_global_step_saved": 4})
    assert callback._last_global_step_saved == 4
    assert (callback.best_model_path, callback.best_k_models, callback.last_model_path) == (
        "",
        {},
        "",
    )


# --- a step written by the package before its modules moved into folders --------------------

PREVIOUS = Path(__file__).parent / "fixtures" / "cb01742"
"""``global_step_4`` of the same run (``_old_run.train``, its default writer), written by the
package at commit cb01742: the code as it was released before its modules moved into the
folders of its architecture (format 2, hashes in ``metadata.json``), with megatron-core 0.19.2
and torch 2.13 on CPU. ``expected.json`` records the run uninterrupted, by that code on the CPU
that wrote the step."""


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The previous release's step loaded; this code's run of it from scratch, uninterrupted;
    and a copy of the step resumed to the end by this code."""
    import _old_run

    tmp = tmp_path_factory.mktemp("previous")
    step = PREVIOUS / "ckpt" / f"global_step_{STEP}"
    (loaded,) = run_distributed(_loaded, 1, str(step), timeout=300)
    here_dir = tmp / "here"
    (here,) = run_distributed(
        _old_run.train, 1, str(here_dir), _old_run.MAX_STEPS, None, timeout=300
    )
    dirpath = tmp / "ckpt"
    shutil.copytree(PREVIOUS / "ckpt", dirpath)
    (resumed,) = run_distributed(
        _old_run.train, 1, str(dirpath), _old_run.MAX_STEPS, "last", timeout=300
    )
    return {
        "step": step,
        "loaded": loaded,
        "here_dir": here_dir,
        "here": here,
        "dirpath": dirpath,
        "resumed": resumed,
        "scratch": tmp,
    }


def test_a_step_of_the_previous_release_loads_exactly(previous: dict[str, Any]) -> None:
    step, loaded, scratch = previous["step"], previous["loaded"], previous["scratch"]
    assert json.loads((PREVIOUS / "expected.json").read_text())["interrupted_at"] == STEP
    _assert_loaded_exactly(loaded, step, scratch)


# What a step's metadata.json records of the run, not of the machine or the moment.
_RUN_FIELDS = ("async", "contents", "epoch", "format_version", "global_step", "monitor")
_RUN_FIELDS += ("parallel_layout", "writer")
# Fields this code writes that the previous release did not: figures only, which nothing
# needs to load or resume a step (readers of the previous release's steps go without them).
_ADDED_SINCE = {"blocking_parts_s"}


def test_a_step_of_the_previous_release_is_the_step_this_code_writes(
    previous: dict[str, Any],
) -> None:
    """Files, the shards' non-tensor state, metadata.json's fields and what a resume continues
    from (RNG, loops, schedulers: integers, the same on every CPU) are those of this code's
    step of the same run."""
    step, scratch = previous["step"], previous["scratch"]
    ours = layout.step_dir(previous["here_dir"], STEP)
    assert layout.verify_step(step, deep=True) == []  # its hashes, checked by this code
    assert _files(ours) == _files(step)
    for part in SHARDS:
        assert _objects(_stored(step / part, scratch)) == _objects(_stored(ours / part, scratch))
    extra = Path("extra") / "rank_00000.pt"
    assert _exact_state(step / extra) == _exact_state(ours / extra)
    theirs, mine = markers.read_metadata(step), markers.read_metadata(ours)
    assert theirs is not None and mine is not None
    assert sorted(theirs) == sorted(set(mine) - _ADDED_SINCE)
    assert _ADDED_SINCE <= set(mine)
    assert sorted(theirs["hashes"]) == sorted(mine["hashes"])
    assert {k: theirs[k] for k in _RUN_FIELDS} == {k: mine[k] for k in _RUN_FIELDS}
    assert theirs["format_version"] == layout.METADATA_FORMAT_VERSION


def test_a_step_of_the_previous_release_resumes_and_training_goes_on(
    previous: dict[str, Any],
) -> None:
    import _old_run

    dirpath, resumed = previous["dirpath"], previous["resumed"]
    assert resumed["start"] == STEP
    assert len(resumed["losses"]) == _old_run.MAX_STEPS - STEP
    assert [s.step for s in layout.complete_steps(dirpath)] == [STEP, 6]
    assert layout.verify_step(layout.step_dir(dirpath, STEP), deep=True) == []
    meta = markers.read_metadata(layout.step_dir(dirpath, 6))
    assert meta is not None and meta["format_version"] == layout.METADATA_FORMAT_VERSION


def test_a_step_of_the_previous_release_resumes_exactly(previous: dict[str, Any]) -> None:
    """Where this CPU rounds float32 as the one that wrote the step did (this code's run from
    scratch is the recorded one through the step), the resumed run is that run, bit for bit."""
    reference = json.loads((PREVIOUS / "expected.json").read_text())["reference"]
    here, resumed = previous["here"], previous["resumed"]
    if here["losses"][:STEP] != reference["losses"][:STEP]:
        pytest.skip("this CPU rounds float32 differently from the one that wrote the fixture")
    assert here == reference  # this code trains the run as the previous release did
    assert resumed["losses"] == here["losses"][STEP:]
    assert resumed["weights"] == here["weights"]
