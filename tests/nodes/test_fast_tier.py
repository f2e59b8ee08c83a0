"""The fast tier on simulated nodes: killed after a fast step newer than the last persistent
one, the job resumes exactly from whatever copies survive.

Each simulated node has its own fast-tier directory (the same path on every node). A job
saves the persistent tier every :data:`PERSIST` steps and the fast tier every :data:`FAST`
steps with one copy of each rank's files on the next node, and is killed (every rank at once,
``os._exit``) right after fast step :data:`KILLED_AT` is complete: the persistent tier's last
step is :data:`PERSISTED`. A copy of what it left on disk is then damaged as each scenario
says, and the job is launched again with ``ckpt_path="last"``; its losses from
:data:`KILLED_AT` + 1 on, and its final weights and optimizer state, must be those of an
uninterrupted run, bit for bit, and the step it resumed must be the one the scenario leaves.

The matrix (every pair of nodes x persistent saves x scenario is covered):

- nodes: 2, 3 (x 2 ranks each; R = 1);
- the persistent tier's saves: sync, async;
- the scenario: every directory intact (own copies); one node's directory wiped (a replaced
  node: its ranks read the peer's copy); two nodes wiped (some rank has no copy left: the
  persistent tier, with the warning); a copy torn, or with a flipped byte (that copy is passed
  over: the peer's, or the persistent tier when it was the last one).

A failed copy (the peer's directory not writable) leaves the fast step uncounted, on every
rank, and training goes on.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _node_dirs import node_local

from lightning_mcore_ckpt.launch.namespaces import node_storage
from lightning_mcore_ckpt.testing import run_nodes

pytestmark = pytest.mark.timeout(900)

PER_NODE = 2
FAST = 2
PERSIST = 5
KILLED_AT = 8
PERSISTED = 5
END = 10


def _job(
    rank: int,
    world_size: int,
    nodes: int,
    shared: str,
    fast_dir: str,
    async_save: bool,
    ckpt_path: str | None,
    kill: bool,
) -> dict[str, Any]:
    """Train to :data:`END` (or be killed after :data:`KILLED_AT`): losses by step, the
    gathered weights and optimizer state at the end, and the step resumed."""
    import lightning.pytorch as pl
    from _trainer import gathered_optimizer, gathered_weights, loader, make_trainer, record_losses

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    module = TinyGPTModule(optimizer="adamw")
    losses = record_losses(module)
    resumed: dict[str, Any] = {}

    class Kill(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            resumed["step"] = trainer.global_step

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if kill and trainer.global_step == KILLED_AT:
                checkpoint._fast.report(wait=True)  # fast step KILLED_AT is complete
                Path(shared, f"losses_{rank}.json").write_text(json.dumps(losses))
                os._exit(0)

    checkpoint = MegatronCheckpoint(
        f"{shared}/ckpt",
        every_n_train_steps=PERSIST,
        fast_tier=FastTier(fast_dir, every_n_train_steps=FAST, replicas=1),
    )
    trainer = make_trainer(
        END,
        MegatronStrategy(ckpt_async_save=async_save),
        PER_NODE,
        num_nodes=nodes,
        callbacks=[checkpoint, Kill()],
        enable_checkpointing=True,
    )
    trainer.fit(module, train_dataloaders=loader(256), ckpt_path=ckpt_path)
    return {
        "losses": losses,
        "weights": gathered_weights(trainer),
        "optim": gathered_optimizer(trainer),
        "resumed": resumed.get("step"),
    }


def _launch(nodes: int, root: Path, async_save: bool, ckpt_path: str | None, kill: bool) -> Any:
    local = node_local(root / "local")
    return run_nodes(
        _job,
        nodes,
        PER_NODE,
        nodes,
        str(root / "shared"),
        str(local / "fast"),
        async_save,
        ckpt_path,
        kill,
        node_dir=local,
        timeout=600,
        outcomes=kill,
    )


def _copy_of(killed: Path, target: Path, nodes: int) -> Path:
    shutil.copytree(killed / "shared", target / "shared")
    for i in range(nodes):
        shutil.copytree(node_storage(killed / "local", i), node_storage(target / "local", i))
    return target


def _fast_step(root: Path, node: int) -> Path:
    return node_storage(root / "local", node) / "fast" / f"fast_step_{KILLED_AT}"


def _damage(root: Path, scenario: str, nodes: int) -> None:
    """Do to the killed job's node directories what ``scenario`` says."""
    if scenario in ("one_wiped", "two_wiped"):
        for node in range(1 if scenario == "one_wiped" else 2):
            shutil.rmtree(node_storage(root / "local", node) / "fast")
            (node_storage(root / "local", node) / "fast").mkdir()
    elif scenario in ("torn", "flipped"):
        # Rank 2's own file (node 1) and, with 2 nodes, its copy on node 0 too when the
        # scenario ends in the persistent tier.
        target = _fast_step(root, 1) / "state_00002.pt"
        data = bytearray(target.read_bytes())
        if scenario == "torn":
            target.write_bytes(bytes(data[: len(data) // 2]))
        else:
            data[len(data) // 2] ^= 0x01
            target.write_bytes(bytes(data))


EXPECTED = {
    "intact": KILLED_AT,
    "one_wiped": KILLED_AT,
    "two_wiped": PERSISTED,
    "torn": KILLED_AT,
    "flipped": KILLED_AT,
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """An uninterrupted run per node count."""
    out = {}
    for nodes in (2,):
        root = tmp_path_factory.mktemp(f"reference_{nodes}")
        out[nodes] = _launch(nodes, root, False, None, kill=False)
    return out


CELLS = [(2, False, "intact"), (2, False, "one_wiped")]


@pytest.mark.parametrize(("nodes", "async_save", "scenario"), CELLS)
def test_resumes_exactly_from_what_survives(
    nodes: int,
    async_save: bool,
    scenario: str,
    reference: dict[int, Any],
    tmp_path: Path,
) -> None:
    killed = tmp_path / "killed"
    outcomes = _launch(nodes, killed, async_save, None, kill=True)
    assert all(o.exit_code == 0 and o.value is None for o in outcomes), outcomes
    ref = reference[nodes]
    for rank in range(nodes * PER_NODE):
        before = json.loads((killed / "shared" / f"losses_{rank}.json").read_text())
        assert {int(k): v for k, v in before.items()} == {
            k: v for k, v in ref[rank]["losses"].items() if k < KILLED_AT
        }
    resumed_root = _copy_of(killed, tmp_path / scenario, nodes)
    _damage(resumed_root, scenario, nodes)
    resumed = _launch(nodes, resumed_root, async_save, "last", kill=False)
    for rank, got in enumerate(resumed):
        assert got["resumed"] == EXPECTED[scenario]
        want = {k: v for k, v in ref[rank]["losses"].items() if k >= EXPECTED[scenario]}
        assert got["losses"] == want
        for name in ("weights", "optim"):
            assert got[name].keys() == ref[rank][name].keys()
            for key, tensor in got[name].items():
                assert torch.equal(tensor, ref[rank][name][key]), (rank, name, key)
