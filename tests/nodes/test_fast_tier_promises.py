"""The fast tier's promises, each on simulated nodes, each asserted where it shows: on the nodes'
disks, in the recovery's sources, and in the losses after the resume.

Every run has one rank per node (the cheapest that is still several nodes), a fast step every
:data:`FAST` steps and no persistent step (``save_last=False``, a persistent cadence beyond the
run): what ``fit(ckpt_path="last")`` resumes comes from the fast tier alone. A run of
:data:`END` steps saves fast steps 2, 4 and 6 (the run's last step is not a fast step), keeps
the newest :data:`KEEP`, and leaves its nodes' directories as a job killed after fast step
:data:`NEWEST` would. Those directories are then copied, damaged as a cell says, and resumed;
"exact" means the losses of every step after the resume are those of the uninterrupted run, and
so are the final weights, bit for bit.

The axes:

- one holder's copy altered (a flipped byte, the other holder's copy intact): which rank's copy
  (rank 1's state file; rank 0's extra file, ``nodes_extended``). The step is still resumed,
  exactly, from the other holder's copy, which repairs the altered one;
- ``replicas=2`` on 4 nodes, two neighbouring nodes wiped: which two (0 and 1; 3 and 0 around
  the ring, ``nodes_extended``). Every rank's files survive on a third node: exact resume;
- retention, on disk: each node holds exactly the :data:`KEEP` newest complete fast steps
  (``max_to_keep``); a resume from an older step (the newest altered on every holder, and an
  uncounted newer step left by a cut-short save) deletes, on every node, the steps newer than
  the one resumed and nothing else;
- a job killed (SIGKILL, every rank at the same point) during fast step :data:`NEWEST`'s save:
  during the write of a rank's own files, or during the copies to its peer (the copies' files
  written, their seals not). That step never counts: the next ``fit(ckpt_path="last")`` resumes
  the previous complete one exactly, and drops the cut-short step's files on every node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _node_dirs import node_local

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.launch.namespaces import node_storage
from lightning_mcore_ckpt.testing import run_nodes

pytestmark = pytest.mark.timeout(900)

FAST = 2
END = 8
KEEP = 2
NEWEST = 6
"""The newest fast step a run of :data:`END` steps saves."""
OLDER = NEWEST - FAST


def _job(
    rank: int,
    world_size: int,
    replicas: int,
    shared: str,
    fast_dir: str,
    ckpt_path: str | None,
    kill_at: str | None,
) -> dict[str, Any]:
    """Train to :data:`END`, or be killed at ``kill_at`` (``"write"``, ``"copy"``) of fast step
    :data:`NEWEST`: the losses by step, the final weights, the step training started from, the
    recovery's sources and what the node's fast directory held right after the recovery."""
    import lightning.pytorch as pl
    from _trainer import gathered_weights, loader, make_trainer, record_losses

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.callback import fast_tier
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    if kill_at is not None:
        _inject_kill(kill_at, Path(shared), world_size)
    seen: dict[str, Any] = {}
    recover = fast_tier.recover

    def recovering(*args: Any, **kwargs: Any) -> Any:
        found = recover(*args, **kwargs)
        seen["sources"] = dict(found.sources)
        seen["after_recovery"] = _tree(fast_dir)
        return found

    fast_tier.recover = recovering  # type: ignore[assignment]
    module = TinyGPTModule(optimizer="adamw")
    losses = record_losses(module)

    class Started(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["resumed"] = trainer.global_step

    checkpoint = MegatronCheckpoint(
        f"{shared}/ckpt",
        every_n_train_steps=1000,
        save_last=False,
        fast_tier=FastTier(fast_dir, every_n_train_steps=FAST, replicas=replicas, max_to_keep=KEEP),
    )
    trainer = make_trainer(
        END,
        MegatronStrategy(),
        1,
        num_nodes=world_size,
        callbacks=[checkpoint, Started()],
        enable_checkpointing=True,
    )
    trainer.fit(module, train_dataloaders=loader(128), ckpt_path=ckpt_path)
    return {"losses": losses, "weights": gathered_weights(trainer), **seen}


def _inject_kill(point: str, shared: Path, world_size: int) -> None:
    """SIGKILL every rank at ``point`` of fast step :data:`NEWEST`'s save, at once, when every
    rank has reached it (so that no rank ends otherwise, of a peer's death):

    - ``"write"``: as the rank writes its extra file (its state file written, nothing sealed);
    - ``"copy"``: as the rank seals the copy it received from its peer (the copy's files
      written on its node, every rank's own files sealed on their own node)."""
    from lightning_mcore_ckpt.fast import peers, writer
    from lightning_mcore_ckpt.format.layout import EXTRA_DIR
    from lightning_mcore_ckpt.storage import atomic

    def die() -> None:
        # The rank that finds every rank there kills them all at once (a peer's death seen by
        # a rank still polling could end it otherwise); after a minute each kills itself.
        atomic.write_bytes(shared / f"at_{point}_{os.environ['RANK']}", str(os.getpid()).encode())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            there = list(shared.glob(f"at_{point}_*"))
            if len(there) == world_size:
                for pid in {int(p.read_text()) for p in there} - {os.getpid()}:
                    os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)

    def ours(path: Path) -> bool:
        step = path.parent.parent if path.parent.name == EXTRA_DIR else path.parent
        return files.step_number(step) == NEWEST

    if point == "write":
        write_payload = writer.write_payload

        def killing_write(path: Path, payload: Any) -> Any:
            if ours(path) and path.parent.name == EXTRA_DIR:
                die()
            return write_payload(path, payload)

        writer.write_payload = killing_write  # type: ignore[assignment]
    else:

        def killing_seal(path: Path, data: Any) -> None:
            if ours(path) and path.name.startswith("seal_"):
                die()
            atomic.write_bytes(path, data)

        peers._atomic = SimpleNamespace(write_bytes=killing_seal)  # type: ignore[assignment]


def _tree(root: str | Path) -> dict[str, int]:
    """Every file under ``root``, by relative path: its size. Taken right after a recovery,
    while the thread that writes a fetched peer's copy may still run: a file or directory that
    goes while it is listed (that thread's temporary file, renamed into place) is left out."""
    root = Path(root)
    tree = {}
    for parent, _, names in os.walk(root):  # a directory gone while walked: skipped
        for name in names:
            path = Path(parent, name)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            tree[str(path.relative_to(root))] = size
    return tree


def _step_of(path: str) -> int | None:
    """The fast step a path of :func:`_tree` lies in (``None``: none)."""
    return files.step_number(path.split("/", 1)[0]) if "/" in path else None


def _launch(
    nodes: int,
    root: Path,
    ckpt_path: str | None,
    replicas: int = 1,
    kill_at: str | None = None,
) -> Any:
    local = node_local(root / "local")
    return run_nodes(
        _job,
        nodes,
        1,
        replicas,
        str(root / "shared"),
        str(local / "fast"),
        ckpt_path,
        kill_at,
        node_dir=local,
        timeout=600,
        outcomes=kill_at is not None,
    )


def _fast(root: Path, node: int) -> Path:
    return node_storage(root / "local", node) / "fast"


def _copy_of(run: Path, target: Path, nodes: int) -> Path:
    shutil.copytree(run / "shared", target / "shared")
    for node in range(nodes):
        shutil.copytree(node_storage(run / "local", node), node_storage(target / "local", node))
    return target


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _recovery(root: Path) -> dict[str, Any]:
    lines = (root / "shared" / "ckpt" / "fast_tier.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "recovery"][-1]


def _assert_exact(got: list[dict[str, Any]], ref: list[dict[str, Any]], step: int) -> None:
    """Every rank started from ``step`` and ran on as the uninterrupted run did."""
    for rank, (mine, theirs) in enumerate(zip(got, ref, strict=True)):
        assert mine["resumed"] == step, rank
        assert mine["losses"] == {k: v for k, v in theirs["losses"].items() if k >= step}, rank
        assert mine["weights"].keys() == theirs["weights"].keys()
        for key, tensor in mine["weights"].items():
            assert torch.equal(tensor, theirs["weights"][key]), (rank, key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Made once per module, as the tests ask: per node count (and ``replicas``), the
    uninterrupted run: what each rank returned, and its directories."""
    made: dict[tuple[int, int], tuple[list[dict[str, Any]], Path]] = {}

    def get(nodes: int, replicas: int = 1) -> tuple[list[dict[str, Any]], Path]:
        if (nodes, replicas) not in made:
            root = tmp_path_factory.mktemp(f"run{nodes}x{replicas}")
            made[nodes, replicas] = (_launch(nodes, root, None, replicas), root)
        return made[nodes, replicas]

    return get


def test_each_node_keeps_exactly_the_newest_complete_fast_steps(runs: Any) -> None:
    _, root = runs(2)
    kept = list(range(FAST, END, FAST))[-KEEP:]
    for node in (0, 1):
        fast = _fast(root, node)
        assert files.steps(fast) == kept, (node, files.steps(fast))
        for step in kept:  # complete, with both ranks' files whole: its own and its peer's
            assert files.is_complete(files.step_dir(fast, step)), (node, step)
            assert all(files.verify(files.step_dir(fast, step), r) is None for r in (0, 1))


ALTERED = [
    pytest.param(1, 0, id="rank1-state"),
    pytest.param(0, 1, id="rank0-extra", marks=pytest.mark.nodes_extended),
]


@pytest.mark.parametrize(("owner", "which"), ALTERED)
def test_one_altered_copy_is_served_from_the_other_holder_exactly(
    owner: int, which: int, runs: Any, tmp_path: Path
) -> None:
    """A byte flipped in ``owner``'s own copy of the newest step (its own node, the first
    holder tried); the peer node's copy is intact."""
    ref, run = runs(2)
    root = _copy_of(run, tmp_path / "altered", 2)
    peer = 1 - owner
    altered = files.step_dir(_fast(root, owner), NEWEST) / files.files_of(owner)[which]
    _flip(altered)
    assert files.verify(files.step_dir(_fast(root, owner), NEWEST), owner) is not None
    got = _launch(2, root, "last")
    _assert_exact(got, ref, NEWEST)
    for rank in (0, 1):  # the altered copy was passed over for the peer node's, on every rank
        assert got[rank]["sources"] == {owner: peer, peer: peer}, got[rank]["sources"]
    recovery = _recovery(root)
    assert (recovery["tier"], recovery["step"]) == ("fast", NEWEST)
    assert recovery["ranks_from_peers"] == 1 and recovery["skipped"] == [], recovery
    for node in (0, 1):  # the owner's node holds the peer's good copy again; both are whole
        assert files.verify(files.step_dir(_fast(root, node), NEWEST), owner) is None, node


WIPED = [
    pytest.param((0, 1), id="nodes0-1"),
    pytest.param((3, 0), id="nodes3-0", marks=pytest.mark.nodes_extended),
]


@pytest.mark.parametrize("wiped", WIPED)
def test_two_replicas_survive_two_neighbouring_nodes_wiped(
    wiped: tuple[int, int], runs: Any, tmp_path: Path
) -> None:
    """``replicas=2`` on 4 nodes: rank ``n``'s copies are on nodes ``n+1`` and ``n+2``, so
    each wiped node's rank reads node ``first + 2``'s copy (the first node not wiped)."""
    ref, run = runs(4, 2)
    root = _copy_of(run, tmp_path / "wiped", 4)
    for node in wiped:
        shutil.rmtree(_fast(root, node))
        _fast(root, node).mkdir()
    got = _launch(4, root, "last", replicas=2)
    _assert_exact(got, ref, NEWEST)
    survivor = (wiped[0] + 2) % 4
    want = {r: survivor if r in wiped else r for r in range(4)}
    assert all(g["sources"] == want for g in got), [g["sources"] for g in got]
    recovery = _recovery(root)
    assert (recovery["tier"], recovery["step"], recovery["ranks_from_peers"]) == (
        "fast",
        NEWEST,
        2,
    ), recovery
    for node in wiped:  # repopulated with its own ranks' files as it resumed
        assert files.verify(files.step_dir(_fast(root, node), NEWEST), node) is None


def test_a_resume_from_an_older_step_drops_only_the_newer_steps_on_every_node(
    runs: Any, tmp_path: Path
) -> None:
    """The newest step altered on both holders of rank 0's files, and an uncounted step newer
    still (a save cut short: rank 1's files only, unmarked) on every node: the older kept step
    is resumed exactly, and each node then holds what it held less those two steps."""
    ref, run = runs(2)
    root = _copy_of(run, tmp_path / "older", 2)
    cut_short = NEWEST + 1
    before = {}
    for node in (0, 1):
        fast = _fast(root, node)
        _flip(files.step_dir(fast, NEWEST) / files.files_of(0)[0])
        newer = files.step_dir(fast, cut_short)
        newer.mkdir()
        for name in (*files.files_of(1), files.seal_name(1)):
            (newer / name).parent.mkdir(exist_ok=True)
            (newer / name).write_bytes(b"cut short")
        before[node] = _tree(fast)
    got = _launch(2, root, "last")
    _assert_exact(got, ref, OLDER)
    for node in (0, 1):
        want = {p: size for p, size in before[node].items() if (_step_of(p) or 0) <= OLDER}
        assert got[node]["after_recovery"] == want, node
    recovery = _recovery(root)
    assert (recovery["tier"], recovery["step"]) == ("fast", OLDER), recovery
    assert any(f"fast step {NEWEST}: " in s and "altered" in s for s in recovery["skipped"])


@pytest.mark.parametrize("point", ["write", "copy"])
def test_a_job_killed_during_a_fast_save_resumes_the_previous_step_exactly(
    point: str, runs: Any, tmp_path: Path
) -> None:
    """Every rank SIGKILLed at ``point`` of fast step :data:`NEWEST`'s save: that step never
    counts, the next fit resumes :data:`OLDER` exactly, and the cut-short step's files are gone
    from every node as it resumes."""
    ref, _ = runs(2)
    killed = _launch(2, tmp_path, None, kill_at=point)
    assert all(o.exit_code == -signal.SIGKILL for o in killed), killed
    for node in (0, 1):  # killed where it was meant to be; the step is complete nowhere
        step, peer = files.step_dir(_fast(tmp_path, node), NEWEST), 1 - node
        assert not files.is_complete(step), node
        if point == "write":  # its state file written, nothing sealed, nothing copied
            assert (step / files.files_of(node)[0]).is_file(), node
            assert not list(step.glob("seal_*")), node
        else:  # its own files sealed; the peer's copy written, unsealed
            assert files.present(step, node), node
            assert (step / files.files_of(peer)[0]).is_file(), node
            assert not (step / files.seal_name(peer)).exists(), node
    got = _launch(2, tmp_path, "last")
    _assert_exact(got, ref, OLDER)
    for node in (0, 1):  # right after the recovery: the complete steps it kept, nothing newer
        held = {_step_of(p) for p in got[node]["after_recovery"]}
        assert held == {OLDER - FAST, OLDER}, (node, held)
    recovery = _recovery(tmp_path)
    assert (recovery["tier"], recovery["step"], recovery["skipped"]) == ("fast", OLDER, [])
