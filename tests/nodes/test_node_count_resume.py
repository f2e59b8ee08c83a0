"""A run saved on 2 nodes resumes on fewer or more nodes: DP 2 -> 1 and DP 2 -> 4.

Data parallelism spans the simulated nodes (one rank each), as it does on a cluster where a
job that lost a node resumes on the nodes it has left, or on more once they are back. The
matrix: the optimizer (Megatron-Core's distributed optimizer saved ``fully_reshardable``;
torch's AdamW) x the direction (2 nodes -> 1, 2 nodes -> 4). One saving run on 2 nodes, shared
by every cell (a module-scoped fixture), writes each optimizer's step to its own shared
``dirpath``; each cell resumes a copy of it with ``ckpt_path="last"``.

Each cell proves that the load restores the gathered weights and optimizer state the saving run
had at that step, exactly, and that ``ElasticSampler`` continues at the next global sample: every
rank sees what an uninterrupted run at the new data-parallel size sees from that sample on.

A ``dp_reshardable`` step (the distributed optimizer's default) cannot follow a model-parallel
change: resumed with TP 2 on 1 node x 2 ranks, it is refused on every rank with the error that
names the fix, before any of the step's shards or ``extra/`` files is read.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _node_dirs import node_local

from lightning_mcore_ckpt.testing import run_nodes

pytestmark = pytest.mark.timeout(600)

BATCH = 2
"""The micro-batch size (the DataLoader's ``batch_size``)."""
SAVED_NODES = 2
SAVED_STEP = 2
"""The step saved on 2 nodes: 2 x 2 x 2 = 8 samples of the epoch consumed, a whole number of
global batches at DP 1 (2), DP 2 (4) and DP 4 (8)."""
MORE = 2
"""Steps trained after the resume."""
SAMPLES = 40
"""One epoch: 5 global batches at DP 4, so the resumed steps stay inside the saved epoch."""
SEED = 7
OPTIMIZERS = {
    # name: (TinyGPTModule's optimizer, MegatronStrategy's ckpt_optimizer_sharding)
    "distributed": ("distributed", "fully_reshardable"),
    "adamw": ("adamw", "dp_reshardable"),  # not a distributed optimizer: the option is unused
    "dp_reshardable": ("distributed", "dp_reshardable"),
}
"""The saving run's steps, one dirpath each; ``dp_reshardable`` is the refused one's."""
LAYOUTS = {"1-rank-per-node": (1, 1), "tp2-in-each-node": (2, 2)}
"""Each node's ranks and the TP size: DP spans the nodes in both. The second (8 ranks at 4
nodes) is an extended cell, outside CI."""


def _run(
    nodes: int,
    ranks_per_node: int,
    dirpath: str,
    optimizer: str,
    max_steps: int,
    ckpt_path: str | None,
    tp: int = 1,
) -> tuple[Any, Any]:
    """Train a ``TinyGPTModule`` with an ``ElasticSampler`` on ``nodes`` x ``ranks_per_node``,
    saving into ``dirpath`` at :data:`SAVED_STEP`: the module (with ``seen``, each step's
    inputs on this rank) and the Trainer."""
    import lightning.pytorch as pl
    from _trainer import gathered_optimizer, gathered_weights, make_trainer
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import ElasticSampler, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset

    name, sharding = OPTIMIZERS[optimizer]
    module = TinyGPTModule(optimizer=name)
    module.seen: list[torch.Tensor] = []  # type: ignore[misc]
    module.loaded: dict[str, Any] = {}  # type: ignore[misc]
    original = module.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        module.seen.append(batch[0].clone())
        return original(batch, batch_idx)

    module.training_step = training_step  # type: ignore[method-assign]

    class Loaded(pl.Callback):
        """What the load restored, before the first resumed step changes it."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if ckpt_path is not None:
                module.loaded["step"] = trainer.global_step
                module.loaded["weights"] = gathered_weights(trainer)
                module.loaded["optim"] = gathered_optimizer(trainer)

    strategy = MegatronStrategy(tensor_model_parallel_size=tp, ckpt_optimizer_sharding=sharding)
    checkpoint = MegatronCheckpoint(dirpath, every_n_train_steps=SAVED_STEP)
    trainer = make_trainer(
        max_steps,
        strategy,
        ranks_per_node,
        num_nodes=nodes,
        callbacks=[checkpoint, Loaded()],
        enable_checkpointing=True,
    )
    dataset = TokenDataset(SAMPLES)
    sampler = ElasticSampler(dataset, micro_batch_size=BATCH, seed=SEED)
    loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return module, trainer


def _save(
    rank: int, world_size: int, tmp: str, per_node: int, tp: int, optimizers: list[str]
) -> dict[str, Any]:
    """On 2 nodes of ``per_node`` ranks: each optimizer's step, and what the run had then."""
    from _trainer import gathered_optimizer, gathered_weights

    saved: dict[str, Any] = {}
    for optimizer in optimizers:
        dirpath = f"{tmp}/{optimizer}"
        module, trainer = _run(SAVED_NODES, per_node, dirpath, optimizer, SAVED_STEP, None, tp)
        saved[optimizer] = {
            "step": trainer.global_step,
            "weights": gathered_weights(trainer),
            "optim": gathered_optimizer(trainer),
            "seen": module.seen,
        }
    return saved


def _resume(
    rank: int, world_size: int, nodes: int, per_node: int, tp: int, dirpath: str, optimizer: str
) -> dict[str, Any]:
    module, trainer = _run(nodes, per_node, dirpath, optimizer, SAVED_STEP + MORE, "last", tp)
    return {**module.loaded, "seen": module.seen, "end": trainer.global_step}


def _refused(rank: int, world_size: int, dirpath: str) -> dict[str, Any]:
    """Resume the ``dp_reshardable`` step with TP 2 on 1 node x 2 ranks: the refusal this rank
    raised, and which of the step's files it opened while "last" was found (rank 0 verifies the
    step it picks) and once it was (Python's audit events see every open, torch's and
    Megatron-Core's reads included)."""
    import sys

    from lightning_mcore_ckpt.engine import _reader

    step = str(Path(dirpath, f"global_step_{SAVED_STEP}")) + "/"
    opened: dict[str, list[str]] = {"finding": [], "found": []}
    phase = ["finding"]

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], str | bytes | Path):
            path = str(args[0], "utf-8") if isinstance(args[0], bytes) else str(args[0])
            if path.startswith(step):
                opened[phase[0]].append(path[len(step) :])

    resolve = _reader.CheckpointReader.resolve

    def resolve_then_watch(self: Any, *args: Any, **kwargs: Any) -> Path:
        found = resolve(self, *args, **kwargs)
        phase[0] = "found"
        return found

    _reader.CheckpointReader.resolve = resolve_then_watch  # type: ignore[method-assign]
    sys.addaudithook(audit)  # this rank's process only, which ends with the call
    error = None
    try:
        _run(1, world_size, dirpath, "dp_reshardable", SAVED_STEP + MORE, "last", tp=2)
    except ValueError as err:
        error = str(err)
    return {"error": error, **{k: sorted(set(v)) for k, v in opened.items()}}


def _save_on_2_nodes(
    factory: pytest.TempPathFactory, layout: str, optimizers: list[str]
) -> tuple[Path, dict[str, Any]]:
    """The saving run on 2 nodes: its directory (one shared dirpath per optimizer) and what
    each of its ranks had at the saved step."""
    per_node, tp = LAYOUTS[layout]
    shared = factory.mktemp(f"saved_on_2_nodes_{layout}")
    local = node_local(factory.mktemp("node_local"))
    ranks = run_nodes(
        _save,
        SAVED_NODES,
        per_node,
        str(shared),
        per_node,
        tp,
        optimizers,
        node_dir=local,
        timeout=500,
    )
    return shared, {optimizer: [r[optimizer] for r in ranks] for optimizer in optimizers}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Saved on 2 nodes x 1 rank: every step of :data:`OPTIMIZERS`."""
    return _save_on_2_nodes(tmp_path_factory, "1-rank-per-node", list(OPTIMIZERS))


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Saved on 2 nodes x 2 ranks (TP 2 in each node): the resumed optimizers' steps."""
    return _save_on_2_nodes(tmp_path_factory, "tp2-in-each-node", ["distributed", "adamw"])


def _indices(batches: list[torch.Tensor]) -> list[list[int]]:
    """Which samples of the dataset each batch holds (its rows are unique random tokens)."""
    from lightning_mcore_ckpt.tiny import TokenDataset

    dataset = TokenDataset(SAMPLES)
    where = {tuple(dataset[i][0].tolist()): i for i in range(SAMPLES)}
    assert len(where) == SAMPLES
    return [[where[tuple(row.tolist())] for row in batch] for batch in batches]


def _uninterrupted(dp: int, rank: int, start: int, steps: int) -> list[list[int]]:
    """The micro-batches rank ``rank`` of an uninterrupted run at DP ``dp`` takes from global
    sample ``start`` on (a whole number of its global batches into the epoch)."""
    from lightning_mcore_ckpt import ElasticSampler
    from lightning_mcore_ckpt.tiny import TokenDataset

    assert start % (dp * BATCH) == 0
    sampler = ElasticSampler(
        TokenDataset(SAMPLES), micro_batch_size=BATCH, seed=SEED, num_replicas=dp, rank=rank
    )
    indices = list(sampler)
    batches = [indices[i : i + BATCH] for i in range(0, len(indices), BATCH)]
    skip = start // (dp * BATCH)
    return batches[skip : skip + steps]


def _global_order() -> list[int]:
    """The epoch's global order: ``ElasticSampler``'s documented permutation."""
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED)).tolist()


def _cells() -> list[Any]:
    # Layout x optimizer x direction. CI runs two cells of the one-rank layout that cover
    # every optimizer and every direction (the distributed optimizer shrinking, AdamW
    # growing); -m nodes_extended adds the other pairs and the TP 2 layout.
    cells = []
    for layout in LAYOUTS:
        for optimizer in ("distributed", "adamw"):
            for nodes, direction in ((1, "2-to-1-nodes"), (4, "2-to-4-nodes")):
                in_ci = layout == "1-rank-per-node" and (optimizer == "distributed") == (nodes == 1)
                marks = () if in_ci else (pytest.mark.nodes_extended,)
                cells.append(
                    pytest.param(
                        layout,
                        optimizer,
                        nodes,
                        id=f"{layout}-{optimizer}-{direction}",
                        marks=marks,
                    )
                )
    return cells


@pytest.mark.parametrize("layout, optimizer, nodes", _cells())
def test_a_run_saved_on_2_nodes_resumes_exactly_on_another_node_count(
    tmp_path: Path, request: pytest.FixtureRequest, layout: str, optimizer: str, nodes: int
) -> None:
    per_node, tp = LAYOUTS[layout]
    source, ranks = request.getfixturevalue("saved" if tp == 1 else "saved_tp2")
    before = ranks[optimizer]
    dirpath = tmp_path / "run"
    # Each cell resumes (and saves into) its own copy of the shared directory.
    shutil.copytree(source / optimizer, dirpath)
    local = node_local(tmp_path / "local")
    after = run_nodes(
        _resume,
        nodes,
        per_node,
        nodes,
        per_node,
        tp,
        str(dirpath),
        optimizer,
        node_dir=local,
        timeout=500,
    )

    assert len(after) == nodes * per_node
    reference = before[0]
    assert reference["step"] == SAVED_STEP
    assert any(".exp_avg_sq." in k for k in reference["optim"]), sorted(reference["optim"])[:5]
    if optimizer == "distributed":  # Megatron's fp32 main parameters are restored too
        assert any(k.startswith("optimizer.state.param.") for k in reference["optim"])
    for r in before[1:]:  # every saving rank gathered the same state
        for key, tensor in reference["weights"].items():
            assert torch.equal(tensor, r["weights"][key]), f"saving ranks differ: weight {key}"
    for rank, r in enumerate(after):
        assert r["step"] == SAVED_STEP, f"rank {rank} resumed at step {r['step']}"
        assert r["weights"].keys() == reference["weights"].keys()
        for key, tensor in reference["weights"].items():
            assert torch.equal(tensor, r["weights"][key]), f"rank {rank}: weight {key}"
        assert r["optim"].keys() == reference["optim"].keys()
        for key, tensor in reference["optim"].items():
            assert torch.equal(tensor, r["optim"][key]), f"rank {rank}: optimizer state {key}"
        assert r["end"] == SAVED_STEP + MORE

    # The saving run took the epoch's first global samples, DP rank by DP rank (the TP ranks
    # of one, consecutive global ranks, take the same).
    order = _global_order()
    consumed = SAVED_STEP * SAVED_NODES * BATCH
    saw = [_indices(r["seen"]) for r in before]
    assert all(saw[rank] == saw[rank - rank % tp] for rank in range(len(saw)))
    assert [i for step in zip(*saw[::tp], strict=True) for b in step for i in b] == order[:consumed]
    # Each resumed rank sees what an uninterrupted run at the new DP sees from the next sample.
    for rank, r in enumerate(after):
        expected = _uninterrupted(nodes, rank // tp, consumed, MORE)
        assert _indices(r["seen"]) == expected, f"rank {rank}"
    # ... so that, step by step, the DP ranks together take the global order on from there.
    taken = [
        i
        for step in zip(*(_indices(r["seen"]) for r in after[::tp]), strict=True)
        for b in step
        for i in b
    ]
    assert taken == order[consumed : consumed + MORE * nodes * BATCH]


def test_a_dp_reshardable_step_is_refused_on_a_model_parallel_change_before_it_is_read(
    tmp_path: Path, saved: tuple[Path, dict[str, Any]]
) -> None:
    source, _ = saved
    dirpath = tmp_path / "run"
    shutil.copytree(source / "dp_reshardable", dirpath)
    step = dirpath / f"global_step_{SAVED_STEP}"
    files = {p: p.stat().st_mtime_ns for p in step.rglob("*")}
    results = run_nodes(
        _refused, 1, 2, str(dirpath), node_dir=node_local(tmp_path / "local"), timeout=300
    )

    for rank, r in enumerate(results):
        message = r["error"]
        assert message is not None, f"rank {rank} resumed"
        for needed in (
            "ckpt_optimizer_sharding='dp_reshardable'",
            "tensor_model_parallel_size=1 saved, 2 now",
            "ckpt_optimizer_sharding='fully_reshardable'",
        ):
            assert needed in message, f"rank {rank}: {message}"
        # Finding "last" verified the step without reading a shard; once found, its commit
        # record said how it was saved, and nothing else of it was opened.
        assert not [f for f in r["finding"] if f.endswith(".distcp")], r["finding"]
        assert r["found"] == ["metadata.json"], f"rank {rank} read {r['found']}"
    assert {p: p.stat().st_mtime_ns for p in step.rglob("*")} == files
