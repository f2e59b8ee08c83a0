"""A node that dies silently (its processes stopped, its sockets left open: a power loss, a kernel
panic, a network partition as its peers see it) ends every other rank with an error within the
process group's timeout (``MegatronStrategy(timeout=...)``), not Lightning's 30 minutes.

Two simulated nodes of two ranks (TP=2 inside a node, DP=2 across), a shared checkpoint
directory, saves every 2 steps. One rank SIGSTOPs every process of its node (``stop_node``):
nothing closes, so no survivor learns of it from a socket; the node is SIGKILLed only
:data:`KILL_AFTER_S` later, after every survivor must have ended. Each survivor must have ended
with an error within :data:`BOUND_S` of the stop, and exited (no thread of ours or torch's keeps
it alive): the collective's timeout or, for a survivor waiting in the same collective as one
that timed out a moment before, gloo's "Connection closed by peer" (a gloo rank that times out
closes every connection of that group: the other survivor's wait ends just before its own
timeout would); at least one survivor raised the timeout. "last" stays the previous step and
the step being written never counts.

Axes: where the node goes silent (during a training step, after step 3; inside the sync save of
step 4, a model shard written; during step 4's async write, the commit pending) x which node
(1; 0: global rank 0's, with the rendezvous store). The training step and the sync save on
node 1 run by default; the other cells are marked ``nodes_extended``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from _faulty import FAULT_STEP, events, listing, train
from _node_dirs import node_local

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.testing import RankOutcome, run_nodes

pytestmark = pytest.mark.timeout(600)

NODES, PER_NODE = 2, 2
GROUP_TIMEOUT_S = 30.0
"""``MegatronStrategy(timeout=...)`` here: how long a survivor waits for the silent node (also
what setting up Megatron-Core's groups may take: on two loaded cores, 20 s was once too short)."""
BOUND_S = GROUP_TIMEOUT_S + 25.0
"""A survivor must have raised within this of the stop: the timeout, plus what the error's path
takes on two busy cores (Lightning's exception handling, the logs)."""
KILL_AFTER_S = BOUND_S + 15.0
"""When the silent node is SIGKILLed (its sockets then close): after every survivor's bound, so
that no survivor is ended by a closed socket."""
LAUNCH_S = 400.0
EXTENDED = pytest.mark.nodes_extended
TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")
CLOSED_BY_A_SURVIVOR = re.compile(r"Connection closed by peer")


def _silent(where: str, node: int) -> tuple[str | None, dict[str, Any]]:
    """The fault and the run's options that silence ``node`` ``where``."""
    rank = node * PER_NODE + 1  # not a node's first rank: the whole node goes with any rank
    options: dict[str, Any] = {"tp": PER_NODE, "num_nodes": NODES}
    options["group_timeout_s"] = GROUP_TIMEOUT_S
    if where == "training-step":
        return None, {**options, "stop_node_at": (FAULT_STEP - 1, rank, KILL_AFTER_S)}
    fault = f"model_shards:stop_node{KILL_AFTER_S}@{rank}"
    return fault, {**options, "async_save": where == "async-write"}


def _survivors(
    outcomes: list[RankOutcome], silent: int, run: str
) -> tuple[float, float, list[RankOutcome]]:
    """When the silent node was stopped and when it was killed (``time.monotonic()``), and the
    other ranks' outcomes."""
    gone = [o for o in outcomes if o.node == silent]
    assert all(o.killed and o.ended is not None for o in gone), gone
    killed_at = min(o.ended for o in gone if o.ended is not None)
    # The first stop (two writer threads of the rank may both reach the fault).
    stopped = min(e["monotonic"] for e in events(run) if e["event"] == "stopped")
    return stopped, killed_at, [o for o in outcomes if o.node != silent]


@pytest.mark.parametrize(
    ("where", "node"),
    [
        pytest.param("training-step", 1, id="training-step-node1"),
        pytest.param("sync-save", 1, id="sync-save-node1"),
        pytest.param("async-write", 1, id="async-write-node1", marks=EXTENDED),
        pytest.param("training-step", 0, id="training-step-node0", marks=EXTENDED),
        pytest.param("sync-save", 0, id="sync-save-node0", marks=EXTENDED),
    ],
)
def test_a_silent_node_ends_every_other_rank_within_the_timeout_and_costs_nothing_committed(
    tmp_path: Path, where: str, node: int
) -> None:
    run = str(tmp_path / "run")
    fault, options = _silent(where, node)
    outcomes = run_nodes(
        train,
        NODES,
        PER_NODE,
        run,
        fault,
        options,
        node_dir=node_local(tmp_path / "local"),
        timeout=LAUNCH_S,
        outcomes=True,
    )
    stopped_at, killed_at, survivors = _survivors(outcomes, node, run)
    assert killed_at - stopped_at >= KILL_AFTER_S - 1, (stopped_at, killed_at)
    for o in survivors:
        # Raised the collective's timeout, or the closure by a survivor that timed out first in
        # the same collective (not the silent node's: it was still stopped, see below), within
        # the bound, and its process exited.
        assert o.error is not None, o
        assert TIMED_OUT.search(o.error) or CLOSED_BY_A_SURVIVOR.search(o.error), o
        assert not o.timed_out and o.exit_code == 0, o
        assert o.ended is not None and o.ended - stopped_at < BOUND_S, (o, stopped_at)
        assert o.ended < killed_at, (o, killed_at)
    assert any(TIMED_OUT.search(o.error or "") for o in survivors), survivors
    root = Path(run, "ckpt")
    assert layout.read_tracker(root) == 2  # "last" is still the previous step
    assert [s.step for s in layout.complete_steps(root)] == [2]
    assert set(listing(run)) <= {
        "global_step_2",
        f"global_step_{FAULT_STEP}?",
        "latest_checkpointed_iteration.txt",
    }
