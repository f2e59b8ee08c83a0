"""Run a function on N real processes with a gloo process group, as a test would.

:func:`run_distributed` is how this package's distributed tests run, and it is public so that
users can test their own LightningModules the same way::

    from lightning_mcore_ckpt.testing import run_distributed

    def body(rank: int, world_size: int, out_dir: str) -> float:
        ...                       # real torch.distributed / Megatron-Core / Lightning code
        return loss

    losses = run_distributed(body, 2, "/tmp/out", timeout=120)   # [loss of rank 0, of rank 1]

The function must be importable (defined at module level) because each rank is a fresh process.
Every rank gets the environment a launcher such as ``torchrun`` would set (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so a Lightning ``Trainer``
inside it joins the group instead of launching processes of its own.

A failure on any rank fails the call with that rank's traceback, and the other ranks, which
would otherwise wait forever in a collective, are killed. So is every rank when ``timeout``
runs out: a distributed test never hangs.

This package is a face; the names live in:

- :mod:`lightning_mcore_ckpt.launch.local`: :func:`run_distributed`,
  :class:`DistributedFailure`, :func:`find_free_port` (the launcher the resume check uses too);
- :mod:`lightning_mcore_ckpt.launch.nodes`: :func:`run_nodes`, several simulated nodes of
  ranks, each with its own directory at the same path, ``TMPDIR`` and host name
  (:func:`node_storage`, :func:`nodes_unavailable`), :func:`kill_node` (a node lost),
  :func:`stop_node` (a node silent, its sockets open) and :class:`RankOutcome` (how each rank ended, for tests of faults);
- :mod:`lightning_mcore_ckpt.testing.gather`: :func:`gather_sharded`, a sharded state dict's
  global tensors on every rank.

The tiny models to train in such a test are in :mod:`lightning_mcore_ckpt.tiny`.
"""

from __future__ import annotations

from lightning_mcore_ckpt.launch.local import DistributedFailure, find_free_port, run_distributed
from lightning_mcore_ckpt.launch.nodes import (
    RankOutcome,
    kill_node,
    node_storage,
    nodes_unavailable,
    run_nodes,
    stop_node,
)
from lightning_mcore_ckpt.testing.gather import gather_sharded

__all__ = [
    "DistributedFailure",
    "RankOutcome",
    "find_free_port",
    "gather_sharded",
    "kill_node",
    "node_storage",
    "nodes_unavailable",
    "run_distributed",
    "run_nodes",
    "stop_node",
]
