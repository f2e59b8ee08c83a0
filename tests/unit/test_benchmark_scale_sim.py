"""The simulated scale mode of the benchmark (``python -m benchmarks --scale-sim``): the
GPT-shaped state it saves (every chunk of every tensor written by exactly one rank, as
Megatron-Core checks it), the growth exponent it fits, its targets and its check against real
ranks. On made-up figures and in-process state: no process group, no run.

Axes: layouts (TP only, TP x PP, TP x PP x DP); growth (constant, linear, quadratic, a zero
figure); collectives per save (constant, growing); the check's sequences (the same, different);
a replayed peer's part (a lower rank, a higher one, a record from another call site); the
command line's refusals.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import scale_sim  # noqa: E402 - the repository's benchmarks, not a package


def _coords(rank: int, layout: scale_sim.Layout) -> tuple[int, int, int]:
    """Megatron-Core's default rank order (tp fastest, then dp, then pp)."""
    return rank % layout.tp, rank // (layout.tp * layout.dp), (rank // layout.tp) % layout.dp


@pytest.mark.parametrize(("world", "tp", "pp"), [(2, 2, 1), (8, 2, 2), (32, 8, 4), (64, 8, 4)])
def test_the_main_replicas_of_every_rank_cover_every_tensor_once(world: int, tp: int, pp: int):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica
    from megatron.core.dist_checkpointing.validation import _compute_shards_access

    layout = scale_sim.layout_for(world, tp, pp)
    by_key: dict[str, list[tuple[int, Any]]] = {}
    for rank in range(world):
        tp_rank, pp_rank, dp_rank = _coords(rank, layout)
        model = scale_sim.RankModel(layout, tp_rank, pp_rank, dp_rank)
        for sharded in nested_values(model.sharded_state_dict()):
            by_key.setdefault(sharded.key, []).append((rank, sharded))
    assert len(by_key) == 12 + 4  # twelve stacked layer keys; embedding, output, final norm (2)
    for shardings in by_key.values():
        assert torch.all(_compute_shards_access(shardings) == 1)
        assert any(is_main_replica(s.replica_id) for _, s in shardings)


def test_a_stage_holds_its_layers_and_only_the_first_and_last_the_ends():
    layout = scale_sim.layout_for(64)
    assert (layout.tp, layout.pp, layout.dp) == (8, 4, 2)
    first = scale_sim.RankModel(layout, 0, 0, 0)
    last = scale_sim.RankModel(layout, 0, layout.pp - 1, 0)
    keys = {key for _, key, _, _, _ in first.entries}
    assert "embedding.word_embeddings.weight" in keys and "output_layer.weight" not in keys
    layers = {layer for *_, layer in last.entries if layer is not None}
    assert layers == set(range(12, 16))


def test_a_world_that_the_layout_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="not a multiple"):
        scale_sim.layout_for(48, 8, 4)


@pytest.mark.parametrize(
    ("values", "expected"),
    [([5.0, 5.0, 5.0], 0.0), ([1.0, 4.0, 16.0], 1.0), ([1.0, 16.0, 256.0], 2.0)],
)
def test_the_growth_exponent_is_the_slope_in_log_log(values: list[float], expected: float):
    assert scale_sim.growth_exponent([64, 256, 1024], values) == pytest.approx(expected)


def test_a_zero_figure_is_left_out_of_the_fit():
    assert scale_sim.growth_exponent([64, 256, 1024], [0.0, 2.0, 8.0]) == pytest.approx(1.0)
    assert scale_sim.growth_exponent([64, 256], [0.0, 1.0]) is None


def _row(world: int, collectives: int, grows: float) -> dict[str, Any]:
    scale = world / 64
    return {
        "world": world,
        "first.cached.collectives": collectives,
        "first.afresh.collectives": collectives + 10,
        "metadata_bytes": 1000 * scale,
        "first.cached.planning_cpu_s": 0.02,
        "first.afresh.planning_cpu_s": 0.1 * scale**grows,
        "first.cached.received_bytes": 100 * scale,
    }


def test_constant_collectives_and_linear_growth_meet_the_targets():
    rows = [_row(64, 17, 1.0), _row(256, 17, 1.0), _row(1024, 17, 1.0)]
    assert all(ok for _, ok, _ in scale_sim.targets(rows))


@pytest.mark.parametrize(
    ("rows", "missed"),
    [
        ([_row(64, 17, 1.0), _row(256, 18, 1.0)], "collectives per save, cached plans, constant"),
        (
            [_row(64, 17, 2.0), _row(256, 17, 2.0)],
            "rank 0's planning CPU (afresh) grows no faster than ranks",
        ),
    ],
)
def test_growing_collectives_or_faster_than_linear_planning_miss(rows: list, missed: str):
    verdicts = {name: ok for name, ok, _ in scale_sim.targets(rows)}
    assert verdicts[missed] is False
    assert sum(not ok for ok in verdicts.values()) == 1


def _saves(names: list[str]) -> dict[str, Any]:
    save = {"collectives": len(names), "names": names, "sent_bytes": 10, "received_bytes": 20}
    return {"saves": [save] * scale_sim.SAVES, "metadata": [{".metadata": 5}] * scale_sim.SAVES}


@pytest.mark.parametrize(
    ("simulated", "word"), [(["all_reduce"], "same"), (["barrier"], "DIFFERENT")]
)
def test_the_check_says_whether_the_simulated_sequence_is_the_real_one(simulated, word):
    real = [{"rank": r, **_saves(["all_reduce"])} for r in range(2)]
    sim = {"ranks": {"0": _saves(simulated), "1": _saves(simulated)}}
    lines = scale_sim.check_rows(real, sim)
    sequences = [line for line in lines if "sequence of collectives" in line]
    assert len(sequences) == 2 * scale_sim.SAVES
    assert all(f"| {word} |" in line for line in sequences)


def test_the_table_has_a_growth_exponent_per_figure():
    rows = [_row(64, 17, 1.0), _row(256, 17, 1.0), _row(1024, 17, 1.0)]
    lines = scale_sim.table(rows)
    assert lines[0].startswith("| per save | 64 ranks | 256 ranks | 1024 ranks | growth exponent")
    metadata = next(line for line in lines if line.startswith("| metadata per step"))
    assert metadata.endswith("| 1.00 |")


@pytest.mark.parametrize(
    ("op", "expected"), [("MAX", [3.0, 5.0]), ("MIN", [1.0, 2.0]), ("SUM", [4.0, 7.0])]
)
def test_a_replayed_all_reduce_reduces_every_rank_s_input(op: str, expected: list[float]):
    import torch.distributed as dist

    parts = [torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])]
    assert scale_sim._reduce(parts, getattr(dist.ReduceOp, op)).tolist() == expected


def test_a_replayed_rank_is_answered_by_lower_ranks_from_this_pass_and_only_from_the_same_call():
    collectives = scale_sim.Collectives()
    collectives.site = "optim.py:270"
    call = collectives._call("broadcast_object_list")
    before = {0: {3: (call, b"rank 0, pass before")}, 2: {3: (call, b"rank 2, pass before")}}
    collectives.start_rank(1, "replay", peers=before, sent={0: {3: (call, b"rank 0, this pass")}})
    # Rank 0 ran before rank 1 in this pass (what it merged and broadcast there); rank 2 not yet.
    assert collectives._peer(0, 3, b"mine", "broadcast_object_list") == b"rank 0, this pass"
    assert collectives._peer(2, 3, b"mine", "broadcast_object_list") == b"rank 2, pass before"
    assert collectives.unrecorded == 0
    # The same collective at the same index called elsewhere (a path of another length): a miss.
    collectives.site = "optim.py:275"
    assert collectives._peer(0, 3, b"mine", "broadcast_object_list") == b"mine"
    assert collectives.unrecorded == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--procs", "64,48"], "multiples of 32"),
        (["--procs", "64,x"], "pass rank counts"),
        (["--check", "16,2,2"], "at most 8 ranks"),
        (["--check", "8,3,2"], "a multiple of TP x PP"),
        (["--check", "8,2"], "pass RANKS,TP,PP"),
    ],
)
def test_the_simulated_scale_mode_refuses_bad_arguments_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--scale-sim", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
