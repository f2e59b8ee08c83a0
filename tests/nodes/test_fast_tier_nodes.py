"""Which nodes the fast tier finds at setup, on simulated nodes (each its own host name).

The nodes are the groups of ranks that see one directory at ``FastTier.dir``:

- nodes of the same number of ranks, each host with a directory of its own there: the tier
  runs, and each fast step is complete on every node (the copies went to the other node);
- nodes of different numbers of ranks: refused at setup, on every rank, before any step, with
  the counts and the fix. Three hosts of one rank, where hosts 0 and 1 see one directory at
  ``dir`` (a mount they share): the tier counts them as one node of 2 ranks and host 2 as a
  node of 1, as it would count 2 + 1 ranks on two machines.

Ranks of one host that see different directories are refused too: that case needs one host
only (``distributed/test_fast_tier_one_node.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.testing import node_storage, run_nodes

pytestmark = pytest.mark.timeout(600)


def _fit(
    rank: int, world_size: int, nodes: int, per_node: int, shared: str, fast: str, steps: int
) -> dict[str, Any]:
    """Fit ``steps`` steps with a fast step at every one (``replicas=1``): the error setup
    raised (``None``: it ran) and the step reached."""
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.errors import ConfigurationError
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    checkpoint = MegatronCheckpoint(
        f"{shared}/ckpt",
        every_n_train_steps=1000,
        save_last=False,
        fast_tier=FastTier(fast, every_n_train_steps=1, replicas=1),
    )
    trainer = make_trainer(
        steps,
        MegatronStrategy(),
        per_node,
        num_nodes=nodes,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    try:
        trainer.fit(TinyGPTModule(), train_dataloaders=loader(64))
    except ConfigurationError as err:
        return {"error": str(err), "step": trainer.global_step}
    return {"error": None, "step": trainer.global_step}


def test_each_host_with_its_own_directory_is_a_node_and_holds_its_peers_copies(
    node_dir: Path, tmp_path: Path
) -> None:
    results = run_nodes(
        _fit, 2, 2, 2, 2, str(tmp_path / "shared"), str(node_dir / "fast"), 2, node_dir=node_dir
    )
    assert results == [{"error": None, "step": 2}] * 4
    for node in (0, 1):  # its own ranks' files and the other node's: complete on both
        step = files.step_dir(node_storage(node_dir, node) / "fast", 1)
        assert files.is_complete(step), step
        assert all(files.verify(step, rank) is None for rank in range(4))


def test_nodes_of_different_numbers_of_ranks_are_refused_on_every_rank_before_any_step(
    node_dir: Path, tmp_path: Path
) -> None:
    shared_mount, own_mount = tmp_path / "mount_0_1", tmp_path / "mount_2"
    for node, target in ((0, shared_mount), (1, shared_mount), (2, own_mount)):
        target.mkdir(exist_ok=True)
        node_storage(node_dir, node).mkdir(parents=True)
        (node_storage(node_dir, node) / "fast").symlink_to(target)
    results = run_nodes(
        _fit, 3, 1, 3, 1, str(tmp_path / "shared"), str(node_dir / "fast"), 2, node_dir=node_dir
    )
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # every rank, the same error
    (error,) = errors
    assert error is not None
    assert "FastTier(dir=" in error and "different numbers of ranks ([2, 1])" in error, error
    assert "Run the same number of ranks on every node" in error
    assert [r["step"] for r in results] == [0, 0, 0]
    assert not list(shared_mount.glob("fast_step_*")) and not list(own_mount.glob("fast_step_*"))
    assert not list((tmp_path / "shared").glob("ckpt/global_step_*"))
