"""The cold-load rounds (``python -m benchmarks --only-loads``) run end to end on a tiny state,
trained with torch AdamW and with Megatron-Core's distributed optimizer over fp32 and over bf16
weights: every method in every round, our load's phases timed from the library's own functions,
``torch.load``'s file and plain DCP's step holding the optimizer's moments and, over bf16
weights, its fp32 main parameters (our step holds them), and the tables with their targets
written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import load_rounds  # noqa: E402 - the repository's benchmarks, not a package


def test_every_method_loads_in_every_round_with_our_phases(tmp_path: Path) -> None:
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks", "--only-loads", "--quick"]
    command += ["--out", str(out), "--dir", str(tmp_path / "scratch")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (found,) = out.glob("*-loads.json")
    runs = json.loads(found.read_text())["runs"]
    assert [run["optimizer"] for run in runs] == ["adamw", "distributed", "distributed-bf16"]
    adamw, *distributed = (run["result"]["optimizer_class"] for run in runs)
    assert adamw == "AdamW"
    for name in distributed:
        assert name in ("DistributedOptimizer", "ChainedOptimizer(DistributedOptimizer)")
    table = found.with_suffix(".md").read_text()
    for run in runs:
        _check_run(run["result"])
        if run["optimizer"] != "distributed":
            # The same state, the same bytes: over bf16 weights the baselines hold the fp32
            # main parameters our step holds (fp32 weights' main parameters are the weights,
            # which our step holds twice, in model/ and optim/, as Megatron-Core's format does).
            sizes = run["result"]["bytes"]
            assert sizes["ours"] <= 1.1 * sizes["read: torch.save file"], (run["optimizer"], sizes)
        name = load_rounds.OPTIMIZER_NAMES[run["optimizer"]]
        assert f"1 process(es), {name}: 2 rounds" in table
    for target in ("cold load >= torch.load", "cold load >= 0.8 x parallel read limit"):
        assert table.count(target) == 3
    assert not (tmp_path / "scratch" / "loads").exists()


def _check_run(result: dict[str, Any]) -> None:
    assert set(result["seconds"]) == set(load_rounds.METHODS)
    assert all(len(v) == result["rounds"] == 2 for v in result["seconds"].values())
    # Our load was timed through the library's and Megatron-Core's functions, each round: the
    # weights' and the optimizer's loads, the parts inside them, the shard reads.
    assert len(result["phases"]) == 2
    # Each of our loads went into an optimizer without state, as a resumed process's: the load
    # created it (a state left by the round before would be reused memory, no page faults).
    assert result["optimizer_state_before_ours"] == [0, 0]
    for phases in result["phases"]:
        for name in (
            "weights, in all",
            "optimizer, in all",
            "shard reads (in both)",
            "resolve the step (rank 0) and its damage check",
            "the model's sharded state dicts (all)",
            "optimizer: its sharded state dict",
            "Megatron-Core: sharded load",
            "torch DCP load: planning and reads (both)",
        ):
            assert phases[name] > 0, (name, phases)
        # Nested parts take no more than what holds them.
        assert (
            phases["shard reads (in both)"] <= phases["torch DCP load: planning and reads (both)"]
        )
        inside = phases["Megatron-Core: sharded load"]
        assert inside <= phases["weights, in all"] + phases["optimizer, in all"]
    # Our files were read whole: every byte of them.
    assert result["bytes"]["read: our files"] == result["bytes"]["ours"] > 0
    # torch.load reads a file holding the whole state, the optimizer's moments included (a
    # Megatron-Core optimizer's state_dict() alone leaves them out).
    assert result["bytes"]["read: torch.save file"] >= result["bytes"]["state"] > 0
