"""Several nodes, one shared filesystem: two simulated nodes of two ranks (TP=2 inside a node,
DP=2 across them), the checkpoint directory on a shared path, each node's TMPDIR its own.

Real Trainers on real gloo processes (``run_nodes`` with a ``node_dir``: each node its own
directory at the same path, its own host name), faults where they happen (``_faulty``):

- Lightning sees each rank's node, local rank and global rank as torchrun gives them;
- a node lost during a save (every process of it SIGKILLed while it writes a shard of step 4:
  inside a sync save, or while an async write is in flight): the other node's ranks end with
  the transport's error naming the lost peer (usually at once) or the process group's timeout,
  within what the library promises for a lost node (the timeout and the roll call), and their
  processes exit; "last" stays the previous step and the partial step is never named;
  both nodes then resume bit for bit like an uninterrupted run (losses, weights, optimizer);
- a preemption signal on one node: every rank saves the step it is on and stops; the resume is
  exact;
- one lock for the job: global rank 0 holds it in the shared directory, no node holds one of
  its own, and a second job started on other hosts is refused while the first runs.

Axes: the node lost (0: global rank 0's, with the rendezvous store; 1: another) x the save
(sync; async, the write in flight). Both values of each axis run by default; the other two
pairs are marked ``nodes_extended``, as is the preemption (async or sync saves configured; its
own save is sync either way): its agreement is a collective of the whole group, which
tests/faults/test_preemption.py covers in CI on one node.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _faulty import FAULT_STEP, MAX_STEPS, listing, same_run, train
from _lock_jobs import hold_the_lock, start_another_job
from _node_dirs import node_local

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.storage.lock import LOCK_FILE
from lightning_mcore_ckpt.strategy.roll_call import ROLL_CALL_S, STORE_S
from lightning_mcore_ckpt.testing import RankOutcome, node_storage, run_nodes

pytestmark = pytest.mark.timeout(1200)

NODES, PER_NODE = 2, 2
GROUP_TIMEOUT_S = 60.0
"""The process group's timeout (``MegatronStrategy(timeout=...)``)."""
LOST_BOUND_S = GROUP_TIMEOUT_S + ROLL_CALL_S + STORE_S
"""A survivor of a lost node must have ended within this of the kill: what docs/nodes.md
promises for a lost node, killed or silent (the timeout, then the roll call). A killed node's
closed connections usually end the survivors at once, but not always: gloo can miss a closure
that comes before a receive is posted, and that receive then waits out the timeout (seen on two
loaded cores in about one run in six: every survivor ended 60.2-61.0 s after the kill, at
"Timed out waiting 60000ms for recv operation to complete" in the finalisation's all-reduce)."""
LAYOUT = {"tp": 2, "num_nodes": NODES, "group_timeout_s": GROUP_TIMEOUT_S}
TRACKER = layout.TRACKER_FILE
LAUNCH_S = 900.0
EXTENDED = pytest.mark.nodes_extended

# What gloo says when a peer's connection is gone (its process died): the peer's address and
# the lost connection; or what a collective says when it waited past the group's timeout.
PEER = re.compile(r"\[[\d.]+\]:\d+")
LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection refused")
TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")


def _names_the_lost_peer_or_the_timeout(error: str | None) -> bool:
    lines = (error or "").splitlines()
    return any((PEER.search(x) and LOST.search(x)) or TIMED_OUT.search(x) for x in lines)


def _nodes(fn: Any, *args: Any, local: Path, outcomes: bool = False) -> list[Any]:
    return run_nodes(
        fn, NODES, PER_NODE, *args, node_dir=local, timeout=LAUNCH_S, outcomes=outcomes
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """One uninterrupted run on the two nodes with the same saves: every rank's result, and
    where it ran."""
    tmp = tmp_path_factory.mktemp("reference")
    local = node_local(tmp / "local")
    options = {**LAYOUT, "gather_optimizer": True}
    return _nodes(train, str(tmp / "run"), None, options, local=local), tmp


def _resumes_exactly(resumed: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    for rank, (got, want) in enumerate(zip(resumed, reference, strict=True)):
        same_run(got, want, got["start"])
        assert got["optim"].keys() == want["optim"].keys()
        for key, tensor in want["optim"].items():
            assert torch.equal(got["optim"][key], tensor), (rank, key)


def test_lightning_sees_each_ranks_node_and_the_steps_go_to_the_shared_path(
    reference: tuple[list[dict[str, Any]], Path],
) -> None:
    results, tmp = reference
    # (node rank, local rank, global rank, host name), as Trainer(num_nodes=2, devices=2) has it.
    assert [r["where"] for r in results] == [
        (0, 0, 0, "node0"),
        (0, 1, 1, "node0"),
        (1, 0, 2, "node1"),
        (1, 1, 3, "node1"),
    ]
    assert {r["environment"] for r in results} == {"TorchElasticEnvironment"}
    assert [r["end"] for r in results] == [MAX_STEPS] * 4
    assert listing(tmp / "run") == [f"global_step_{MAX_STEPS}", TRACKER]
    # Nothing of a step, and no lock, on a node's own disk.
    for node in range(NODES):
        own = [p.name for p in node_storage(tmp / "local", node).rglob("*")]
        assert not [n for n in own if n.startswith("global_step_") or n == LOCK_FILE], own


def _lost_and_survivors(outcomes: list[RankOutcome], lost: int) -> tuple[float, list[RankOutcome]]:
    dead = [o for o in outcomes if o.node == lost]
    assert all(o.killed for o in dead), dead
    killed_at = min(o.ended for o in dead if o.ended is not None)
    return killed_at, [o for o in outcomes if o.node != lost]


@pytest.mark.parametrize(
    ("lost", "async_save"),
    [
        pytest.param(1, False, id="node1-sync"),
        pytest.param(0, True, id="node0-async"),
        pytest.param(0, False, id="node0-sync", marks=EXTENDED),
        pytest.param(1, True, id="node1-async", marks=EXTENDED),
    ],
)
def test_a_node_lost_during_a_save_ends_the_others_in_time_and_costs_nothing_committed(
    tmp_path: Path,
    reference: tuple[list[dict[str, Any]], Path],
    lost: int,
    async_save: bool,
) -> None:
    local = node_local(tmp_path / "local")
    run = str(tmp_path / "run")
    options = {**LAYOUT, "async_save": async_save}
    # The lost node's first rank kills its node (launcher, ranks, writers) once one model shard
    # of step 4 is on disk: inside the save (sync), or in the background write (async).
    fault = f"model_shards:kill_node@{lost * PER_NODE}"
    outcomes = _nodes(train, run, fault, options, local=local, outcomes=True)
    killed_at, survivors = _lost_and_survivors(outcomes, lost)
    for o in survivors:
        # Ended (its process exited, nothing hung) with an error that names the lost peer or
        # the timeout, within the timeout and the roll call.
        assert not o.timed_out and o.exit_code == 0, o
        assert _names_the_lost_peer_or_the_timeout(o.error), o.error
        assert o.ended is not None and o.ended - killed_at < LOST_BOUND_S, (o, killed_at)
    waited = [
        o for o in survivors if o.ended is not None and o.ended - killed_at >= GROUP_TIMEOUT_S
    ]
    for o in waited:  # the roll call's note names the lost node
        assert f"node {lost}" in (o.error or "") and "stopped answering" in (o.error or ""), o
    if waited:
        # The first survivor to reach the timeout says so; the others may see its connections
        # closed instead (docs/nodes.md).
        assert any(TIMED_OUT.search(o.error or "") for o in waited), waited
    root = Path(run, "ckpt")
    assert layout.read_tracker(root) == 2  # "last" is still the previous step
    assert [s.step for s in layout.complete_steps(root)] == [2]
    assert f"global_step_{FAULT_STEP}?" in listing(run) or len(listing(run)) == 2
    resumed = _nodes(train, run, None, {**options, "gather_optimizer": True}, local=local)
    assert [r["start"] for r in resumed] == [2] * 4
    _resumes_exactly(resumed, reference[0])
    assert listing(run) == [f"global_step_{MAX_STEPS}", TRACKER]


@pytest.mark.parametrize(
    "async_save",
    [
        pytest.param(True, id="async", marks=EXTENDED),
        pytest.param(False, id="sync", marks=EXTENDED),
    ],
)
def test_a_preempted_node_stops_every_rank_at_a_saved_step_that_resumes_exactly(
    tmp_path: Path, reference: tuple[list[dict[str, Any]], Path], async_save: bool
) -> None:
    local = node_local(tmp_path / "local")
    run = str(tmp_path / "run")
    # SIGTERM to rank 3 (node 1) after step 3, not a save step: every rank stops there.
    options = {**LAYOUT, "async_save": async_save, "signal_at": (3, signal.SIGTERM, 3)}
    stopped = _nodes(train, run, None, options, local=local)
    for r in stopped:
        assert (r["end"], r["preempted"], r["exit_code"]) == (3, True, 143)
    # Saved before stopping; the step before it is kept until a later save's retention.
    assert listing(run) == ["global_step_2", "global_step_3", TRACKER]
    resumed = _nodes(train, run, None, {**LAYOUT, "gather_optimizer": True}, local=local)
    assert [r["start"] for r in resumed] == [3] * 4
    _resumes_exactly(resumed, reference[0])


def test_a_jobs_lock_is_one_for_the_job_and_refuses_a_job_on_other_hosts(tmp_path: Path) -> None:
    """Job A (two nodes, one rank each) holds the shared directory after its first step; job B,
    on hosts node2 and node3, is refused on every rank while A runs; A then finishes."""
    shared = tmp_path / "shared"
    shared.mkdir()
    first: list[Any] = []
    job_a = threading.Thread(
        target=lambda: first.extend(
            run_nodes(
                hold_the_lock,
                2,
                1,
                str(shared),
                node_dir=node_local(tmp_path / "a"),
                timeout=LAUNCH_S,
            )
        )
    )
    job_a.start()
    try:
        deadline = time.monotonic() + LAUNCH_S
        while not all((shared / f"holding-{r}").exists() for r in range(2)):
            assert job_a.is_alive() and time.monotonic() < deadline, "job A did not start"
            time.sleep(0.2)
        second = run_nodes(
            start_another_job,
            2,
            1,
            str(shared),
            node_dir=node_local(tmp_path / "b"),
            hostnames=["node2", "node3"],
            timeout=LAUNCH_S,
        )
    finally:
        (shared / "release").touch()
        job_a.join()
    holder = first[0]["pid"]
    for message in second:
        assert re.search(rf"is in use by another run \(pid {holder} on node0\b", message), message
    # Job A: one lock, global rank 0's (node0), in the shared directory, none on a node's
    # own disk; A went on to the end and let the lock go.
    for seen in first:
        assert (seen["lock"]["host"], seen["lock"]["pid"]) == ("node0", holder)
        assert seen["local_locks"] == []
        assert seen["end"] == 2
    assert not (shared / "ckpt" / LOCK_FILE).exists()
