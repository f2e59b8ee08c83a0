"""MegatronCheckpoint rejects bad arguments at construction, naming the argument and the fix."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt import MegatronCheckpoint


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_train_steps": 0}, r"every_n_train_steps=0\): must be a positive int"),
        ({"every_n_train_steps": -3}, r"every_n_train_steps=-3\)"),
        ({"every_n_epochs": 1.5}, r"every_n_epochs=1.5\)"),
        ({"max_to_keep": 0}, r"max_to_keep=0\): must be a positive int or None"),
        ({"train_time_interval": datetime.timedelta(0)}, r"train_time_interval=.*positive"),
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
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MegatronCheckpoint(tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()  # nothing was created


def test_dirpath_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"it is a file, not a directory"):
        MegatronCheckpoint(f)


def test_defaults() -> None:
    cb = MegatronCheckpoint("some/dir", every_n_train_steps=5, max_to_keep=2)
    assert cb.save_contents == ("model", "optimizer", "extra")
    assert cb.max_to_keep == 2 and cb.dirpath == Path("some/dir")
