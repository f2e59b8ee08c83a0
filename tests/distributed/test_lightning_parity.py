"""MegatronCheckpoint behaves as Lightning's ModelCheckpoint documents, step directories aside.

Lightning decides when to save (its hooks, triggers and timers) and which checkpoints to keep
(top-k by ``monitor``, best and last, its ``state_dict``, logger notifications); a "checkpoint"
here is a committed ``<dirpath>/global_step_<N>/`` directory instead of a ``.ckpt`` file.

Intended differences from Lightning 2.6.6, asserted here:

- without a ``monitor``, the default keeps every step (Lightning's ``save_top_k=1`` keeps one);
- "last" is the newest committed step, not a separate ``last.ckpt`` (as Lightning never deletes
  the file it resumed from, the step a run resumed from is kept); with ``save_last=True`` the
  final step is saved when ``fit`` ends, also where Lightning's last copy is of an earlier one;
- ``WandbLogger(log_model=...)`` is refused (it uploads checkpoint files; steps are directories);
- a URL ``dirpath`` other than ``s3://`` is refused, and ``~`` is expanded only where
  ``dirpath`` starts with it;
- ``train_time_interval=timedelta(0)`` is "off" (Lightning saves at every batch);
- with a validation-only ``monitor``, a step saved where a validation runs records that
  validation's value (Lightning records the previous validation's value mid-epoch, and skips
  the save when the step trigger falls on the epoch's last batch).

Each parametrised table runs as one process (several fits in a row, see ``_parity.run_specs``),
so the file stays fast; every case still asserts its own exact outcome. The matrix (section 14)
runs each cell side by side with Lightning's own ``ModelCheckpoint`` (``_parity.run_pairs``) and
compares the two, step by step.
"""

from __future__ import annotations

import datetime
import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _parity import (  # tests/distributed, on the path (conftest)
    SCORES,
    VAL_SCORES,
    run_pairs,
    run_specs,
)

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

LIGHTNING_STATE_KEYS = {
    "monitor",
    "best_model_score",
    "best_model_path",
    "current_score",
    "dirpath",
    "best_k_models",
    "kth_best_model_path",
    "kth_value",
    "last_model_path",
}


def _top(k: int, mode: str, scores: dict[int, float] = SCORES) -> list[int]:
    """The k best steps by score, best first."""
    return sorted(scores, key=lambda s: scores[s], reverse=mode == "max")[:k]


def _path(dirpath: Path, step: int) -> str:
    return str(dirpath / f"global_step_{step}")


def _no_error(run: dict[str, Any]) -> None:
    assert run["error"] is None, run["error"]


def _float(value: Any) -> float:
    assert isinstance(value, torch.Tensor), f"{value!r} is not a tensor"
    return float(value)


class _Runs:
    """Runs a table of specs once (one process), the first time any of its cases needs it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, Any] = {}

    def __call__(
        self,
        table: str,
        specs: dict[str, dict[str, Any]],
        world_size: int = 1,
        fn: Callable[..., Any] = run_specs,
    ) -> list[dict[str, Any]]:
        if table not in self.done:
            self.done[table] = run_distributed(fn, world_size, specs, timeout=280)
        return self.done[table]  # type: ignore[no-any-return]

    def dir(self, table: str, case: str) -> Path:
        return self.root / table / case


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("parity"))


def _table(
    runs: _Runs,
    table: str,
    cases: dict[str, dict[str, Any]],
    world_size: int = 1,
    fn: Callable[..., Any] = run_specs,
) -> list[dict[str, Any]]:
    specs = {case: {"dirpath": str(runs.dir(table, case)), **spec} for case, spec in cases.items()}
    return runs(table, specs, world_size, fn)


# --- 1. save_top_k with a monitor ------------------------------------------------------------

TOP_K = {
    f"{mode}-k{k}-last{int(last)}": {
        "callback": {
            "monitor": "train_metric",
            "mode": mode,
            "save_top_k": k,
            "save_last": last,
            "every_n_train_steps": 1,
        }
    }
    for mode in ("min", "max")
    for k in (1, 2)
    for last in (False, True)
}


@pytest.mark.parametrize("case", sorted(TOP_K))
def test_save_top_k_keeps_exactly_the_k_best_steps_by_monitor(runs: _Runs, case: str) -> None:
    run = _table(runs, "top_k", TOP_K)[0][case]
    _no_error(run)
    options = TOP_K[case]["callback"]
    dirpath = runs.dir("top_k", case)
    best = _top(options["save_top_k"], options["mode"])
    assert run["attrs"]["best_k_models"].keys() == {_path(dirpath, s) for s in best}
    for step in best:
        assert _float(run["attrs"]["best_k_models"][_path(dirpath, step)]) == SCORES[step]
    kept = {_path(dirpath, s) for s in run["complete"]}
    if options["save_last"]:
        assert run["attrs"]["last_model_path"] == _path(dirpath, 6)
        assert kept == set(run["attrs"]["best_k_models"]) | {run["attrs"]["last_model_path"]}
        assert set(run["complete"]) == {*best, 6}
    else:
        assert kept == set(run["attrs"]["best_k_models"])
        assert set(run["complete"]) == set(best)
    assert run["step_dirs"] == sorted(f"global_step_{s}" for s in run["complete"])


# --- 2. save_top_k=0 ------------------------------------------------------------------------

TOP_0 = {
    f"monitor{int(monitor is not None)}-last{int(last)}": {
        "callback": {
            "monitor": monitor,
            "save_top_k": 0,
            "save_last": last,
            "every_n_train_steps": 1,
        }
    }
    for monitor in (None, "train_metric")
    for last in (False, True)
}


@pytest.mark.parametrize("case", sorted(TOP_0))
def test_save_top_k_zero_writes_nothing_but_the_last_step(runs: _Runs, case: str) -> None:
    run = _table(runs, "top_0", TOP_0)[0][case]
    _no_error(run)
    if TOP_0[case]["callback"]["save_last"]:
        # Lightning keeps only last.ckpt: here the newest step.
        assert run["step_dirs"] == ["global_step_6"]
        assert run["complete"] == [6]
    else:
        assert run["step_dirs"] == []  # not even an incomplete one


# --- 3. without a monitor, and the defaults -----------------------------------------------

NO_MONITOR = {
    "save_top_k_1": ({"save_top_k": 1}, [6]),
    "save_top_k_all": ({"save_top_k": -1}, [1, 2, 3, 4, 5, 6]),
    "default_keeps_all": ({}, [1, 2, 3, 4, 5, 6]),
    "max_to_keep_2": ({"max_to_keep": 2}, [5, 6]),
    "monitor_default_top_1": ({"monitor": "train_metric", "save_last": False}, [4]),
}


@pytest.mark.parametrize("case", sorted(NO_MONITOR))
def test_retention_without_monitor_and_the_save_top_k_default(runs: _Runs, case: str) -> None:
    cases = {
        name: {"callback": {"every_n_train_steps": 1, **kwargs}}
        for name, (kwargs, _) in NO_MONITOR.items()
    }
    run = _table(runs, "no_monitor", cases)[0][case]
    _no_error(run)
    assert run["complete"] == NO_MONITOR[case][1]
    assert run["step_dirs"] == [f"global_step_{s}" for s in NO_MONITOR[case][1]]


# --- 4. bookkeeping attributes on every rank ------------------------------------------------

BOOKKEEPING = {
    "max-k2": {
        "callback": {
            "monitor": "train_metric",
            "mode": "max",
            "save_top_k": 2,
            "every_n_train_steps": 1,
        }
    }
}


def test_bookkeeping_attributes_and_state_dict_on_every_rank(runs: _Runs) -> None:
    results = _table(runs, "bookkeeping", BOOKKEEPING, world_size=2)
    dirpath = runs.dir("bookkeeping", "max-k2")
    # max, k=2 over 5,2,7,1,6,3: steps 1, 2, 3 enter, 5 replaces 1; 4 and 6 never enter.
    expected_k = {_path(dirpath, 3): 7.0, _path(dirpath, 5): 6.0}
    for rank_results in results:
        run = rank_results["max-k2"]
        _no_error(run)
        attrs = run["attrs"]
        assert attrs["best_model_path"] == _path(dirpath, 3), run["rank"]
        assert _float(attrs["best_model_score"]) == 7.0
        assert {k: _float(v) for k, v in attrs["best_k_models"].items()} == expected_k
        assert attrs["kth_best_model_path"] == _path(dirpath, 5)
        assert _float(attrs["kth_value"]) == 6.0
        assert _float(attrs["current_score"]) == 6.0  # the last step that entered the top-k
        assert attrs["last_model_path"] == _path(dirpath, 6)
        state = run["state"]
        assert LIGHTNING_STATE_KEYS <= state.keys(), sorted(state)
        assert state["monitor"] == "train_metric"
        assert str(state["dirpath"]) == str(dirpath)
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            assert state[key] == attrs[key], key
        for key in ("best_model_score", "current_score", "kth_value"):
            assert _float(state[key]) == _float(attrs[key]), key
        assert {k: _float(v) for k, v in state["best_k_models"].items()} == expected_k
    for path in [*expected_k, _path(dirpath, 6)]:
        assert layout.is_complete(path), path
    assert results[0]["max-k2"]["complete"] == [3, 5, 6]


# --- 5. resume restores the bookkeeping, and top-k goes on ----------------------------------

RESUME_CALLBACK = {
    "monitor": "train_metric",
    "mode": "max",
    "save_top_k": 2,
    "every_n_train_steps": 1,
}


def test_resume_restores_bookkeeping_and_top_k_continues(runs: _Runs) -> None:
    dirpath = runs.dir("resume", "run")
    specs = {
        "first": {"dirpath": str(dirpath), "max_steps": 4, "callback": RESUME_CALLBACK},
        "second": {
            "dirpath": str(dirpath),
            "max_steps": 6,
            "callback": RESUME_CALLBACK,
            "ckpt_path": "last",
            "probe": True,
        },
    }
    first, second = runs("resume", specs)[0].values()
    _no_error(first)
    _no_error(second)
    # Steps 1..4 score 5, 2, 7, 1: the best two are 3 and 1; 4 is the last.
    assert first["complete"] == [1, 3, 4]
    assert first["attrs"]["best_model_path"] == _path(dirpath, 3)
    start, end = second["start"], first["attrs"]
    assert start is not None
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        assert start[key] == end[key], key
    assert _float(start["best_model_score"]) == _float(end["best_model_score"]) == 7.0
    restored = {k: _float(v) for k, v in start["best_k_models"].items()}
    assert restored == {k: _float(v) for k, v in end["best_k_models"].items()}
    assert restored == {_path(dirpath, 3): 7.0, _path(dirpath, 1): 5.0}
    # Step 5 (6.0) displaces step 1 (5.0): the top-2 over both runs, and the newest step. The
    # resumed-from step 4 stays, as in Lightning, which never deletes what it resumed from.
    assert second["complete"] == [3, 4, 5, 6]
    assert {k: _float(v) for k, v in second["attrs"]["best_k_models"].items()} == {
        _path(dirpath, 3): 7.0,
        _path(dirpath, 5): 6.0,
    }


# --- 6. ckpt_path="best" ------------------------------------------------------------------

EVALUATE = {
    evaluate: {
        "callback": {"monitor": "train_metric", "save_top_k": 1, "every_n_train_steps": 1},
        "capture_weights": True,
        "evaluate": evaluate,
    }
    for evaluate in ("validate", "test")
}


@pytest.mark.parametrize("evaluate", sorted(EVALUATE))
def test_evaluate_with_ckpt_path_best_loads_the_best_step(runs: _Runs, evaluate: str) -> None:
    run = _table(runs, "evaluate", EVALUATE)[0][evaluate]
    _no_error(run)
    dirpath = runs.dir("evaluate", evaluate)
    assert run["attrs"]["best_model_path"] == _path(dirpath, 4)  # min over SCORES
    assert run["evaluated_from"] == _path(dirpath, 4)
    best, final, loaded = run["captured"][4], run["captured"][6], run["weights_after_evaluate"]
    assert best.keys() == loaded.keys()
    assert any(not torch.equal(best[k], final[k]) for k in best)  # the test can tell them apart
    for key, tensor in best.items():
        assert torch.equal(loaded[key], tensor), key


# --- 7. loggers hear of every committed save ------------------------------------------------

LOGGERS = {
    mode: {
        "callback": {"every_n_train_steps": 2},
        "strategy": {"ckpt_async_save": mode == "async"},
        "logger": "recording",
    }
    for mode in ("sync", "async")
}


@pytest.mark.parametrize("mode", sorted(LOGGERS))
def test_loggers_after_save_checkpoint_once_per_committed_step(runs: _Runs, mode: str) -> None:
    results = _table(runs, "loggers", LOGGERS, world_size=2)
    dirpath = runs.dir("loggers", mode)
    rank0, rank1 = results[0][mode], results[1][mode]
    _no_error(rank0)
    _no_error(rank1)
    assert rank0["complete"] == [2, 4, 6]
    calls = rank0["log_calls"]
    assert [c["path"] for c in calls] == [_path(dirpath, s) for s in (2, 4, 6)], calls
    for call in calls:
        assert call["is_megatron_checkpoint"]
        assert call["dirpath"] == str(dirpath)
        assert call["complete"], f"{call['path']} was not committed when loggers were told"
    assert rank1["log_calls"] == []  # loggers are told on rank 0 only


# --- 8. WandbLogger(log_model=...) ------------------------------------------------------------

WANDB = {
    str(log_model): {
        "callback": {"every_n_train_steps": 2},
        "max_steps": 4,
        "logger": ("wandb", log_model, None),
    }
    for log_model in (True, "all", False)
}


@pytest.mark.parametrize("log_model", sorted(WANDB))
def test_wandb_log_model_is_refused_before_any_step(runs: _Runs, log_model: str) -> None:
    pytest.importorskip("wandb")
    cases = {}
    for case, spec in WANDB.items():
        kind, value, _ = spec["logger"]
        cases[case] = {**spec, "logger": (kind, value, str(runs.dir("wandb_logs", case)))}
    run = _table(runs, "wandb", cases)[0][log_model]
    if log_model == "False":
        _no_error(run)
        assert run["complete"] == [2, 4]
        return
    error = run["error"]
    assert error is not None, "log_model was accepted; nothing would be uploaded"
    assert error["value_error"], error
    assert "log_model" in error["message"], error
    assert run["step_dirs"] == []


# --- 9. a validation-only monitor ----------------------------------------------------------

VAL_MONITOR_CALLBACK = {"monitor": "val_loss", "save_top_k": -1, "every_n_train_steps": 2}
VAL_MONITOR = {
    "val_check_interval": {
        "callback": VAL_MONITOR_CALLBACK,
        "val_scores": VAL_SCORES,
        "trainer": {"val_check_interval": 2, "limit_val_batches": 2},
    },
    "epoch_end": {
        "callback": VAL_MONITOR_CALLBACK,
        "val_scores": VAL_SCORES,
        "trainer": {"limit_train_batches": 2, "limit_val_batches": 2},
    },
}


@pytest.mark.parametrize("case", sorted(VAL_MONITOR))
def test_validation_only_monitor_records_the_validation_of_the_step(runs: _Runs, case: str) -> None:
    # Stricter than Lightning 2.6.6, which saves step 4 mid-epoch with step 2's val_loss (and,
    # at epoch ends, skips step 2): a step saved where a validation runs waits for its value.
    run = _table(runs, "val_monitor", VAL_MONITOR)[0][case]
    _no_error(run)
    assert run["val_by_step"] == VAL_SCORES  # validation ran at steps 2, 4 and 6
    assert run["complete"] == [2, 4, 6]
    for step, monitor in run["monitor"].items():
        assert monitor == {"name": "val_loss", "value": VAL_SCORES[step]}, step


# --- 10. a misspelt monitor ---------------------------------------------------------------


def test_misspelt_monitor_is_refused_once_validation_ran(runs: _Runs) -> None:
    cases = {
        "val_los": {
            "callback": {"monitor": "val_los", "every_n_train_steps": 2},
            "val_scores": VAL_SCORES,
            "trainer": {"val_check_interval": 2, "limit_val_batches": 2},
        }
    }
    run = _table(runs, "misspelt", cases)[0]["val_los"]
    error = run["error"]
    assert error is not None, "a monitor that is never logged was accepted"
    assert error["misconfiguration"] or error["value_error"], error
    assert re.search(r"val_los(?!s)", error["message"]), error  # names the monitor...
    assert "val_loss" in error["message"], error  # ...and lists what was logged
    assert run["val_by_step"] == {2: VAL_SCORES[2]}  # raised at the first validation
    assert run["complete"] == []


# --- 11. train_time_interval --------------------------------------------------------------


def test_train_time_interval_fires_between_slow_batches(runs: _Runs) -> None:
    cases = {
        "timed": {
            "callback": {"train_time_interval": datetime.timedelta(seconds=0.2)},
            "sleep_s": 0.3,
            "max_steps": 4,
        }
    }
    run = _table(runs, "timed", cases)[0]["timed"]
    _no_error(run)
    # Every batch outlasts the interval: each step is saved (1-3 by the timer, 4 also as last).
    assert run["complete"] == [1, 2, 3, 4]


# --- 12. disabling triggers ----------------------------------------------------------------

TRIGGERS = {
    "every_n_epochs_0": ({"every_n_epochs": 0, "every_n_train_steps": 2}, [2, 4, 6]),
    "every_n_train_steps_0": ({"every_n_train_steps": 0, "every_n_epochs": 1}, [3, 6]),
    "steps_and_epochs_0": ({"every_n_train_steps": 0, "every_n_epochs": 0}, [6]),
    # Lightning saves at every batch with timedelta(0); here it is off, like the others.
    "time_interval_0": ({"train_time_interval": datetime.timedelta(0)}, [6]),
}


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_zero_disables_a_trigger(runs: _Runs, case: str) -> None:
    # Epochs of 3 batches: epoch ends at steps 3 and 6.
    cases = {name: {"callback": kwargs, "samples": 6} for name, (kwargs, _) in TRIGGERS.items()}
    run = _table(runs, "triggers", cases)[0][case]
    _no_error(run)
    assert run["complete"] == TRIGGERS[case][1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_n_train_steps": 2, "every_n_epochs": 1},
        {"every_n_train_steps": 2, "train_time_interval": datetime.timedelta(seconds=1)},
        {"every_n_epochs": 1, "train_time_interval": datetime.timedelta(seconds=1)},
    ],
    ids=["steps+epochs", "steps+time", "epochs+time"],
)
def test_two_nonzero_triggers_are_refused(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_mcore_ckpt import MegatronCheckpoint

    with pytest.raises((ValueError, MisconfigurationException)):
        MegatronCheckpoint(tmp_path / "ckpt", **kwargs)


# --- 13. dirpath ------------------------------------------------------------------------------


def test_relative_dirpath_with_tilde_is_not_expanded(
    runs: _Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    cases = {
        "tilde": {
            "dirpath": "./~/ckpts",
            "callback": {"every_n_train_steps": 1},
            "max_steps": 2,
            "chdir": str(cwd),
            "home": str(home),
        }
    }
    run = runs("tilde", cases)[0]["tilde"]
    _no_error(run)
    assert [p.name for p in home.iterdir()] == []
    target = cwd / "~" / "ckpts"
    assert [s.step for s in layout.complete_steps(target)] == [1, 2]


@pytest.mark.parametrize("url", ["gs://bucket/run", "memory://run"])
def test_url_dirpath_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    from lightning_mcore_ckpt import MegatronCheckpoint

    monkeypatch.chdir(tmp_path)
    error: ValueError | None = None
    try:
        MegatronCheckpoint(url, every_n_train_steps=1)
    except ValueError as err:
        error = err
    assert list(tmp_path.iterdir()) == []  # no "s3:" or "memory:" directory
    assert error is not None, f"dirpath={url!r} was accepted"
    assert "dirpath" in str(error) and url in str(error), str(error)


# --- 14. side by side with Lightning's ModelCheckpoint: a pairwise matrix ---------------------
#
# Each cell runs MegatronCheckpoint and Lightning's own ModelCheckpoint (same options, a plain
# module logging the same values at the same steps, the same epochs and validations) and
# compares what each kept, ranked and recorded, by step. Epochs of 3 batches, 12 steps: epochs
# end at steps 3, 6, 9 and 12; validation runs at every epoch end, or every second one.

STEPS_PER_EPOCH, MAX_STEPS = 3, 12
SCORES_12 = {1: 5.0, 2: 2.0, 3: 7.0, 4: 1.0, 5: 6.0, 6: 3.0, 7: 8.0, 8: 0.5, 9: 4.0, 10: 9.0}
SCORES_12 |= {11: 2.5, 12: 6.5}
"""``train_metric`` at each step: neither monotonic nor the same order at epoch ends."""
VAL_SCORES_12 = {3: 4.0, 6: 9.0, 9: 0.5, 12: 3.0}
"""``val_loss`` of the validation at each epoch end."""
CADENCES = {"epochs": {"every_n_epochs": 1}, "steps": {"every_n_train_steps": 2}}
AXES: dict[str, tuple[Any, ...]] = {
    "trigger": tuple(CADENCES),  # epoch-end saves, or step-triggered ones (some at epoch ends)
    # None; a metric logged at every step; the two Lightning always provides; validation's
    "monitor": (None, "train_metric", "step", "epoch", "val_loss"),
    "check_val_every_n_epoch": (1, 2),
    "save_top_k": (0, 1, 2, -1),
    "mode": ("min", "max"),
    "save_last": (True, False),
}


def _valid(cell: dict[str, Any]) -> bool:
    return not (cell["monitor"] is None and cell["save_top_k"] == 2)  # refused, as in Lightning


def _pairwise(axes: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Valid cells such that every pair of values of two axes (that a valid cell can have) is
    in one of them; greedy and deterministic, preferring cells that add new triples."""
    names = list(axes)
    cells = [dict(zip(names, values, strict=True)) for values in itertools.product(*axes.values())]
    cells = [cell for cell in cells if _valid(cell)]

    def combos(cell: dict[str, Any], size: int) -> set[tuple[Any, ...]]:
        return {
            tuple((a, cell[a]) for a in chosen) for chosen in itertools.combinations(names, size)
        }

    pairs = set().union(*(combos(c, 2) for c in cells))
    triples = set().union(*(combos(c, 3) for c in cells))
    chosen = []
    while pairs:
        best = max(cells, key=lambda c: (len(combos(c, 2) & pairs), len(combos(c, 3) & triples)))
        chosen.append(best)
        pairs -= combos(best, 2)
        triples -= combos(best, 3)
    return chosen


def _name(cell: dict[str, Any]) -> str:
    return (
        f"{cell['trigger']}-{cell['monitor'] or 'none'}-val{cell['check_val_every_n_epoch']}"
        f"-k{cell['save_top_k']}-{cell['mode']}-last{int(cell['save_last'])}"
    )


MATRIX = {_name(cell): cell for cell in _pairwise(AXES)}
TABLE_SIZE = 6  # cells per process (one process start each)
MATRIX_TABLES = {name: f"matrix{i // TABLE_SIZE}" for i, name in enumerate(sorted(MATRIX))}


def _matrix_spec(cell: dict[str, Any]) -> dict[str, Any]:
    callback = {
        **CADENCES[cell["trigger"]],
        "monitor": cell["monitor"],
        "save_top_k": cell["save_top_k"],
        "mode": cell["mode"],
        "save_last": cell["save_last"],
    }
    return {
        "callback": callback,
        "trainer": {"check_val_every_n_epoch": cell["check_val_every_n_epoch"]},
        "max_steps": MAX_STEPS,
        "samples": 2 * STEPS_PER_EPOCH,
        "scores": SCORES_12,
        "val_scores": VAL_SCORES_12,
    }


def _matrix_run(runs: _Runs, case: str) -> dict[str, Any]:
    table = MATRIX_TABLES[case]
    cases = {name: _matrix_spec(MATRIX[name]) for name, t in MATRIX_TABLES.items() if t == table}
    return _table(runs, table, cases, fn=run_pairs)[0][case]  # type: ignore[no-any-return]


def test_the_matrix_covers_every_pair_of_values() -> None:
    names = list(AXES)
    every = [dict(zip(names, values, strict=True)) for values in itertools.product(*AXES.values())]
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(AXES[a], AXES[b]):
            possible = any(_valid(c) for c in every if c[a] == va and c[b] == vb)
            covered = any(c[a] == va and c[b] == vb for c in MATRIX.values())
            assert covered == possible, (a, va, b, vb)
    assert all(_valid(cell) for cell in MATRIX.values())


def _epoch_of(step: int) -> int:
    return (step - 1) // STEPS_PER_EPOCH


def _best(k: int, mode: str, scores: dict[int, float]) -> dict[int, float]:
    ranked = sorted(scores, key=lambda s: scores[s], reverse=mode == "max")
    return {s: scores[s] for s in (ranked if k == -1 else ranked[:k])}


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_matrix_cell_keeps_ranks_and_records_what_lightning_does(runs: _Runs, case: str) -> None:
    cell = MATRIX[case]
    result = _matrix_run(runs, case)
    ours, lightning = result["ours"], result["lightning"]
    _no_error(ours)
    assert lightning["error"] is None, lightning["error"]
    # After its fit, a pickled copy of either callback equals it (the same attributes).
    assert ours["pickled_differences"] == lightning["pickled_differences"] == []
    final = {MAX_STEPS} if cell["save_last"] else set()
    kept = set(ours["complete"])
    assert ours["step_dirs"] == sorted(f"global_step_{s}" for s in kept)  # no incomplete step
    for step in kept:  # metadata.json and Lightning's state in extra/ say the same
        assert ours["epochs"][step]["metadata"] == ours["epochs"][step]["extra"], step
    mine = ours["by_step"]
    assert mine["last"] == (MAX_STEPS if cell["save_last"] else None)
    if cell["monitor"] == "val_loss" and cell["trigger"] == "steps":
        # A documented difference: a step-triggered save waits for the validation that follows
        # it and is ranked and recorded with that validation's value; Lightning saves it at
        # once with the previous validation's value (or skips it at an epoch's last batch).
        every = cell["check_val_every_n_epoch"] * STEPS_PER_EPOCH
        validated = {s: v for s, v in VAL_SCORES_12.items() if s % every == 0}
        best = _best(cell["save_top_k"], cell["mode"], validated)
        assert mine["best_k"] == best
        assert kept == set(best) | final
        for step in best:
            assert ours["monitor"][step] == {"name": "val_loss", "value": VAL_SCORES_12[step]}
        for step in kept:  # saved after the validation at its epoch's end: that epoch
            assert ours["epochs"][step]["metadata"] == _epoch_of(step), step
        return
    theirs = lightning["by_step"]
    # Lightning's bookkeeping, step for step: top-k, best, k-th, scores.
    for key in ("best_k", "best", "best_score", "kth", "kth_value", "current_score"):
        assert mine[key] == theirs[key], (key, mine[key], theirs[key])
    # The steps on disk are Lightning's checkpoints; "last" is the final step itself (saved at
    # the end with save_last=True), where Lightning keeps a copy of the last one it saved.
    files = lightning["files"].values()
    assert kept == {f["step"] for f in files} | final
    assert theirs["last"] in (kept if cell["save_last"] else {None})
    # Each step records the epoch Lightning's checkpoint of that step records: the epoch of its
    # batch, also for a step saved at an epoch's end; a step saved only when fit ends (which
    # Lightning saves as last.ckpt when it saved nothing else) the epochs run.
    for saved in files:
        assert ours["epochs"][saved["step"]]["metadata"] == saved["epoch"], saved
        assert saved["epoch"] in (_epoch_of(saved["step"]), MAX_STEPS // STEPS_PER_EPOCH)
    for step in kept - {f["step"] for f in files}:
        assert ours["epochs"][step]["metadata"] == MAX_STEPS // STEPS_PER_EPOCH, step
    # ...and the value Lightning ranked it by.
    for step, score in theirs["best_k"].items():
        assert ours["monitor"][step] == {"name": cell["monitor"], "value": score}, step


# --- 15. a second fit of the same Trainer continues its run, side by side with Lightning -------

REFIT = {
    name: {
        "callback": callback,
        "trainer": {"max_epochs": 2, "check_val_every_n_epoch": 1},
        "max_steps": -1,
        "refit": {"max_epochs": 4},
        "samples": 2 * STEPS_PER_EPOCH,
        "scores": SCORES_12,
        "val_scores": VAL_SCORES_12,
    }
    for name, callback in {
        "epochs-none-all": {"every_n_epochs": 1, "save_top_k": -1},
        "epochs-val_loss-top1": {"every_n_epochs": 1, "monitor": "val_loss", "save_top_k": 1},
        "steps-train_metric-top2-max": {
            "every_n_train_steps": 2,
            "monitor": "train_metric",
            "mode": "max",
            "save_top_k": 2,
        },
        "steps-none-top1-nolast": {"every_n_train_steps": 2, "save_top_k": 1, "save_last": False},
    }.items()
}


@pytest.mark.parametrize("case", sorted(REFIT))
def test_a_second_fit_of_the_same_trainer_continues_as_in_lightning(runs: _Runs, case: str) -> None:
    result = _table(runs, "refit", REFIT, fn=run_pairs)[0][case]
    ours, lightning = result["ours"], result["lightning"]
    _no_error(ours)  # not refused as "another run": the steps are this callback's own
    assert lightning["error"] is None, lightning["error"]
    assert ours["pickled_differences"] == lightning["pickled_differences"] == []
    save_last = REFIT[case]["callback"].get("save_last", True)
    final = {MAX_STEPS} if save_last else set()
    for when in ("first_by_step", "by_step"):  # after each fit
        mine, theirs = ours[when], lightning[when]
        for key in ("best_k", "best", "best_score", "kth", "kth_value", "current_score"):
            assert mine[key] == theirs[key], (when, key, mine[key], theirs[key])
    assert ours["by_step"]["last"] == (MAX_STEPS if save_last else None)
    files = lightning["files"].values()
    assert set(ours["complete"]) == {f["step"] for f in files} | final
    for saved in files:
        assert ours["epochs"][saved["step"]]["metadata"] == saved["epoch"], saved


# --- 16. a resume with another configuration: whose bookkeeping, side by side with Lightning ---
#
# Lightning keys a ModelCheckpoint's state by monitor, mode and cadence: a run resumed with
# another one starts its bookkeeping afresh (the old metric's scores never rank the new steps);
# with the same one, the bookkeeping goes on.

RESUMED_FROM = {
    "monitor": "train_metric",
    "mode": "max",
    "save_top_k": 2,
    "every_n_train_steps": 2,
    "save_last": True,  # Lightning's "last" is last.ckpt
}
RESUMED_WITH = {
    "same": RESUMED_FROM,
    "monitor": {**RESUMED_FROM, "monitor": "step"},
    "mode": {**RESUMED_FROM, "mode": "min"},
    "cadence": {**RESUMED_FROM, "every_n_train_steps": 3},
}


@pytest.mark.parametrize("changed", sorted(RESUMED_WITH))
def test_a_resume_with_another_monitor_mode_or_cadence_starts_afresh_as_in_lightning(
    runs: _Runs, changed: str
) -> None:
    common = {"samples": 2 * STEPS_PER_EPOCH, "scores": SCORES_12}
    specs = {}
    for name in RESUMED_WITH:
        dirpath = str(runs.dir("resumed_with", name))
        specs[f"{name}-first"] = {
            "dirpath": dirpath,
            "callback": RESUMED_FROM,
            "max_steps": 6,
            **common,
        }
        specs[f"{name}-second"] = {
            "dirpath": dirpath,
            "callback": RESUMED_WITH[name],
            "max_steps": MAX_STEPS,
            "ckpt_path": "last",
            "probe": True,
            **common,
        }
    results = runs("resumed_with", specs, fn=run_pairs)[0]
    first, second = results[f"{changed}-first"], results[f"{changed}-second"]
    for run in (first, second):
        _no_error(run["ours"])
        assert run["lightning"]["error"] is None, run["lightning"]["error"]
    ours, lightning = second["ours"], second["lightning"]
    keys = ("best_k", "best", "best_score", "kth", "kth_value", "current_score", "last")
    for key in keys:  # what the resumed run starts with
        assert ours["start_by_step"][key] == lightning["start_by_step"][key], key
    if changed == "same":  # the control: the bookkeeping goes on
        assert ours["start_by_step"]["best_k"] == first["ours"]["by_step"]["best_k"] != {}
    else:
        assert ours["start_by_step"]["best_k"] == {}
    for key in keys[:-1]:  # what it ends with: only its own steps, ranked by its own metric
        assert ours["by_step"][key] == lightning["by_step"][key], key
    monitor = RESUMED_WITH[changed]["monitor"]
    for step, score in ours["by_step"]["best_k"].items():
        assert ours["monitor"][step] == {"name": monitor, "value": score}, step
    new = {f["step"] for f in lightning["files"].values() if f["step"] > 6}
    assert {s for s in ours["complete"] if s > 6} == new | {MAX_STEPS}


# --- 17. steps saved by the previous release: their state, under the dirpath-only key --------


@pytest.mark.parametrize("changed", sorted(RESUMED_WITH))
def test_a_step_of_the_previous_release_resumes_its_bookkeeping_only_for_the_same_ranking(
    runs: _Runs, changed: str
) -> None:
    common = {"samples": 2 * STEPS_PER_EPOCH, "scores": SCORES_12}
    specs = {}
    for name in RESUMED_WITH:
        dirpath = str(runs.dir("legacy", name))
        specs[f"{name}-first"] = {
            "dirpath": dirpath,
            "callback": RESUMED_FROM,
            "max_steps": 6,
            "legacy_key": True,
            **common,
        }
        specs[f"{name}-second"] = {
            "dirpath": dirpath,
            "callback": RESUMED_WITH[name],
            "max_steps": MAX_STEPS,
            "ckpt_path": "last",
            "probe": True,
            **common,
        }
    results = runs("legacy", specs)[0]
    first, second = results[f"{changed}-first"], results[f"{changed}-second"]
    _no_error(first)
    _no_error(second)
    saved, start = first["attrs"], second["start"]
    assert saved["best_k_models"] != {}
    if RESUMED_WITH[changed]["monitor"] == "train_metric" and changed != "mode":
        # The same monitor and mode (the old key names no cadence): migrated, and goes on.
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            assert start[key] == saved[key], key
        assert start["best_k_models"].keys() == saved["best_k_models"].keys()
    else:  # another monitor or mode: the old metric's scores rank nothing
        assert (start["best_k_models"], start["best_model_path"]) == ({}, "")
        assert start["best_model_score"] is None and start["last_model_path"] == ""
    monitor = RESUMED_WITH[changed]["monitor"]
    for path in second["attrs"]["best_k_models"]:
        assert second["monitor"][layout.step_number(path)]["name"] == monitor, path
