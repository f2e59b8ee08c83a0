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

The matrix (every pair of nodes x persistent saves x scenario is covered; CI runs 2 nodes with
sync saves in every scenario and 3 nodes with async saves, one node wiped and the copies
altered; the other cells run with ``-m nodes_extended``):

- nodes: 2, 3 (x 2 ranks each; R = 1);
- the persistent tier's saves: sync, async;
- the scenario: every directory intact (own copies); one node's directory wiped (a replaced
  node: its ranks read the peer's copy); two nodes wiped (some rank has no copy left: the
  persistent tier, with the warning); a copy torn, or with a flipped byte (that copy is passed
  over: the peer's, or the persistent tier when it was the last one).

A copy fetched from a peer is written into the node's directory while training goes on: the
load does not wait for it (its state file's write is held until training has started).

A failed copy (the peer's directory not writable) leaves the fast step uncounted, on every
rank, and training goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _node_dirs import node_local

from lightning_mcore_ckpt.fast import files
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
    keep: int,
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
    order = _hold_fetched_writes(ckpt_path is not None)

    class Kill(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            resumed["step"] = trainer.global_step

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            order.started.set()  # before the checkpoint's hook: Lightning runs it last
            if kill and trainer.global_step == KILLED_AT:
                checkpoint._fast.report(wait=True)  # fast step KILLED_AT is complete
                Path(shared, f"losses_{rank}.json").write_text(json.dumps(losses))
                os._exit(0)

    checkpoint = MegatronCheckpoint(
        f"{shared}/ckpt",
        every_n_train_steps=PERSIST,
        fast_tier=FastTier(fast_dir, every_n_train_steps=FAST, replicas=1, max_to_keep=keep),
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
        "fetched_writes": list(order),
    }


class _Order(list[str]):
    started: threading.Event


def _hold_fetched_writes(resuming: bool) -> _Order:
    """In a resumed job: each write of a copy fetched from a peer at the recovery into this
    node's directory (its writer thread's: ``peers.AFTER_LOAD``) is noted, the first with
    whether training had started; its state file's write is held until training has started
    (bounded): training does not wait for them."""
    from lightning_mcore_ckpt.fast import peers

    order = _Order()
    order.started = threading.Event()
    if not resuming:
        return order
    write = peers._atomic.write_bytes

    def held(path: Any, data: Any) -> None:
        path = Path(path)
        if threading.current_thread().name != peers.AFTER_LOAD:  # a fast save's copies
            return write(path, data)
        if not order:
            order.append("training started" if order.started.is_set() else "before training")
        if path.name.startswith("state_"):
            order.append("training started" if order.started.wait(60) else "training waited")
        write(path, data)
        order.append(f"wrote {path.name}")
        return None

    peers._atomic.write_bytes = held  # type: ignore[assignment]
    return order


def _launch(
    nodes: int, root: Path, async_save: bool, ckpt_path: str | None, kill: bool, keep: int = 2
) -> Any:
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
        keep,
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
    """Do to the killed job's node directories what ``scenario`` says: wipe nodes 0 (and 1);
    tear rank 2's own file of the newest fast step (on node 1); or flip a byte in it and in its
    copy on the next node, so that no whole copy is left of that step."""
    if scenario in ("one_wiped", "two_wiped"):
        for node in range(1 if scenario == "one_wiped" else 2):
            shutil.rmtree(node_storage(root / "local", node) / "fast")
            (node_storage(root / "local", node) / "fast").mkdir()
    elif scenario == "torn":
        target = _fast_step(root, 1) / "state_00002.pt"
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif scenario == "flipped":
        for node in (1, 2 % nodes):
            target = _fast_step(root, node) / "state_00002.pt"
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0x01
            target.write_bytes(bytes(data))


EXPECTED = {
    "intact": (KILLED_AT, 0),
    "one_wiped": (KILLED_AT, PER_NODE),
    "two_wiped": (PERSISTED, 0),
    "torn": (KILLED_AT, 1),
    "flipped": (KILLED_AT - FAST, 0),
}
"""Per scenario: the step resumed, and how many ranks read another node's copy."""

# CI runs 2 nodes with sync persistent saves, every scenario, and 3 nodes with async ones (a
# peer's copy read around the ring; the only whole copy altered); with the extended cells
# (-m nodes_extended) every pair of values is covered.
CI_CELLS = [
    (2, False, "intact"),
    (2, False, "one_wiped"),
    (2, False, "two_wiped"),
    (2, False, "torn"),
    (2, False, "flipped"),
    (3, True, "one_wiped"),
    (3, True, "flipped"),
]
EXTENDED_CELLS = [
    (2, True, "intact"),
    (2, True, "two_wiped"),
    (2, True, "torn"),
    (2, True, "flipped"),
    (3, True, "intact"),
    (3, True, "torn"),
    (3, False, "two_wiped"),
    (3, False, "torn"),
    (3, False, "flipped"),
]
CELLS = [pytest.param(*c, id=f"{c[0]}nodes-{'async' if c[1] else 'sync'}-{c[2]}") for c in CI_CELLS]
CELLS += [
    pytest.param(
        *c, id=f"{c[0]}nodes-{'async' if c[1] else 'sync'}-{c[2]}", marks=pytest.mark.nodes_extended
    )
    for c in EXTENDED_CELLS
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """Made once per module, as the cells ask: per node count, the uninterrupted run; per
    (nodes, async), the killed run's directories."""
    made: dict[Any, Any] = {}

    def get(key: Any) -> Any:
        if key not in made:
            root = tmp_path_factory.mktemp("run")
            if key[0] == "reference":
                made[key] = _launch(key[1], root, False, None, kill=False)
            else:
                outcomes = _launch(key[1], root, key[2], None, kill=True)
                assert all(o.exit_code == 0 and o.value is None for o in outcomes), outcomes
                made[key] = root
        return made[key]

    return {"get": get}


def _assert_same_run(got: dict[str, Any], ref: dict[str, Any], since: int) -> None:
    assert got["losses"] == {k: v for k, v in ref["losses"].items() if k >= since}
    for name in ("weights", "optim"):
        assert got[name].keys() == ref[name].keys()
        for key, tensor in got[name].items():
            assert torch.equal(tensor, ref[name][key]), (name, key)


def _recoveries(root: Path) -> list[dict[str, Any]]:
    lines = (root / "shared" / "ckpt" / "fast_tier.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "recovery"]


@pytest.mark.parametrize(("nodes", "async_save", "scenario"), CELLS)
def test_resumes_exactly_from_what_survives(
    nodes: int, async_save: bool, scenario: str, runs: dict[str, Any], tmp_path: Path
) -> None:
    ref = runs["get"](("reference", nodes))
    killed = runs["get"](("killed", nodes, async_save))
    for rank in range(nodes * PER_NODE):  # the killed run was the uninterrupted one until then
        before = json.loads((killed / "shared" / f"losses_{rank}.json").read_text())
        want = {k: v for k, v in ref[rank]["losses"].items() if k < KILLED_AT}
        assert {int(k): v for k, v in before.items()} == want
    root = _copy_of(killed, tmp_path / scenario, nodes)
    _damage(root, scenario, nodes)
    resumed = _launch(nodes, root, async_save, "last", kill=False)
    step, from_peers = EXPECTED[scenario]
    for rank, got in enumerate(resumed):
        assert got["resumed"] == step, rank
        _assert_same_run(got, ref[rank], step)
    recovery = _recoveries(root)[-1]
    assert recovery["tier"] == ("persistent" if step == PERSISTED else "fast")
    assert recovery["ranks_from_peers"] == from_peers
    skipped = " ".join(recovery["skipped"])
    if scenario == "two_wiped":  # the warning says why the fast tier could not serve
        assert "no node holds" in skipped, skipped
    if scenario == "flipped":  # no whole copy of rank 2's files: the older fast step
        assert f"fast step {KILLED_AT}: " in skipped and "altered" in skipped, skipped
    if scenario == "torn":  # passed over for the peer's copy, which repaired the node
        assert files.verify(_fast_step(root, 1), 2) is None
    # A copy fetched from a peer is loaded from the bytes received, then written into the
    # node's directory: nothing of it was written before training started (the write does not
    # share the node with the load), training did not wait for its state file (held until
    # then), the seal was written last, and the copy is whole and sealed on the node after.
    fetched = {
        rank: got["fetched_writes"] for rank, got in enumerate(resumed) if got["fetched_writes"]
    }
    assert len(fetched) == from_peers, fetched
    for rank, order in fetched.items():
        state = f"wrote {files.files_of(rank)[0]}"
        assert order[0] == "training started" and state in order, (rank, order)
        assert order[order.index(state) - 1] == "training started", (rank, order)
        assert order[-1] == f"wrote {files.seal_name(rank)}", (rank, order)
        assert files.verify(_fast_step(root, rank // PER_NODE), rank) is None


def test_a_failed_copy_leaves_the_step_uncounted_and_training_goes_on(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """Node 1 cannot keep rank 0's copy of fast step 2 (a directory stands where the file
    goes): step 2 counts on no node, every rank was told why, the next fast step counts, and
    the run is the uninterrupted one."""
    ref = runs["get"](("reference", 2))
    blocked = node_storage(tmp_path / "local", 1) / "fast" / "fast_step_2" / "state_00000.pt"
    blocked.mkdir(parents=True)
    got = _launch(2, tmp_path, False, None, kill=False, keep=END)  # every fast step kept
    for rank in range(2 * PER_NODE):
        _assert_same_run(got[rank], ref[rank], 0)
    saves = [
        json.loads(line)
        for line in (tmp_path / "shared" / "ckpt" / "fast_tier.jsonl").read_text().splitlines()
    ]
    by_step = {r["step"]: r for r in saves if r["kind"] == "fast_save"}
    assert not by_step[2]["complete"]
    assert any("keeping rank 0's copy" in e for e in by_step[2]["errors"]), by_step[2]
    assert all(by_step[s]["complete"] for s in (4, 6))
    for node in (0, 1):
        fast = node_storage(tmp_path / "local", node) / "fast"
        assert not files.is_complete(fast / "fast_step_2")
        assert all(files.is_complete(fast / f"fast_step_{s}") for s in (4, 6, 8))
