"""The fast tier's pure logic, without processes: which nodes hold whose copies (``NodeMap``), a
rank's seal and what it proves about its files (``files``), a copy refused when it does not match
its seal (``Bundle.write``), the holders and candidates a recovery weighs (``recovery``), and the
options refused at construction (``FastTier``, ``MegatronCheckpoint(fast_tier=...)``).

The processes, the copies between simulated nodes and the resumes are proven in
``tests/nodes/test_fast_tier.py``.

Axes: nodes 2, 3, 4 x ranks per node 1, 2 x replicas 0 .. nodes-1 x the ranks' placement
(contiguous: node ``r // per``; interleaved: node ``r % nodes``); a copy's damage (none, a file
missing, torn, a flipped byte, the seal missing, torn, altered, or another rank's) x which of a
rank's files it hits.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt import FastTier, MegatronCheckpoint
from lightning_mcore_ckpt.callback.fast_tier import _check_hosts
from lightning_mcore_ckpt.callback.nodes import Sharing
from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.fast.peers import Bundle, NodeMap
from lightning_mcore_ckpt.fast.recovery import _candidates, _holders, _unheld
from lightning_mcore_ckpt.format import integrity

# --- which nodes hold whose copies ----------------------------------------------------------


def _placement(nodes: int, per: int, placement: str) -> list[int]:
    """Each rank's node, ``nodes`` x ``per`` ranks."""
    world = nodes * per
    if placement == "contiguous":
        return [r // per for r in range(world)]
    return [r % nodes for r in range(world)]


def _leaders(node_of: list[int]) -> list[int]:
    """Each rank's directory leader: the lowest rank on its node (as ``leaders_of`` finds)."""
    return [min(r for r, n in enumerate(node_of) if n == node) for node in node_of]


LAYOUTS = [
    (nodes, per, placement)
    for nodes in (2, 3, 4)
    for per in (1, 2)
    for placement in ("contiguous", "interleaved")
    if per > 1 or placement == "contiguous"  # one rank per node: both are the same
]
CASES = [(n, p, where, r) for n, p, where in LAYOUTS for r in range(n)]


def _ids(case: tuple[Any, ...]) -> str:
    nodes, per, where, *replicas = case
    return f"{nodes}x{per}-{where}" + (f"-R{replicas[0]}" if replicas else "")


@pytest.mark.parametrize(("nodes", "per", "placement"), LAYOUTS, ids=map(_ids, LAYOUTS))
def test_node_map_from_leaders_groups_the_ranks_of_each_node(
    nodes: int, per: int, placement: str
) -> None:
    node_of = _placement(nodes, per, placement)
    found = NodeMap.from_leaders(_leaders(node_of))
    assert found.size == nodes
    assert found.uniform()
    # The nodes in the order of their first rank, each node's ranks in order.
    expected = tuple(tuple(r for r, n in enumerate(node_of) if n == node) for node in range(nodes))
    assert found.nodes == expected
    for rank, node in enumerate(node_of):
        assert found.node_of(rank) == node
        assert found.leader(rank) == (rank == expected[node][0])
    assert sum(found.leader(r) for r in range(len(node_of))) == nodes  # one leader a node


@pytest.mark.parametrize(
    "node_of",
    [[0, 0, 0, 1], [0, 0, 1], [0, 1, 1, 1, 2, 2], [0, 1, 0, 1, 0]],
    ids=["3+1", "2+1", "1+3+2", "interleaved-3+2"],
)
def test_node_map_of_uneven_nodes_is_not_uniform(node_of: list[int]) -> None:
    found = NodeMap.from_leaders(_leaders(node_of))
    assert not found.uniform()
    assert sorted(r for ranks in found.nodes for r in ranks) == list(range(len(node_of)))


@pytest.mark.parametrize(("nodes", "per", "placement", "replicas"), CASES, ids=map(_ids, CASES))
def test_each_ranks_copies_are_on_distinct_other_nodes_and_sources_invert_peers(
    nodes: int, per: int, placement: str, replicas: int
) -> None:
    found = NodeMap.from_leaders(_leaders(_placement(nodes, per, placement)))
    world = nodes * per
    held_by: dict[int, list[int]] = {r: [] for r in range(world)}
    for rank in range(world):
        peers = found.peers(rank, replicas)
        assert len(peers) == replicas
        where = [found.node_of(rank)] + [found.node_of(p) for p in peers]
        assert len(set(where)) == 1 + replicas, (rank, peers)  # own node + R other nodes
        # The same rank of each peer node: each node sends and receives the same bytes.
        index = found.nodes[found.node_of(rank)].index(rank)
        assert all(found.nodes[found.node_of(p)].index(p) == index for p in peers)
        for peer in peers:
            held_by[peer].append(rank)
    for rank in range(world):
        # sources is the inverse of peers: rank holds exactly the files of those naming it.
        assert sorted(found.sources(rank, replicas)) == sorted(held_by[rank])
        assert len(found.sources(rank, replicas)) == replicas
        assert found.node_of(rank) not in {found.node_of(s) for s in held_by[rank]}
    # Whatever R nodes are lost, each rank's files are still on a node that is left.
    for lost in itertools.combinations(range(nodes), replicas):
        for rank in range(world):
            holders = {found.node_of(rank)} | {
                found.node_of(p) for p in found.peers(rank, replicas)
            }
            assert holders - set(lost), (rank, lost)


# --- a rank's seal and its files ------------------------------------------------------------


def _write_rank(
    step: Path, rank: int, world: int = 4, seed: int = 0, base: int = 1000
) -> dict[str, bytes]:
    """Rank ``rank``'s two files in ``step`` (about ``base`` bytes each) and their seal, as the
    writer leaves them."""
    contents: dict[str, bytes] = {}
    sealed: dict[str, tuple[int, str]] = {}
    for i, name in enumerate(files.files_of(rank)):
        data = os.urandom(base + 37 * rank + 11 * i + seed)
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_bytes(data)
        contents[name] = data
        sealed[name] = (len(data), integrity.hash_file(step / name))
    files.write_seal(step, rank, world, sealed)
    return contents


def _edit_seal(step: Path, rank: int, edit: Any) -> None:
    path = step / files.seal_name(rank)
    record = json.loads(path.read_bytes())
    edit(record)
    path.write_text(json.dumps(record))


def _damage(step: Path, rank: int, damage: str, which: int) -> None:
    """Damage rank ``rank``'s copy in ``step``; ``which``: the file hit (0 state, 1 extra)."""
    target = step / files.files_of(rank)[which]
    seal = step / files.seal_name(rank)
    if damage == "file missing":
        target.unlink()
    elif damage == "file torn":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "byte flipped":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "seal missing":
        seal.unlink()
    elif damage == "seal torn":
        seal.write_bytes(seal.read_bytes()[:-20])
    elif damage == "seal altered":  # a size edited to match a torn file, the digest left
        name = files.files_of(rank)[which]
        target.write_bytes(target.read_bytes()[:-100])
        _edit_seal(
            step, rank, lambda r: r["files"][name].update(size=r["files"][name]["size"] - 100)
        )
    elif damage == "another rank's seal":  # rank 1's seal under rank's name, rank 1's files
        other = (rank + 1) % 4
        _write_rank(step, other)
        seal.write_bytes((step / files.seal_name(other)).read_bytes())
    else:
        assert damage == "whole"


# damage -> (seal readable, present (sizes only), verify's verdict)
DAMAGES = {
    "whole": (True, True, None),
    "file missing": (True, False, "is missing"),
    "file torn": (True, False, "(torn)"),
    "byte flipped": (True, True, "(altered)"),  # present does not read the bytes: verify does
    "seal missing": (False, False, "is missing, torn or altered"),
    "seal torn": (False, False, "is missing, torn or altered"),
    "seal altered": (False, False, "is missing, torn or altered"),
    "another rank's seal": (True, False, "seals another rank's or step's files"),
}


COPIES = [
    (damage, which)
    for damage in DAMAGES
    for which in (0, 1)
    if which == 0 or damage.startswith("file") or damage in ("byte flipped", "seal altered")
]


@pytest.mark.parametrize(
    ("damage", "which"), COPIES, ids=[f"{d}-{('state', 'extra')[w]}" for d, w in COPIES]
)
def test_a_copy_counts_only_whole_and_unchanged(
    tmp_path: Path, damage: str, which: int, request: pytest.FixtureRequest
) -> None:
    step = files.step_dir(tmp_path, 40)
    step.mkdir()
    rank = 2
    _write_rank(step, rank)
    readable, present, verdict = DAMAGES[damage]
    _damage(step, rank, damage, which)
    record = files.read_seal(step, rank)
    assert (record is not None) == readable
    if record is not None and damage == "whole":
        assert record["step"] == 40 and record["rank"] == rank and record["world_size"] == 4
        assert sorted(record["files"]) == sorted(files.files_of(rank))
    assert files.present(step, rank) == present
    problem = files.verify(step, rank)
    if verdict is None:
        assert problem is None
    else:
        assert problem is not None and verdict in problem, problem
        if damage.startswith("file") or damage == "byte flipped":
            assert str(step / files.files_of(rank)[which]) in problem  # names the file


def test_a_seal_is_written_last_and_holds_its_own_digest(tmp_path: Path) -> None:
    step = files.step_dir(tmp_path, 7)
    step.mkdir()
    _write_rank(step, 0, world=2)
    text = (step / files.seal_name(0)).read_bytes()
    record = json.loads(text)
    assert record[integrity.METADATA_HASH] == integrity.json_digest(record)
    assert files.parse_seal(text) == record
    assert files.parse_seal(text.replace(b'"world_size": 2', b'"world_size": 3')) is None
    # Another rank's seal is no seal of this rank (present, the cheap check, says so).
    assert not files.present(step, 1)
    (step / files.seal_name(1)).write_bytes(text)
    assert not files.present(step, 1)


def test_a_nodes_inventory_lists_the_ranks_sealed_whole_and_the_steps_marked(
    tmp_path: Path,
) -> None:
    layout = {"tensor_model_parallel_size": 1, "data_parallel_size": 4}
    for step in (20, 40):
        path = files.step_dir(tmp_path, step)
        path.mkdir()
        for rank in (0, 1, 3):
            _write_rank(path, rank)
    # Step 40: rank 1's state torn, rank 3's seal gone; only step 20 marked complete.
    _damage(files.step_dir(tmp_path, 40), 1, "file torn", 0)
    _damage(files.step_dir(tmp_path, 40), 3, "seal missing", 0)
    files.mark_complete(files.step_dir(tmp_path, 20), {"step": 20, "world_size": 4})
    (tmp_path / "fast_step_x").mkdir()  # not a step
    (tmp_path / "notes").mkdir()
    found = files.inventory(tmp_path, 4)
    assert sorted(found) == [20, 40]
    assert found[20]["complete"] and found[20]["held"] == [0, 1, 3]
    assert not found[40]["complete"] and found[40]["held"] == [0]
    assert not any(found[s]["foreign"] for s in found)
    # Saved by 2 ranks, or in another layout: not this run's, never held here.
    assert files.inventory(tmp_path, 2)[20] == {"complete": True, "held": [], "foreign": True}
    assert files.inventory(tmp_path, 4, layout)[20]["foreign"]
    files.remove_step(files.step_dir(tmp_path, 20))
    assert sorted(files.inventory(tmp_path, 4)) == [40]
    assert files.inventory(tmp_path / "missing", 4) == {}


# --- a copy received from a peer --------------------------------------------------------------


def _bundle(tmp_path: Path, rank: int = 1) -> Bundle:
    source = files.step_dir(tmp_path / "node0", 40)
    source.mkdir(parents=True)
    _write_rank(source, rank)
    return Bundle.read(source, rank)


def test_a_whole_copy_is_written_with_its_seal_last(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path)
    target = files.step_dir(tmp_path / "node1", 40)
    target.mkdir(parents=True)
    written = bundle.write(target, 1)
    assert written == len(bundle.seal) + sum(len(c) for c in bundle.contents)
    assert files.present(target, 1) and files.verify(target, 1) is None
    assert (target / files.seal_name(1)).read_bytes() == bytes(bundle.seal)


@pytest.mark.parametrize(
    "damage",
    ["first file flipped", "second file flipped", "first file short", "second file short"],
)
def test_a_copy_that_does_not_match_its_seal_is_refused_and_leaves_no_seal(
    tmp_path: Path, damage: str
) -> None:
    bundle = _bundle(tmp_path)
    index = 0 if damage.startswith("first") else 1
    data = bytearray(bundle.contents[index])
    if damage.endswith("flipped"):
        data[7] ^= 0xFF
    else:
        del data[-1]
    bundle.contents[index] = bytes(data)
    target = files.step_dir(tmp_path / "node1", 40)
    target.mkdir(parents=True)
    # An earlier, whole copy of the same step on this node: its seal must not outlive the bad one.
    _write_rank(target, 1, seed=5)
    assert files.present(target, 1)
    with pytest.raises(ValueError, match=r"does not match rank 1's seal"):
        bundle.write(target, 1)
    assert not (target / files.seal_name(1)).exists()
    assert not files.present(target, 1)
    assert files.verify(target, 1) is not None
    bad = target / files.files_of(1)[index]
    assert not bad.exists() or bad.read_bytes() != bytes(data)  # the bad bytes never written


@pytest.mark.parametrize("damage", ["seal altered", "seal torn", "another rank's seal"])
def test_a_copy_whose_seal_is_not_its_ranks_is_refused(tmp_path: Path, damage: str) -> None:
    bundle = _bundle(tmp_path)
    target = files.step_dir(tmp_path / "node1", 40)
    target.mkdir(parents=True)
    if damage == "seal altered":
        bundle.seal = bytes(bundle.seal).replace(b'"world_size": 4', b'"world_size": 8')
        rank = 1
    elif damage == "seal torn":
        bundle.seal = bytes(bundle.seal)[:-10]
        rank = 1
    else:
        rank = 3  # rank 1's files, offered as rank 3's
    with pytest.raises(ValueError, match="torn or altered"):
        bundle.write(target, rank)
    assert list(target.iterdir()) == []


# --- what a recovery weighs --------------------------------------------------------------------


def _inventories(
    found: NodeMap, held: dict[int, set[int]], step: int = 60, complete: bool = True
) -> list[dict[int, Any]]:
    """Each rank's inventory: its node's listing (``held``: per node, whose files it holds)."""
    world = sum(len(n) for n in found.nodes)
    out: list[dict[int, Any]] = []
    for rank in range(world):
        owners = held.get(found.node_of(rank), set())
        out.append({step: {"complete": complete, "held": sorted(owners)}} if owners else {})
    return out


def _as_written(found: NodeMap, replicas: int) -> dict[int, set[int]]:
    """Per node, whose files it holds after a whole fast save: its own ranks' and its sources'."""
    out: dict[int, set[int]] = {}
    for node, ranks in enumerate(found.nodes):
        out[node] = set(ranks) | {s for r in ranks for s in found.sources(r, replicas)}
    return out


@pytest.mark.parametrize(("nodes", "per", "placement", "replicas"), CASES, ids=map(_ids, CASES))
def test_holders_prefer_each_ranks_own_copy_then_its_peers_one_rank_a_node(
    nodes: int, per: int, placement: str, replicas: int
) -> None:
    found = NodeMap.from_leaders(_leaders(_placement(nodes, per, placement)))
    world = nodes * per
    inventories = _inventories(found, _as_written(found, replicas))
    holders = _holders(inventories, found, 60, world, replicas)
    for owner in range(world):
        held = holders[owner]
        assert held[0] == owner  # its own node's copy, read by itself: nothing moves
        assert len(held) == 1 + replicas
        on = [found.node_of(h) for h in held]
        assert on == [found.node_of(owner)] + [
            found.node_of(p) for p in found.peers(owner, replicas)
        ]
        # A rank of its own node is never counted as a source of another copy.
        assert not [h for h in held if h != owner and found.node_of(h) == found.node_of(owner)]
        # Each copy is served by the rank that received it: the node's copies are spread over
        # its ranks, not all sent by one.
        assert held[1:] == found.peers(owner, replicas)
    assert _unheld(holders) is None


@pytest.mark.parametrize(("nodes", "per", "placement", "replicas"), CASES, ids=map(_ids, CASES))
def test_a_wiped_nodes_ranks_are_held_by_their_peers_or_nowhere(
    nodes: int, per: int, placement: str, replicas: int
) -> None:
    found = NodeMap.from_leaders(_leaders(_placement(nodes, per, placement)))
    world = nodes * per
    for wiped in range(nodes):
        held = _as_written(found, replicas)
        held[wiped] = set()
        holders = _holders(_inventories(found, held), found, 60, world, replicas)
        for owner in range(world):
            if found.node_of(owner) != wiped:
                assert holders[owner][0] == owner
                continue
            peers = found.peers(owner, replicas)
            assert [found.node_of(h) for h in holders[owner]] == [found.node_of(p) for p in peers]
        lost = sorted(found.nodes[wiped])
        problem = _unheld(holders)
        if replicas:
            assert problem is None
        else:
            assert problem is not None and str(lost) in problem, problem


def test_a_copy_on_a_same_node_rank_is_the_owners_own(tmp_path: Path) -> None:
    # 2 nodes x 2 ranks: node 0 = ranks 0, 1. Rank 0's own listing is lost (it saw nothing),
    # but its node-mate lists rank 0's files: the same directory, so rank 0 reads them itself.
    found = NodeMap(((0, 1), (2, 3)))
    inventories = _inventories(found, {0: {0, 1}, 1: {2, 3}})
    inventories[0] = {}
    holders = _holders(inventories, found, 60, 4, 1)
    assert holders[0] == [0] and holders[1] == [1]
    assert holders[2] == [2] and holders[3] == [3]


def test_a_rank_held_nowhere_rules_the_step_out_by_name() -> None:
    found = NodeMap(((0, 1), (2, 3), (4, 5)))
    # Node 0 wiped; rank 1's only copy (on node 1) is gone too; rank 0's is on node 1.
    holders = _holders(_inventories(found, {1: {0, 2, 3}, 2: {4, 5}}), found, 60, 6, 1)
    assert holders[1] == []
    assert [found.node_of(h) for h in holders[0]] == [1]
    problem = _unheld(holders)
    assert problem is not None and "rank(s) [1]" in problem
    # A step of which nothing is listed: every rank is unheld.
    problem = _unheld(_holders(_inventories(found, {}), found, 60, 6, 1))
    assert problem is not None and "[0, 1, 2, 3, 4, 5]" in problem


def test_holders_list_other_nodes_after_the_peers() -> None:
    # 3 nodes x 1 rank, R=1: rank 0's peer is node 1, but node 2 holds a copy too (from a run
    # with R=2): own node, then the peer, then the other node.
    found = NodeMap(((0,), (1,), (2,)))
    holders = _holders(_inventories(found, {0: {0}, 1: {0, 1}, 2: {0, 1, 2}}), found, 60, 3, 1)
    assert holders[0] == [0, 1, 2]
    holders = _holders(_inventories(found, {1: {0, 1}, 2: {0, 1, 2}}), found, 60, 3, 1)
    assert holders[0] == [1, 2]


def test_candidates_are_complete_steps_newer_than_the_persistent_one_newest_first() -> None:
    inventories: list[dict[int, Any]] = [
        {20: {"complete": True, "held": [0]}, 40: {"complete": True, "held": [0]}},
        {40: {"complete": False, "held": [1]}, 60: {"complete": False, "held": [1]}},
        {80: {"complete": True, "held": [2]}, 100: {"complete": False, "held": [2]}},
        {},
    ]
    # Marked complete on one node is enough to be weighed (its holders decide); never marked
    # anywhere (60, 100): never a candidate.
    assert _candidates(inventories, None) == [80, 40, 20]
    assert _candidates(inventories, 20) == [80, 40]
    assert _candidates(inventories, 40) == [80]
    assert _candidates(inventories, 80) == []
    assert _candidates([{}, {}], None) == []


# --- the ranks of a host see one directory ------------------------------------------------


@pytest.mark.parametrize(
    "leaders",
    [[0, 0, 2, 2], [0, 0, 0, 0]],
    ids=["a-directory-per-host", "one-directory-shared-by-the-hosts"],
)
def test_hosts_whose_ranks_see_one_directory_are_taken(leaders: list[int]) -> None:
    sharing = Sharing(leaders, ["node0", "node0", "node1", "node1"], ["/dev/shm/run"] * 4)
    _check_hosts(FastTier("/dev/shm/run"), sharing)


def test_ranks_of_one_host_that_see_different_directories_are_refused_naming_them() -> None:
    """Each container's own /dev/shm: one path, a directory per rank, two ranks per host."""
    sharing = Sharing([0, 1, 2, 3], ["node0", "node0", "node1", "node1"], ["/dev/shm/run"] * 4)
    with pytest.raises(ConfigurationError) as err:
        _check_hosts(FastTier("/dev/shm/run"), sharing)
    message = str(err.value)
    assert message.startswith("FastTier(dir='/dev/shm/run'): ranks 0, 1 run on host 'node0' ")
    assert "(and 1 other host(s) alike) but see 2 different directories there" in message
    assert "(rank 0: '/dev/shm/run'; rank 1: '/dev/shm/run')" in message
    assert "Give every rank of a host the same directory" in message


# --- options refused -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dir": "s3://bucket/fast"}, r"FastTier\(dir='s3://bucket/fast'\): must be a local path"),
        ({"dir": "file:///tmp/x"}, r"FastTier\(dir='file:///tmp/x'\): .*not a URL"),
        ({"dir": ""}, r"FastTier\(dir=''\): must be a path"),
        ({"dir": 7}, r"FastTier\(dir=7\): must be a path"),
        ({"replicas": -1}, r"FastTier\(replicas=-1\): must be an int >= 0"),
        ({"replicas": 1.0}, r"FastTier\(replicas=1.0\): must be an int >= 0"),
        ({"every_n_train_steps": 0}, r"FastTier\(every_n_train_steps=0\): must be an int >= 1"),
        ({"every_n_train_steps": True}, r"FastTier\(every_n_train_steps=True\)"),
        ({"max_to_keep": 0}, r"FastTier\(max_to_keep=0\): must be an int >= 1"),
        ({"max_to_keep": None}, r"FastTier\(max_to_keep=None\): must be an int >= 1"),
        ({"timeout_s": 0}, r"FastTier\(timeout_s=0\): must be a number of seconds > 0"),
        ({"timeout_s": -1.5}, r"FastTier\(timeout_s=-1.5\): must be a number of seconds > 0"),
        ({"timeout_s": "60"}, r"FastTier\(timeout_s='60'\): must be a number of seconds"),
        ({"timeout_s": math.nan}, r"FastTier\(timeout_s=nan\): must be a finite number.*600"),
        ({"timeout_s": math.inf}, r"FastTier\(timeout_s=inf\): must be a finite number.*600"),
        ({"timeout_s": -math.inf}, r"FastTier\(timeout_s=-inf\): must be a finite number"),
        ({"timeout_s": 1e300}, r"FastTier\(timeout_s=1e\+300\): is too large.*e\.g\. 600"),
    ],
)
def test_fast_tier_refuses_bad_values_naming_the_argument(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    options = {"dir": str(tmp_path / "fast"), **kwargs}
    with pytest.raises(ConfigurationError, match=match):
        FastTier(**options)


def test_fast_tier_takes_good_values(tmp_path: Path) -> None:
    fast = FastTier(
        tmp_path / "fast", every_n_train_steps=1, replicas=0, max_to_keep=1, timeout_s=0.5
    )
    assert fast.root == tmp_path / "fast"
    assert FastTier("~/fast").root == Path(os.path.expanduser("~/fast"))


@pytest.mark.parametrize("where", ["same", "inside", "parent", "link to it"])
def test_a_fast_tier_overlapping_the_persistent_directory_is_refused(
    tmp_path: Path, where: str
) -> None:
    persistent = tmp_path / "run" / "ckpt"
    persistent.mkdir(parents=True)
    fast = {
        "same": persistent,
        "inside": persistent / "fast",
        "parent": tmp_path / "run",
        "link to it": tmp_path / "link",
    }[where]
    if where == "link to it":
        fast.symlink_to(persistent)
    with pytest.raises(ConfigurationError, match=r"fast_tier=.*overlaps the persistent tier"):
        MegatronCheckpoint(dirpath=persistent, fast_tier=FastTier(fast))


def test_a_fast_tier_beside_the_persistent_directory_is_taken(tmp_path: Path) -> None:
    persistent = tmp_path / "run" / "ckpt"
    callback = MegatronCheckpoint(dirpath=persistent, fast_tier=FastTier(tmp_path / "run" / "f"))
    assert callback.config.fast_tier is not None
    sibling = MegatronCheckpoint(dirpath=persistent, fast_tier=FastTier(str(persistent) + "_fast"))
    assert sibling.config.fast_tier is not None
    with pytest.raises(ConfigurationError, match=r"fast_tier=.*FastTier\(dir=\.\.\.\)"):
        MegatronCheckpoint(dirpath=persistent, fast_tier={"dir": str(tmp_path / "f")})


class _Sent:
    """What :class:`~lightning_mcore_ckpt.fast.peers.Outgoing` hands to ``dist.isend``, in
    order: the bytes of each send (a unit test of the pieces' order, without a process group)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from lightning_mcore_ckpt.fast import peers

        self.sends: list[bytes] = []

        class Done:
            def wait(self) -> None:
                return None

        def isend(tensor: Any, dst: int, group: Any) -> Done:
            self.sends.append(bytes(tensor.numpy().tobytes()))
            return Done()

        monkeypatch.setattr(peers.dist, "isend", isend)
        monkeypatch.setattr(peers, "PIECE", 4)


def test_a_copy_goes_piece_by_piece_as_its_bytes_are_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    # Files of 10, 0 and 5 bytes in pieces of 4: the seal at once; each piece once all its
    # bytes are ready, in order; an empty file sends nothing; a file's pieces only once the
    # file before it has gone whole.
    from lightning_mcore_ckpt.fast.peers import Outgoing

    sent = _Sent(monkeypatch)
    first, third = bytearray(b"abcdefghij"), bytearray(b"vwxyz")
    going = Outgoing(None, 1, b"seal", [10, 0, 5])
    assert sent.sends == [b"seal"]
    going.ready(0, first, 3)  # no whole piece yet
    assert sent.sends == [b"seal"]
    going.ready(0, first, 9)
    assert sent.sends == [b"seal", b"abcd", b"efgh"]
    going.ready(2, third, 5)  # the first file is not whole: nothing of the third goes yet
    assert sent.sends == [b"seal", b"abcd", b"efgh"]
    going.ready(0, first, 10)
    going.ready(2, third, 5)
    assert sent.sends == [b"seal", b"abcd", b"efgh", b"ij", b"vwxy", b"z"]
    going.close()  # everything went: nothing more
    assert len(sent.sends) == 6


def test_a_copy_whose_read_stopped_sends_zeros_for_every_piece_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_mcore_ckpt.fast.peers import Outgoing

    sent = _Sent(monkeypatch)
    going = Outgoing(None, 1, b"seal", [10, 0, 5])
    going.ready(0, bytearray(b"abcdefghij"), 5)
    going.close()
    # The receiver expects 10 + 5 bytes in pieces of 4, 4, 2, 4, 1: what was not read is zeros.
    assert sent.sends == [b"seal", b"abcd", b"\0" * 4, b"\0" * 2, b"\0" * 4, b"\0"]


@pytest.mark.parametrize(
    "announced", [[1, 2, 5, 10, -1], [1, 9, 5, *[1] * 9]], ids=["negative size", "too many files"]
)
def test_a_copy_announced_out_of_bounds_is_refused_before_anything_is_received(
    announced: list[int],
) -> None:
    import torch

    from lightning_mcore_ckpt.fast.peers import Incoming

    header = torch.zeros(11, dtype=torch.int64)
    header[: len(announced[:11])] = torch.tensor(announced[:11])
    with pytest.raises(ValueError, match="rank 3 announced a copy of"):
        Incoming(None, 3, header)


class _Window:
    """A :class:`~lightning_mcore_ckpt.fast.files.Stream` of pieces of ``piece`` bytes, each
    file's own, reusing one buffer: what was handed on, per file."""

    def __init__(self, sizes: list[int], piece: int) -> None:
        self.pieces = [
            [min(piece, size - start) for start in range(0, size, piece)] for size in sizes
        ]
        self.file = 0
        self.memory = bytearray(piece)
        self.handed: list[list[bytes]] = [[] for _ in sizes]

    def window(self) -> memoryview:
        while not self.pieces[self.file]:
            self.file += 1
        return memoryview(self.memory)[: self.pieces[self.file][0]]

    def filled(self, index: int) -> None:
        length = self.pieces[index].pop(0)
        self.handed[index].append(bytes(self.memory[:length]))


PIECE, CUT = 64 << 10, 100_000


@pytest.mark.parametrize("cut", [None, "state", "extra"])
def test_a_streamed_copy_is_handed_on_whole_or_named_torn_where_it_ended(
    tmp_path: Path, cut: str | None
) -> None:
    # A copy streamed to a peer: each piece handed on as it is read; a file cut short while it
    # is read is named, with the bytes it held, once (not the path twice).
    step = files.step_dir(tmp_path, 40)
    step.mkdir()
    contents = _write_rank(step, 2, base=PIECE * 4)  # pieces read past Python's buffer
    record = files.read_seal(step, 2)
    assert record is not None
    names = list(record["files"])  # in the order the seal lists them, which a copy goes in
    sizes = [len(contents[name]) for name in names]
    cut_name = None if cut is None else files.files_of(2)[("state", "extra").index(cut)]
    target = None if cut_name is None else step / cut_name

    def truncate() -> None:
        if target is not None:
            os.truncate(target, CUT)

    stream = _Window(sizes, PIECE)
    if cut_name is not None:
        stream.filled = _cut_on_file(stream, names.index(cut_name), truncate)  # type: ignore[method-assign]
    found = files.stream_checked(step, 2, (step / files.seal_name(2)).read_bytes(), stream)
    if target is None:
        assert found is None
        assert [b"".join(h) for h in stream.handed] == [contents[name] for name in names]
    else:
        size = sizes[names.index(str(cut_name))]
        assert found == f"{target} ended after {CUT} of {size} bytes (torn)"
        assert found.count(str(target)) == 1


def _cut_on_file(stream: _Window, index: int, cut: Any) -> Any:
    """``stream.filled`` that calls ``cut`` once the first piece of file ``index`` has gone."""
    filled = stream.filled

    def first_then_cut(i: int) -> None:
        filled(i)
        if i == index and len(stream.handed[i]) == 1:
            cut()

    return first_then_cut
