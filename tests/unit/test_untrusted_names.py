"""A name read from outside becomes a path only after it is checked (``safety/names.py``).

Axes: where the name comes from (a commit marker's file list, its hashes, a fast-tier seal on a
node's disk, a seal received from a peer, a Hugging Face index's ``weight_map`` read and
written) x the hostile name (``../`` segments, an absolute path, ``a//b`` that ``pathlib``
makes absolute, ``.`` segments, a backslash, NUL, empty, a symbolic link inside the directory
that leads out). Each refuses the name with an error naming its source, and nothing is read or
written outside the directory. The bucket listing's case runs against the real S3 server in
``tests/storage/test_hostile_listing.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.fast.peers import Bundle
from lightning_mcore_ckpt.format import integrity, layout
from lightning_mcore_ckpt.safety.names import UnsafeNameError, check_name, in_step, inside

HOSTILE = {
    "parent": "../escaped",
    "deep parent": "model/../../escaped",
    "absolute": "/tmp/escaped",
    "double slash": "a//tmp/escaped",
    "dot": "./model/x",
    "trailing slash": "model/",
    "backslash": "..\\escaped",
    "nul": "model/x\x00.distcp",
    "empty": "",
}
PLAIN = ["metadata.json", "model/__0_0.distcp", "extra/rank_00001.pt", "a.b/c..d/.hidden"]


@pytest.mark.parametrize("name", PLAIN)
def test_plain_relative_names_are_taken(tmp_path: Path, name: str) -> None:
    assert check_name(name, "here") == name
    assert inside(tmp_path, name, "here") == tmp_path / name


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_name_is_refused_naming_its_source(tmp_path: Path, kind: str) -> None:
    with pytest.raises(UnsafeNameError, match="the listing of s3://b/run") as err:
        inside(tmp_path / "view", HOSTILE[kind], "the listing of s3://b/run")
    assert repr(HOSTILE[kind]) in str(err.value)


def test_a_name_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(UnsafeNameError, match="not a string"):
        check_name(7, "a seal")


def test_a_symbolic_link_inside_the_directory_that_leads_out_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    view = tmp_path / "view"
    view.mkdir()
    (view / "model").symlink_to(outside)
    with pytest.raises(UnsafeNameError, match="outside"):
        inside(view, "model/__0_0.distcp", "a view")
    (view / "inner").mkdir()
    (view / "link").symlink_to(view / "inner")  # a link that stays inside is a plain directory
    assert inside(view, "link/x", "a view") == view / "link" / "x"


def test_a_marker_names_shared_files_beside_the_step_and_nothing_else_outside(
    tmp_path: Path,
) -> None:
    step = tmp_path / "global_step_4"
    assert in_step(step, "../shared/global_step_2-0.distcp", "m") == (
        tmp_path / "shared" / "global_step_2-0.distcp"
    )
    for name in ("../shared/../x", "../shared/a/b", "../other/x", "../shared/"):
        with pytest.raises(UnsafeNameError):
            in_step(step, name, "m")


# --- a commit marker ---------------------------------------------------------------------------


def _step_with_listed(root: Path, name: str, hashed: bool) -> Path:
    step = root / "run" / "global_step_4"
    (step / "model").mkdir(parents=True)
    (step / "model" / "__0_0.distcp").write_bytes(b"x" * 10)
    meta: dict[str, object] = {"format_version": 2, "global_step": 4, "contents": ["model"]}
    meta["files"] = {"model/__0_0.distcp": 10, name: 5}
    if hashed:
        meta["hashes"] = {name: "0" * 32}
    (step / "metadata.json").write_text(json.dumps(meta))
    return step


@pytest.mark.parametrize("hashed", [False, True], ids=["files", "hashes"])
@pytest.mark.parametrize("kind", ["parent", "absolute", "double slash"])
def test_a_marker_naming_a_file_outside_its_step_is_damage_and_outside_is_never_read(
    tmp_path: Path, kind: str, hashed: bool
) -> None:
    secret = tmp_path / "escaped"  # what '../escaped' from run/ would reach
    secret.write_bytes(b"12345")
    name = HOSTILE[kind] if kind != "parent" else "../../escaped"
    step = _step_with_listed(tmp_path, name, hashed)
    problems = layout.verify_step(step, deep=hashed)
    assert any("refused" in p and repr(name) in p for p in problems), problems
    if hashed:
        found = integrity.check_hashes(step, {name: "0" * 32})
        assert len(found) == 1 and "refused" in found[0]


# --- a fast-tier seal ----------------------------------------------------------------------------


def _sealed(step: Path, rank: int, names: dict[str, bytes]) -> None:
    written = {}
    for name, data in names.items():
        path = step / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written[name] = (len(data), integrity.hash_bytes(data))
    files.write_seal(step, rank, 2, written)


def _hostile_seal(step: Path, rank: int, name: str) -> bytes:
    data = b"payload"
    record = {
        "step": files.step_number(step),
        "rank": rank,
        "world_size": 2,
        "parallel_layout": None,
        "files": {name: {"size": len(data), "digest": integrity.hash_bytes(data)}},
    }
    record[integrity.METADATA_HASH] = integrity.json_digest(record)  # unkeyed: anyone can
    return json.dumps(record).encode()


SEAL_NAMES = {
    "another rank's file": "state_00000.pt",
    "a file no rank has": "notes.txt",
    "parent": "../../escaped",
    "absolute": "{tmp}/escaped",
}


@pytest.mark.parametrize("kind", SEAL_NAMES)
def test_a_seal_received_from_a_peer_naming_a_file_its_rank_may_not_have_writes_nothing(
    tmp_path: Path, kind: str
) -> None:
    step = files.step_dir(tmp_path / "node1", 30)
    step.mkdir(parents=True)
    seal = _hostile_seal(step, 1, SEAL_NAMES[kind].format(tmp=tmp_path))
    bundle = Bundle(seal, [b"payload"])
    with pytest.raises(UnsafeNameError, match="rank 1's seal of fast_step_30"):
        bundle.write(step, 1)
    assert list(step.iterdir()) == []
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize("kind", SEAL_NAMES)
def test_a_seal_on_a_nodes_disk_naming_a_file_its_rank_may_not_have_is_never_held_or_read(
    tmp_path: Path, kind: str
) -> None:
    step = files.step_dir(tmp_path / "node0", 30)
    step.mkdir(parents=True)
    name = SEAL_NAMES[kind].format(tmp=tmp_path)
    target = step / name
    (step / files.seal_name(1)).write_bytes(_hostile_seal(step, 1, name))
    if kind in ("another rank's file", "a file no rank has"):
        target.write_bytes(b"payload")  # present at its sealed size: only the name is wrong
    assert not files.present(step, 1)
    problem = files.verify(step, 1)
    assert problem is not None and "refused" in problem
    assert files.inventory(step.parent, 2)[30]["held"] == []
    with pytest.raises(UnsafeNameError):
        Bundle.read(step, 1)


def test_a_whole_seal_of_the_ranks_own_files_is_taken(tmp_path: Path) -> None:
    step = files.step_dir(tmp_path, 30)
    step.mkdir()
    _sealed(step, 1, {n: os.urandom(64) for n in files.files_of(1)})
    assert files.present(step, 1) and files.verify(step, 1) is None
    assert sorted(files.sealed_paths(step, files.read_seal(step, 1) or {}, 1)) == sorted(
        files.files_of(1)
    )


# --- a Hugging Face index ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parent", "absolute", "double slash"])
def test_a_hugging_face_index_naming_a_file_outside_its_directory_is_refused(
    tmp_path: Path, kind: str
) -> None:
    pytest.importorskip("safetensors")
    from lightning_mcore_ckpt.hf._safetensors import HFReader, safetensors_files

    hf = tmp_path / "hf"
    hf.mkdir()
    index = {"metadata": {}, "weight_map": {"lm_head.weight": HOSTILE[kind]}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafeNameError, match="weight_map"):
        HFReader(hf)
    with pytest.raises(UnsafeNameError, match="weight_map"):
        safetensors_files(hf)
