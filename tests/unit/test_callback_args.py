"""MegatronCheckpoint rejects bad arguments at construction, naming the argument and the fix.

Each refusal is a ``ConfigurationError``: a ``ValueError`` and Lightning's
``MisconfigurationException`` (what Lightning's ``ModelCheckpoint`` raises for the same
conditions), so that code written for either catches it.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mcore_ckpt import MegatronCheckpoint


@contextlib.contextmanager
def refused(match: str) -> Iterator[None]:
    """The block raises an error matching ``match`` that is both a ``ValueError`` and Lightning's
    ``MisconfigurationException``."""
    with pytest.raises(MisconfigurationException, match=match) as caught:
        yield
    assert isinstance(caught.value, ValueError), type(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_train_steps": -3}, r"every_n_train_steps=-3\): must be an int >= 0 \(0 disab"),
        ({"every_n_epochs": 1.5}, r"every_n_epochs=1.5\)"),
        ({"max_to_keep": 0}, r"max_to_keep=0\): must be a positive int or None"),
        ({"train_time_interval": datetime.timedelta(seconds=-1)}, r"train_time_interval=.*>= 0"),
        ({"train_time_interval": 60}, r"train_time_interval=60\).*timedelta"),
        (
            {"every_n_train_steps": 10, "every_n_epochs": 1},
            r"every_n_train_steps and every_n_epochs are both set.*keep one",
        ),
        ({"save_contents": ["model", "weights"]}, r"unknown \['weights'\]; choose from"),
        ({"save_contents": "model"}, r"save_contents='model'\): pass a list"),
        ({"save_contents": ["optimizer"]}, r"'model' is required"),
        ({"save_contents": ["model", "model"]}, r"names repeat"),
        ({"save_contents": ["model", "hf_model"]}, r"'hf_model' needs hf_export=HFExport"),
        ({"mode": "best"}, r"mode='best'\): use 'min' or 'max'"),
        ({"save_top_k": -2}, r"save_top_k=-2\)"),
        ({"monitor": ""}, r"monitor=''\)"),
        ({"save_top_k": 2}, r"save_top_k=2\): without a monitor there is nothing to rank"),
        ({"save_last": "link"}, r"save_last='link'\): must be True/False \('link' is not"),
        ({"every_n_train_steps": 5, "train_time_interval": datetime.timedelta(seconds=1)}, r"both"),
        (
            {"save_on_exception": True},
            r"save_on_exception=True\): is not supported: a step is written by every rank "
            r"together.*save_on_preemption=True.*Pass save_on_exception=False",
        ),
        ({"save_on_exception": "yes"}, r"save_on_exception='yes'\): must be True/False"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with refused(match):
        MegatronCheckpoint(tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()  # nothing was created


def test_save_on_exception_false_is_lightnings_default_and_accepted(tmp_path: Path) -> None:
    # A config ported from Lightning that spells out the default keeps working.
    callback = MegatronCheckpoint(tmp_path / "ckpt", save_on_exception=False)
    assert callback.save_on_exception is False and callback.config.save_on_exception is False


def test_dirpath_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_text("x")
    with refused(r"it is a file, not a directory"):
        MegatronCheckpoint(f)


@pytest.mark.parametrize("url", ["memory://run", "gs://b/run", "msc://profile/run"])
def test_url_dirpath_is_refused_and_nothing_is_created(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    match = rf"dirpath='{url}'\): only local directories and s3://bucket/prefix are supported"
    with refused(match):
        MegatronCheckpoint(url)
    assert list(tmp_path.iterdir()) == []


def test_an_s3_dirpath_without_boto3_is_refused_with_the_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    match = r"dirpath='s3://ckpts/run'\): .*boto3.*pip install 'lightning-mcore-ckpt\[s3\]'"
    with pytest.raises(ImportError, match=match):
        MegatronCheckpoint("s3://ckpts/run")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dirpath": "s3://ckpts/run", "durability": "disk"}, r"durability='disk'\): use one of"),
        ({"dirpath": "s3://ckpts/run", "durability": "local"}, r"needs local_dir"),
        ({"dirpath": "s3://ckpts/run", "upload_part_mb": 4}, r"at least 5 MiB"),
        ({"dirpath": "s3://ckpts/run", "upload_concurrency": 0}, r"upload_concurrency=0"),
        ({"dirpath": "s3://ckpts", "overwrite": True}, r"overwrite=True\): is not supported"),
        ({"dirpath": "s3:///run"}, r"names no bucket"),
        ({"dirpath": "local", "durability": "local"}, r"only applies to an s3:// dirpath"),
        ({"dirpath": "local", "local_dir": "x"}, r"only applies to an s3:// dirpath"),
    ],
)
def test_object_store_options_are_checked_before_any_work(
    kwargs: dict[str, object], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("boto3")
    monkeypatch.chdir(tmp_path)
    with refused(match):
        MegatronCheckpoint(**kwargs)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_an_s3_dirpath_stages_steps_in_a_local_tier(tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    import tempfile

    staged = MegatronCheckpoint("s3://ckpts/team/run1", every_n_train_steps=1)
    assert staged.config.root == Path(tempfile.gettempdir()).resolve() / (
        "lightning-mcore-ckpt/ckpts/team/run1"
    )
    assert staged.config.store is not None and staged.config.store.prefix == "team/run1"
    tiered = MegatronCheckpoint("s3://ckpts/run1", local_dir=tmp_path / "tier", durability="local")
    assert tiered.config.root == (tmp_path / "tier").resolve()
    assert not (tmp_path / "tier").exists()  # created at setup, not at construction


def test_tilde_is_expanded_only_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert Path(MegatronCheckpoint("./~/ckpts").dirpath) == tmp_path.resolve() / "~" / "ckpts"
    assert Path(MegatronCheckpoint("~/ckpts").dirpath) == Path.home().resolve() / "ckpts"


@pytest.mark.parametrize(
    ("kwargs", "steps", "epochs", "interval"),
    [
        ({"every_n_train_steps": 0}, 0, 0, None),
        ({"every_n_epochs": 0}, 0, 0, None),
        ({"train_time_interval": datetime.timedelta(0)}, 0, 0, None),
        ({"every_n_train_steps": 0, "every_n_epochs": 0}, 0, 0, None),
        ({"every_n_train_steps": 3, "every_n_epochs": 0}, 3, 0, None),
        ({"every_n_epochs": 2, "train_time_interval": datetime.timedelta(0)}, 0, 2, None),
        ({}, 0, 1, None),  # no cadence at all: every epoch, as in Lightning
    ],
)
def test_zero_disables_a_trigger_as_in_lightning(
    tmp_path: Path, kwargs: dict[str, Any], steps: int, epochs: int, interval: Any
) -> None:
    cb = MegatronCheckpoint(tmp_path, **kwargs)
    assert (cb._every_n_train_steps, cb._every_n_epochs, cb._train_time_interval) == (
        steps,
        epochs,
        interval,
    )


@pytest.mark.parametrize(
    ("kwargs", "top_k"),
    [
        ({}, -1),
        ({"monitor": "loss"}, 1),
        ({"save_top_k": 1}, 1),
        ({"monitor": "l", "save_top_k": 3}, 3),
    ],
)
def test_save_top_k_default(tmp_path: Path, kwargs: dict[str, Any], top_k: int) -> None:
    assert MegatronCheckpoint(tmp_path, **kwargs).save_top_k == top_k


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cb = MegatronCheckpoint("some/dir", every_n_train_steps=5, max_to_keep=2)
    assert cb.save_contents == ("model", "optimizer", "extra")
    assert cb.max_to_keep == 2 and cb.dirpath == str(tmp_path.resolve() / "some" / "dir")


@pytest.mark.parametrize("contents", [["model"], ["model", "optimizer"], ["model", "extra"]])
def test_a_resume_from_steps_that_cannot_resume_training_is_refused_before_any_work(
    tmp_path: Path, contents: list[str]
) -> None:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    trainer = pl.Trainer(
        strategy=MegatronStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        callbacks=[MegatronCheckpoint(tmp_path / "ckpt", save_contents=contents)],
    )
    missing = [c for c in ("optimizer", "extra") if c not in contents]
    with refused(
        rf"resumes training, which needs {missing!r}".replace("[", r"\[").replace("]", r"\]")
    ):
        trainer.fit(TinyGPTModule(), train_dataloaders=[], ckpt_path="last")
    assert not (tmp_path / "ckpt").exists()


PICKLED = {
    "defaults": {},
    "ranked": {"monitor": "val_loss", "mode": "max", "save_top_k": 3, "every_n_train_steps": 5},
    "timed": {"train_time_interval": datetime.timedelta(minutes=30), "save_last": False},
    "store": {"dirpath": "s3://ckpts/run", "every_n_train_steps": 2},
    "preempted": {"every_n_epochs": 2},
}


@pytest.mark.parametrize("case", sorted(PICKLED))
def test_a_pickled_callback_equals_the_original_as_lightnings_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    import pickle
    import signal

    from lightning.pytorch.callbacks import ModelCheckpoint

    options = dict(PICKLED[case])
    if options.get("dirpath", "").startswith("s3://"):
        pytest.importorskip("boto3")
    monkeypatch.chdir(tmp_path)
    options.setdefault("dirpath", tmp_path / "ckpt")
    callback = MegatronCheckpoint(**options)
    if case == "preempted":  # what every rank agreed on travels with it
        callback._preemption.signum = int(signal.SIGTERM)
    copy = pickle.loads(pickle.dumps(callback))
    assert vars(copy) == vars(callback)
    assert copy.state_key == callback.state_key
    assert copy.preempted == callback.preempted == (case == "preempted")
    assert not copy._preemption.installed
    # Lightning's own callback, with the options it shares, compares the same way.
    shared = {k: v for k, v in options.items() if k not in ("dirpath",)}
    lightning = ModelCheckpoint(dirpath=tmp_path / "lightning", **shared)
    assert vars(pickle.loads(pickle.dumps(lightning))) == vars(lightning)
