"""Opening a checkpoint never runs code from it: each kind of pickle in a step is checked.

Real files: the step written by 0.1.0 (``tests/compat/fixtures/v0_1``), and copies of it with
one file crafted to run ``touch <marker>`` when unpickled. Every refusal leaves no marker; the
same file loaded the unsafe way creates it, so the files really are what an attacker would send.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from _crafted import crafted_index, globals_in, replace_objects, touching

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp
from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError

STEP = Path(__file__).parents[1] / "compat" / "fixtures" / "v0_1" / "ckpt" / "global_step_4"


@dataclasses.dataclass
class TrainConfig:
    """A user's hyperparameter type."""

    lr: float = 1e-3


@pytest.fixture
def step(tmp_path: Path) -> Path:
    copy = tmp_path / "global_step_4"
    shutil.copytree(STEP, copy)
    return copy


def test_steps_written_by_0_1_pass_every_check() -> None:
    for sub in ("model", "optim"):
        _safe_dcp.check_dist_checkpoint(STEP / sub)
    payload = _safe_load.load_torch_file(STEP / "extra" / "rank_00000.pt")
    assert payload["version"] == 1
    assert payload["rng"]["numpy"][0] == "MT19937"  # format 1: NumPy's tuple, array inside
    assert layout.verify_step(STEP) == []


def test_an_extra_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    rank_file = tmp_path / "rank_00000.pt"
    torch.save({"version": 2, "lightning": {"epoch": 0, "x": touching(marker)}}, rank_file)
    with pytest.raises(UnsafeCheckpointError) as refused:
        _safe_load.load_torch_file(rank_file)
    message = str(refused.value)
    assert str(rank_file) in message and "posix.system" in message
    assert "Nothing of it was unpickled" in message
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in message
    assert not marker.exists()
    # What the refusal prevented: the old load runs the attacker's command.
    torch.load(rank_file, weights_only=False)
    assert marker.exists()


def test_a_dcp_index_that_would_run_code_is_refused_wherever_it_is_read(
    step: Path, tmp_path: Path
) -> None:
    from lightning_mcore_ckpt.hf._reader import SliceReader

    marker = tmp_path / "ran"
    crafted_index(step / "model", marker)
    for read in (
        _safe_dcp.read_dcp_metadata,  # the strategy's shape check
        _safe_dcp.check_dist_checkpoint,  # before every Megatron-Core load
        SliceReader,  # export and verify
    ):
        with pytest.raises(UnsafeCheckpointError, match=r"model/\.metadata: .* posix\.system"):
            read(step / "model")
    # Not damage: "last" does not silently skip it; loading it is refused instead.
    assert layout.verify_step(step) == []
    assert not marker.exists()
    from torch.distributed.checkpoint import FileSystemReader

    with pytest.raises(AttributeError):  # torch's own read: a plain pickle.load, then fails
        FileSystemReader(str(step / "model")).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize("sub", ["model", "optim"])
def test_what_an_index_references_is_read_without_torch_as_torch_reads_it(sub: str) -> None:
    index = _safe_dcp.read_dcp_metadata(STEP / sub)
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    assert _safe_dcp.index_extents(STEP / sub) == needed


def test_an_index_that_would_run_code_is_refused_by_the_reader_without_torch(
    step: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    crafted_index(step / "model", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"model/\.metadata: posix\.system is not"):
        _safe_dcp.index_extents(step / "model")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("sub", "key"),
    [("optim", "common_state"), ("model", "gpt.decoder.layers.mlp.linear_fc1._extra_state")],
    ids=["optimizer-common-state", "module-extra-state"],
)
def test_an_object_in_the_shards_that_would_run_code_is_refused(
    step: Path, tmp_path: Path, sub: str, key: str
) -> None:
    marker = tmp_path / "ran"
    assert replace_objects(step / sub, key, [touching(marker)])
    with pytest.raises(UnsafeCheckpointError, match=rf"{key}.*\(posix\.system\)"):
        _safe_dcp.check_dist_checkpoint(step / sub)
    assert not marker.exists()


def test_records_alike_are_scanned_once_and_a_different_one_among_them_is_refused(
    step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The step's model/ holds 9 object records, 8 of them the same bytes: 2 scans. One of the
    # 8 made to run code is a third distinct record, scanned and refused.
    scans: list[str] = []
    scan = _safe_load.scan

    def counted(f: object, where: str) -> list[str]:
        scans.append(where)
        return scan(f, where)

    monkeypatch.setattr(_safe_load, "scan", counted)
    _safe_dcp.check_dist_checkpoint(step / "model")
    assert len(scans) == 2, scans
    marker = tmp_path / "ran"
    key = "gpt.decoder.layers.mlp.linear_fc1._extra_state/shard_1_"
    assert len(replace_objects(step / "model", key, [touching(marker)])) == 1
    scans.clear()
    with pytest.raises(UnsafeCheckpointError, match=r"linear_fc1\._extra_state/shard_1_"):
        _safe_dcp.check_dist_checkpoint(step / "model")
    assert len(scans) == 3, scans
    assert not marker.exists()


def test_a_common_pt_that_would_run_code_is_refused(step: Path, tmp_path: Path) -> None:
    # megatron-core 0.16 keeps a directory's common state in common.pt.
    marker = tmp_path / "ran"
    torch.save({"args": touching(marker)}, step / "model" / "common.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"common\.pt: it would import posix\.system"):
        _safe_dcp.check_dist_checkpoint(step / "model")
    assert not marker.exists()


def test_a_type_of_the_users_is_refused_with_the_fix_and_loads_once_allowed(
    tmp_path: Path,
) -> None:
    rank_file = tmp_path / "rank_00000.pt"
    torch.save({"lightning": {"hyper_parameters": {"config": TrainConfig()}}}, rank_file)
    name = f"{__name__}.TrainConfig"
    with pytest.raises(UnsafeCheckpointError, match=rf"add_safe_globals\(\[{name}\]\)"):
        _safe_load.load_torch_file(rank_file)
    with torch.serialization.safe_globals([TrainConfig]):
        loaded = _safe_load.load_torch_file(rank_file)
    assert loaded["lightning"]["hyper_parameters"]["config"] == TrainConfig()
    # The user's escape for a checkpoint trusted as a whole: weights_only=False.
    assert _safe_load.load_torch_file(rank_file, trusted=True)["lightning"]


def test_the_save_warning_names_where_refused_objects_sit(tmp_path: Path) -> None:
    payload = {
        "rng": {"torch_cpu": torch.get_rng_state()},
        "lightning": {"hyper_parameters": {"lr": 0.1, "config": TrainConfig()}, "x": [1, 2]},
    }
    rank_file = tmp_path / "rank_00000.pt"
    torch.save(payload, rank_file)
    parts = _safe_load.refused_in_extra(rank_file, payload)
    where = "extra['lightning']['hyper_parameters']['config']"
    assert parts == {where: [f"{__name__}.TrainConfig"]}
    warning = _safe_load.save_warning("extra/rank_00000.pt of each step", parts)
    assert where in warning and f"add_safe_globals([{__name__}.TrainConfig])" in warning
    assert _safe_load.refused_in_extra(rank_file, {"rng": payload["rng"]}) == {}


def test_the_objects_megatron_core_pickles_are_found_where_they_sit_in_a_sharded_dict() -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from lightning_mcore_ckpt.engine._state_dicts import pickled_values, refused_objects

    weight = torch.zeros(4, 4)
    config = TrainConfig()
    ssd = {
        "w": ShardedTensor.from_rank_offsets("w", weight),
        "groups": [{"lr": 0.1, "betas": (0.9, 0.95), "config": config, "name": "a", "x": None}],
        "o": ShardedObject("o", {"inner": [1, config]}, (1,), (0,)),
        "plain": {"step": 3, "t": torch.ones(2), "flag": True},
    }
    found = list(pickled_values(ssd, "optim"))
    assert [where for where, _ in found] == [
        "optim['groups'][0]['config']",
        "optim['o']['inner'][1]",
    ]
    assert [value for _, value in found] == [config, config]
    assert list(pickled_values({"w": ssd["w"], "plain": ssd["plain"]}, "model")) == []
    assert refused_objects(ssd, "optim") == {
        "optim['groups'][0]['config']": [f"{__name__}.TrainConfig"],
        "optim['o']['inner'][1]": [f"{__name__}.TrainConfig"],
    }


def test_the_rng_state_needs_nothing_beyond_torchs_allowlist_and_round_trips(
    tmp_path: Path,
) -> None:
    import random

    import numpy as np

    from lightning_mcore_ckpt.training.rng import RNG_STATE_VERSION, RNGState

    np.random.seed(7)
    np.random.normal()  # a cached Gaussian is part of NumPy's state
    state = RNGState().state_dict()
    expected = (random.random(), np.random.rand(3).tolist(), np.random.normal(), torch.rand(2))
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    assert RNG_STATE_VERSION == 2
    assert not any(g.startswith("numpy") for g in globals_in(path))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    RNGState().load_state_dict(torch.load(path, weights_only=True))
    got = (random.random(), np.random.rand(3).tolist(), np.random.normal(), torch.rand(2))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_allowing_keeps_what_the_user_allowed_before() -> None:
    import numpy as np

    ours = [np.ndarray, TrainConfig]
    before = set(torch.serialization.get_safe_globals())
    with torch.serialization.safe_globals([TrainConfig]):  # the user's own
        with _safe_load.allowing(ours):
            assert set(ours) <= set(torch.serialization.get_safe_globals())
        assert TrainConfig in torch.serialization.get_safe_globals()
    assert set(torch.serialization.get_safe_globals()) == before


def test_a_garbled_index_is_damage_not_a_refusal(step: Path) -> None:
    (step / "model" / ".metadata").write_bytes(pickle.dumps({"a": 1})[:5])
    problems = layout.verify_step(step)
    assert problems and "is unreadable" in problems[0]
    with pytest.raises(Exception) as err:
        _safe_dcp.read_dcp_metadata(step / "model")
    assert not isinstance(err.value, UnsafeCheckpointError)


@pytest.mark.parametrize("hostile", ["../../outside.distcp", "/etc/hostname", "a//b"])
def test_a_shard_name_in_an_index_is_a_path_only_inside_its_directory(
    step: Path, hostile: str
) -> None:
    index = _safe_dcp.read_dcp_metadata(step / "model")
    for key, info in list(index.storage_data.items())[:1]:
        index.storage_data[key] = dataclasses.replace(info, relative_path=hostile)
    with open(step / "model" / ".metadata", "wb") as f:
        pickle.dump(index, f)
    problems = layout.verify_step(step)
    assert any(repr(hostile) in p and "shard list" in p for p in problems), problems


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every index the checking unpickler unpickles from now on (its path)."""
    found: list[Path] = []
    stock = _safe_dcp._load_index

    def counted(f: object, where: object) -> object:
        found.append(Path(str(where)))
        return stock(f, where)  # type: ignore[arg-type]

    monkeypatch.setattr(_safe_dcp, "_load_index", counted)
    return found


def test_a_load_unpickles_each_index_once_and_a_replaced_one_is_checked_again(
    step: Path, tmp_path: Path, parses: list[Path]
) -> None:
    import contextvars
    import os
    import threading

    from torch.distributed.checkpoint import FileSystemReader

    model = step / "model"
    # Outside a load nothing is kept: each read unpickles the file.
    _safe_dcp.read_dcp_metadata(model)
    _safe_dcp.read_dcp_metadata(model)
    assert parses == [model / ".metadata"] * 2
    parses.clear()
    with _safe_dcp.indexes_kept():
        first = _safe_dcp.read_dcp_metadata(model)
        # torch DCP's reader (checked) and a thread started with the load's context: the same
        # object, not another unpickle.
        reader = _safe_dcp.check_reads(FileSystemReader(str(model)), [])
        assert reader.read_metadata() is first
        seen: list[object] = []
        thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(lambda: seen.append(_safe_dcp.read_dcp_metadata(model)),),
        )
        thread.start()
        thread.join()
        assert seen == [first]
        assert parses == [model / ".metadata"]
        assert _safe_dcp.read_dcp_metadata(step / "optim") is not first
        assert parses == [model / ".metadata", step / "optim" / ".metadata"]
        # Replaced during the load: read and checked again, and refused.
        marker = tmp_path / "ran"
        crafted_index(model, marker)
        index = model / ".metadata"
        os.utime(index, ns=(1, 1))  # whatever the clock's resolution: another file
        with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
            _safe_dcp.read_dcp_metadata(model)
        assert parses == [model / ".metadata", step / "optim" / ".metadata", index]
        assert not marker.exists()
    # Trusted reads (the user's choice) are torch's own: never kept, never checked.
    with _safe_dcp.indexes_kept():
        trusted = _safe_dcp.read_dcp_metadata(step / "optim", trusted=True)
        assert _safe_dcp.read_dcp_metadata(step / "optim", trusted=True) is not trusted
    assert parses == [model / ".metadata", step / "optim" / ".metadata", model / ".metadata"]


@pytest.mark.parametrize("sub", ["model", "optim"])
def test_in_a_load_what_an_index_references_comes_from_its_one_checked_read(
    sub: str, parses: list[Path]
) -> None:
    unchecked = _safe_dcp.index_extents(STEP / sub)  # without torch, as `ls` and `report` read
    assert parses == []
    with _safe_dcp.indexes_kept():
        assert _safe_dcp.index_extents(STEP / sub) == unchecked
        index = _safe_dcp.read_dcp_metadata(STEP / sub)
        assert _safe_dcp.index_extents(STEP / sub) == unchecked
    assert parses == [STEP / sub / ".metadata"]
    assert index.storage_data
