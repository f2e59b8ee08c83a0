"""A node that dies silently (its processes stopped, its sockets left open: a power loss, a kernel
panic, a network partition as its peers see it) ends every other rank with an error within the
process group's timeout (``MegatronStrategy(timeout=...)``), not Lightning's 30 minutes.

Two simulated nodes of two ranks (TP=2 inside a node, DP=2 across), a shared checkpoint
directory, saves every 2 steps. One rank SIGSTOPs every process of its node (``stop_node``):
nothing closes, so no survivor learns of it from a socket; the node is SIGKILLed only once
every survivor has ended (or :data:`KILL_AFTER_S` later, after every survivor must have
ended). Each survivor must have ended with an error within :data:`BOUND_S` of the stop, and
exited (no thread of ours or torch's keeps it alive): the collective's timeout or, for a
survivor waiting in the same collective as one
that timed out a moment before, gloo's "Connection closed by peer" (a gloo rank that times out
closes every connection of that group: the other survivor's wait ends just before its own
timeout would); at least one survivor raised the timeout. Every survivor's error names the
silent node and its host (the strategy's roll call: node 1's ranks did not answer; node 0's
store did not). "last" stays the previous step and the step being written never counts.

Axes: where the node goes silent (during a training step, after step 3; inside the sync save of
step 4, a model shard written; during step 4's async write, the commit pending) x which node
(1; 0: global rank 0's, with the rendezvous store). The training step and the sync save on
node 1 run by default; the other cells are marked ``nodes_extended``.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from _faulty import FAULT_STEP, events, listing, train
from _node_dirs import node_local

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.launch.namespaces import node_storage
from lightning_mcore_ckpt.storage import atomic
from lightning_mcore_ckpt.strategy.roll_call import ROLL_CALL_S, STORE_S
from lightning_mcore_ckpt.testing import RankOutcome, run_nodes

pytestmark = pytest.mark.timeout(600)

NODES, PER_NODE = 2, 2
GROUP_TIMEOUT_S = 30.0
"""``MegatronStrategy(timeout=...)`` here: how long a survivor waits for the silent node (also
what setting up Megatron-Core's groups may take: on two loaded cores, 20 s was once too short)."""
BOUND_S = GROUP_TIMEOUT_S + ROLL_CALL_S + STORE_S + 25.0
"""A survivor must have raised within this of the stop: the timeout and the roll call that names
the silent node, plus what the error's path takes on two busy cores (Lightning's exception
handling, the logs)."""
KILL_AFTER_S = BOUND_S + 15.0
"""When the silent node is SIGKILLed (its sockets then close) at the latest: after every
survivor's bound, so that no survivor is ended by a closed socket. It is killed sooner, as soon
as every survivor has ended (``stop_node(until_others_end=True)``): each must have ended before
it (asserted)."""
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
    # Node 1: its host, from the roll call; node 0: its store did not answer the roll call.
    named = re.compile(
        r"node 1 \(node1\).*stopped answering" if node else r"node 0.*stopped answering"
    )
    assert all(named.search(o.error or "") for o in survivors), [o.error for o in survivors]
    root = Path(run, "ckpt")
    # "last" is still the previous step. Node 0 also runs rank 0's commit thread: silenced
    # before step 2's commit ended (on loaded cores a commit may outlast a step), it leaves
    # step 2 uncommitted too, and "last" names nothing; never a step without its marker.
    # Silenced between step 2's marker and the tracker that follows it, it leaves the tracker
    # behind the marker: "last" is then the scan's newest complete step (layout.resolve_last).
    complete = layout.complete_steps(root)
    committed = [s.step for s in complete]
    assert committed == [2] or (node == 0 and committed == []), committed
    assert layout.resolve_last(root) == (complete[-1].path if complete else None)
    tracked = layout.read_tracker(root)
    if node == 0 and committed:
        assert tracked in (None, committed[-1]), tracked
    else:
        assert tracked == (committed[-1] if committed else None), tracked
    # Global rank 0 holds the directory's lock: silent, then killed, it leaves it (a dead
    # holder's lock, which the next run takes over). Silenced while writing the tracker, it
    # leaves the tracker's temporary file (which the next run's commit removes:
    # test_crash_and_errors.py, "in_tracker").
    lock = {".lightning_mcore_ckpt.lock"} if node == 0 else set()
    left = {p.name for p in atomic.leftovers(root / layout.TRACKER_FILE)}
    assert node == 0 or not left, left
    assert set(listing(run)) <= {
        "global_step_2" if committed else "global_step_2?",
        f"global_step_{FAULT_STEP}?",
        "latest_checkpointed_iteration.txt",
        *lock,
        *left,
    }


# --- a node silent in a wait of ours: the S3 confirmations, the fast tier's copy -------------

SERVICE_STEP = 4
"""The step whose upload (S3) or copy (fast tier) the silent node stops in."""
SERVICE_BOUND_S = {
    # Rank 0's commit waits one timeout for the confirmations; sharing that failure with the
    # other ranks then waits for the silent node once more.
    "s3-confirmations": 2 * GROUP_TIMEOUT_S + ROLL_CALL_S + STORE_S + 25.0,
    "fast-tier-copy": BOUND_S,
}
SERVICE_KILL_AFTER_S = max(SERVICE_BOUND_S.values()) + 15.0


def _service_job(
    rank: int, world_size: int, where: str, shared: str, url: str | None
) -> dict[str, Any]:
    """Two nodes of one rank, saves every 2 steps: ``"s3-confirmations"``, to ``url`` from
    node-local disks (rank 0 waits for node 1's confirmation of its part); ``"fast-tier-copy"``,
    fast saves with one copy on the other node. Node 1 goes silent in that wait's step."""
    import datetime
    import os

    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.fast import writer
    from lightning_mcore_ckpt.storage import node_parts
    from lightning_mcore_ckpt.testing import stop_node
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    def silenced(original: Any, marked: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if rank == 1 and marked in " ".join(map(str, args)):
                from _faulty import EVENTS_FILE  # the event test_silent_node reads

                with open(Path(shared, EVENTS_FILE), "a") as f:
                    f.write(
                        json.dumps(
                            {"event": "stopped", "at": time.time(), "monotonic": time.monotonic()}
                        )
                        + "\n"
                    )
                stop_node(1, SERVICE_KILL_AFTER_S, until_others_end=True)
                time.sleep(SERVICE_KILL_AFTER_S * 2)  # stopped: never reached before the kill
            return original(*args, **kwargs)

        return call

    if where == "s3-confirmations":
        node_parts.upload_part = silenced(node_parts.upload_part, f"global_step_{SERVICE_STEP}")
        local = os.path.join(os.environ["TMPDIR"], "..", "ckpt")
        checkpoint = MegatronCheckpoint(url, every_n_train_steps=2, local_dir=local)
    else:
        writer.FastWriter._copy = silenced(writer.FastWriter._copy, f"fast_step_{SERVICE_STEP}")
        fast = FastTier(os.path.join(os.environ["TMPDIR"], "..", "fast"), every_n_train_steps=2)
        checkpoint = MegatronCheckpoint(f"{shared}/ckpt", every_n_train_steps=5, fast_tier=fast)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    trainer = make_trainer(
        8,
        MegatronStrategy(timeout=timeout),
        1,
        num_nodes=2,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(256), ckpt_path=None)
    return {"end": trainer.global_step}


@pytest.mark.parametrize("where", ["s3-confirmations", "fast-tier-copy"])
def test_a_node_silent_in_our_own_waits_ends_the_other_node_within_the_timeout(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    url, env = None, None
    if where == "s3-confirmations":
        s3 = request.getfixturevalue("s3")
        s3.reset()
        bucket = f"silent-{os.urandom(4).hex()}"
        s3.create_bucket(bucket)
        url, env = f"s3://{bucket}/run", s3.env()
    local = node_local(tmp_path / "local")
    outcomes = run_nodes(
        _service_job,
        2,
        1,
        where,
        str(shared),
        url,
        node_dir=local,
        timeout=LAUNCH_S,
        outcomes=True,
        env=env,
    )
    stopped_at, killed_at, survivors = _survivors(outcomes, 1, str(shared))
    (survivor,) = survivors
    assert survivor.error is not None, survivor
    assert not survivor.timed_out and survivor.exit_code == 0, survivor
    bound = SERVICE_BOUND_S[where]
    assert survivor.ended is not None and survivor.ended - stopped_at < bound, survivor
    assert survivor.ended < killed_at, (survivor, killed_at)
    assert re.search(r"node 1 \(node1\).*stopped answering", survivor.error), survivor.error
    if url is not None:  # the step rank 0 waited for was never published; "last" is step 2
        bucket = url.removeprefix("s3://").split("/")[0]
        objects = request.getfixturevalue("s3").objects(bucket, "run/")
        assert f"run/global_step_{SERVICE_STEP}/metadata.json" not in objects
        assert "run/global_step_2/metadata.json" in objects
    else:  # the fast step whose copy was cut is complete on no node
        for node in (0, 1):
            fast = node_storage(local, node) / "fast"
            assert files.is_complete(fast / "fast_step_2"), node
            assert not files.is_complete(fast / f"fast_step_{SERVICE_STEP}"), node
