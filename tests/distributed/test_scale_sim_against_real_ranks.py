"""The simulated scale benchmark (``python -m benchmarks --scale-sim``) against real ranks: the
same saves on 4 gloo ranks and on the fake process group with every rank's collectives
recorded and replayed make the same collectives, send the same bytes, and leave rank 0 the same
metadata, and receive the same bytes (an all-reduce counted as the result it fills, as on real
ranks).

Layouts TP 2 x DP 2 (the replicas' distribution over the data-parallel group is computed from
what the other replica sent) and TP 2 x PP 2 (the pipeline stages hold different optimizer
keys: their union is gathered on rank 0 and broadcast from it, one collective more than where
every rank holds the same keys). Sizes agree to within a few bytes: the two runs' scratch paths,
which travel in broadcasts and write results, differ in length.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import scale_sim  # noqa: E402 - the repository's benchmarks, not a package


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2-dp2", "tp2-pp2"])
def test_the_simulation_makes_the_collectives_and_metadata_of_real_ranks(tmp_path: Path, pp: int):
    layout = scale_sim.layout_for(4, 2, pp)
    cfg = {"layout": asdict(layout), "dir": str(tmp_path / "real-ranks")}
    real = run_distributed(scale_sim.real_rank, 4, cfg, env={"OMP_NUM_THREADS": "1"})
    simulated = scale_sim.simulate_in_subprocess(layout, tmp_path / "sim")
    for rank in (0, 3):
        saves = zip(real[rank]["saves"], simulated["ranks"][str(rank)]["saves"], strict=True)
        for mine, theirs in saves:
            assert theirs["names"] == mine["names"]
            assert abs(theirs["sent_bytes"] - mine["sent_bytes"]) <= 64
            assert abs(theirs["received_bytes"] - mine["received_bytes"]) <= 64
    assert simulated["ranks"]["0"]["unrecorded"] == 0
    for name, size in real[0]["metadata"][scale_sim.CACHED].items():
        assert abs(simulated["ranks"]["0"]["metadata"][scale_sim.CACHED][name] - size) <= 64
