"""An object store on nodes that share no file system: each node writes its ranks' files into its
own node-local ``local_dir`` (the same path on every node, different disks) and uploads them
itself; global rank 0 publishes the marker once every node confirmed its part.

Simulated nodes (``run_nodes``: each its own mount namespace) and a real S3 server on loopback.
Axes: the save (sync, async) x how the run ends (it finishes; a node fails mid-upload, then the
same step is saved again) x where it resumes (other nodes, with empty local tiers, reading every
rank's shards from the store), against an uninterrupted run (bit-identical losses and weights);
and what must be refused at setup on every rank (a local ``dirpath`` that is not shared, a
``local_dir`` whose path differs between nodes, ``durability="local"`` on node-local disks).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _s3server import S3Server

from lightning_mcore_ckpt.testing import node_storage, run_nodes

pytestmark = pytest.mark.timeout(600)

NODES, EVERY, TOTAL = 2, 2, 6
LOCAL = "ckpt"  # local_dir, under each node's own directory


@pytest.fixture
def bucket(s3: S3Server) -> Iterator[str]:
    s3.reset()
    name = f"n-{os.urandom(6).hex()}"
    s3.create_bucket(name)
    yield name
    s3.reset()


def _fit(
    rank: int,
    world_size: int,
    src: str,
    url: str | None,
    max_steps: int,
    ckpt_path: str | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    import torch
    from _trainer import gathered_weights, loader, make_trainer, record_losses

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    torch.manual_seed(0)
    module = HFGPTModule(src, dropout=0.1)
    losses = record_losses(module)
    callbacks: list[Any] = []
    if url is not None:
        local = options.get("local_dir", os.path.join(os.environ["TMPDIR"], "..", LOCAL))
        if local == "per-host":  # a common habit: the host name in the path
            local = os.path.join(os.environ["TMPDIR"], "..", socket.gethostname())
        callbacks.append(
            MegatronCheckpoint(
                options.get("dirpath", url),
                every_n_train_steps=EVERY,
                max_to_keep=options.get("max_to_keep", 2),
                upload_part_mb=5,
                local_dir=local if not options.get("dirpath") else None,
                durability=options.get("durability", "store"),
                on_save_error=options.get("on_save_error", "raise"),
            )
        )
    strategy = MegatronStrategy(
        seed=1,
        ckpt_async_save=options.get("async", False),
        tensor_model_parallel_size=options.get("tp", 1),
    )
    trainer = make_trainer(
        max_steps,
        strategy,
        int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        callbacks=callbacks,
        enable_checkpointing=url is not None,
    )
    started = time.monotonic()
    try:
        trainer.fit(module, train_dataloaders=loader(64, 2, shuffle=True), ckpt_path=ckpt_path)
    except Exception as err:  # noqa: BLE001 - what every rank raised, for the test
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - started}
    weights = {k: v.clone() for k, v in gathered_weights(trainer).items()}
    return {
        "losses": losses,
        "weights": weights,
        "failed": callbacks[0].failed_saves if callbacks else 0,
    }


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    path = tmp_path_factory.mktemp("hf") / "src"
    tiny_hf_model(path, family="qwen2")
    return str(path)


@pytest.fixture(scope="module")
def references(src: str) -> dict[tuple[int, int], dict[str, Any]]:
    """The uninterrupted runs, by (ranks per node, TP): the same data and seeds, no
    checkpoint (made once per layout, when a test asks for it)."""
    return {}


def _reference(
    references: dict[tuple[int, int], dict[str, Any]], src: str, per_node: int, tp: int
) -> dict[str, Any]:
    if (per_node, tp) not in references:
        out = run_nodes(_fit, NODES, per_node, src, None, TOTAL + 2, None, {"tp": tp})
        references[per_node, tp] = out[0]
    return references[per_node, tp]


@pytest.fixture(scope="module")
def reference(references: dict[tuple[int, int], dict[str, Any]], src: str) -> dict[str, Any]:
    """2 nodes of 1 rank (DP 2 across them)."""
    return _reference(references, src, 1, 1)


def _objects(s3: S3Server, bucket: str) -> dict[str, int]:
    return s3.objects(bucket, "run/")


def _marker(s3: S3Server, bucket: str, step: int) -> dict[str, Any]:
    body = s3.client().get_object(Bucket=bucket, Key=f"run/global_step_{step}/metadata.json")
    return json.loads(body["Body"].read())  # type: ignore[no-any-return]


def _assert_exact(result: dict[str, Any], reference: dict[str, Any], steps: range) -> None:
    import torch

    for step in steps:
        assert result["losses"][step] == reference["losses"][step], step
    assert result["weights"].keys() == reference["weights"].keys()
    for key, value in reference["weights"].items():
        assert torch.equal(result["weights"][key], value), key


# Ranks per node (1: DP across nodes; 2: TP 2 inside each node, DP across them) x the save.
# CI runs the two cells that cover every value; -m nodes_extended adds the other pairs.
LAYOUTS = [
    pytest.param(1, 1, True, id="1-rank-per-node-async"),
    pytest.param(2, 2, False, id="tp2-in-each-node-sync"),
    pytest.param(1, 1, False, id="1-rank-per-node-sync", marks=pytest.mark.nodes_extended),
    pytest.param(2, 2, True, id="tp2-in-each-node-async", marks=pytest.mark.nodes_extended),
]


@pytest.mark.parametrize("per_node, tp, async_save", LAYOUTS)
def test_each_node_uploads_its_part_and_other_nodes_resume_exactly(
    s3: S3Server,
    bucket: str,
    src: str,
    references: dict[tuple[int, int], dict[str, Any]],
    node_dir: Path,
    per_node: int,
    tp: int,
    async_save: bool,
) -> None:
    reference = _reference(references, src, per_node, tp)
    url = f"s3://{bucket}/run"
    options = {"async": async_save, "tp": tp}
    env = s3.env()
    run_nodes(_fit, NODES, per_node, src, url, TOTAL, None, options, node_dir=node_dir, env=env)
    objects = _objects(s3, bucket)
    # Published: the newest two steps (retention on the store), no node's confirmation left.
    markers = sorted(k for k in objects if k.endswith("/metadata.json") and k.count("/") == 2)
    assert markers == [f"run/global_step_{s}/metadata.json" for s in (TOTAL - EVERY, TOTAL)]
    assert not [k for k in objects if "/.parts/" in k]
    marker = _marker(s3, bucket, TOTAL)
    # Every rank's files are in the step, each uploaded by its own node: node 1's disk holds
    # its ranks' files alone, node 0's the rest.
    listed = set(marker["files"])
    extras = [f"extra/rank_{r:05d}.pt" for r in range(NODES * per_node)]
    assert set(extras) <= listed
    for rel, size in marker["files"].items():
        assert objects[f"run/global_step_{TOTAL}/{rel}"] == size, rel
    node1 = node_storage(node_dir, 1) / LOCAL / f"global_step_{TOTAL}"
    held = {p.relative_to(node1).as_posix() for p in node1.rglob("*") if p.is_file()}
    assert set(extras[per_node:]) <= held
    assert not held & {"metadata.json", "model/.metadata", *extras[:per_node]}
    # Resume on two other nodes whose local tiers are empty: every shard from the store.
    fresh = node_dir.with_name("other-nodes")
    result = run_nodes(
        _fit, NODES, per_node, src, url, TOTAL + 2, "last", options, node_dir=fresh, env=env
    )
    for r in result:
        assert "error" not in r, r
    _assert_exact(result[0], reference, range(TOTAL, TOTAL + 2))


def test_a_node_that_fails_mid_upload_never_makes_last_and_the_step_is_saved_again(
    s3: S3Server, bucket: str, src: str, reference: dict[str, Any], node_dir: Path
) -> None:
    url = f"s3://{bucket}/run"
    env = s3.env()
    failing = 4
    # Node 1's upload of step 4 fails (its rank's files); node 0's part is uploaded.
    s3.faults(fail=rf"/run/global_step_{failing}/.*(__1_\d+\.distcp|rank_00001\.pt)")
    results = run_nodes(_fit, NODES, 1, src, url, TOTAL, None, {}, node_dir=node_dir, env=env)
    for rank, r in enumerate(results):  # every rank raised the same error, naming the node
        assert "error" in r, (rank, r)
        assert f"global_step_{failing}" in r["error"], r["error"]
        assert "the node of rank 1 (node1) failed to upload its part" in r["error"], r["error"]
    objects = _objects(s3, bucket)
    assert f"run/global_step_{failing}/metadata.json" not in objects
    assert any(k.startswith(f"run/global_step_{failing}/") for k in objects)  # node 0's part
    tracker = s3.client().get_object(Bucket=bucket, Key="run/latest_checkpointed_iteration.txt")
    assert tracker["Body"].read().strip() == b"2"
    s3.faults()
    # Resumed from "last" (step 2) on the same nodes: step 4 is saved again. Its first save's
    # objects (node 1's confirmation that it failed among them) are gone before the nodes
    # upload again; else rank 0 would read that failure and fail this save too.
    keep_all = {"max_to_keep": None}
    result = run_nodes(
        _fit, NODES, 1, src, url, TOTAL + 2, "last", keep_all, node_dir=node_dir, env=env
    )
    for r in result:
        assert "error" not in r, r
    _assert_exact(result[0], reference, range(2, TOTAL + 2))
    objects = _objects(s3, bucket)
    for step in range(2, TOTAL + 3, EVERY):
        files = set(_marker(s3, bucket, step)["files"])
        held = {k.split("/", 2)[2] for k in objects if k.startswith(f"run/global_step_{step}/")}
        assert held == files | {"metadata.json"}, step


@pytest.mark.parametrize(
    "options, says",
    [
        ({"dirpath": "node-local"}, "is not shared by every node"),
        ({"local_dir": "per-host"}, "resolve it to different directories"),
        ({"durability": "local"}, "durability='local'"),
    ],
    ids=["local-dirpath-not-shared", "local-dir-per-host", "durability-local"],
)
def test_what_cannot_work_without_a_shared_fs_is_refused_on_every_rank_at_setup(
    s3: S3Server, bucket: str, src: str, node_dir: Path, options: dict[str, Any], says: str
) -> None:
    url = f"s3://{bucket}/run"
    if options.get("dirpath") == "node-local":
        options = {"dirpath": str(node_dir / "run")}
    results = run_nodes(
        _fit, NODES, 1, src, url, TOTAL, None, options, node_dir=node_dir, env=s3.env()
    )
    for rank, r in enumerate(results):
        assert "error" in r and says in r["error"], (rank, r)
        assert r["error"].startswith("ConfigurationError"), r["error"]
        # At setup, not after a hang: far below the process group's timeout (30 minutes).
        assert r["seconds"] < 120, r
    # Refused before anything was written: no object, no step on any node.
    assert not [k for k in _objects(s3, bucket) if "global_step" in k]
    for node in range(NODES):
        assert not list(node_storage(node_dir, node).rglob("global_step_*")), node
