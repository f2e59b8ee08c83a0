"""MegatronCheckpoint's options: one documented, typed config, kept once, shown by LightningCLI.

Axes: every option (each constructor argument is a ``CheckpointConfig`` field, same default and
type; each field's documentation is in LightningCLI's ``--help``; none of the callback's own
options is kept outside the config), and every ``Literal`` option with a value outside its
choices (refused by LightningCLI's parser before any run, and by the config at construction).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

from lightning_mcore_ckpt import MegatronCheckpoint
from lightning_mcore_ckpt.callback import CheckpointConfig

# The options Lightning's ModelCheckpoint also takes, and keeps in attributes of its own.
LIGHTNINGS = {
    "dirpath",
    "every_n_train_steps",
    "train_time_interval",
    "every_n_epochs",
    "monitor",
    "save_top_k",
    "mode",
    "save_last",
    "save_on_exception",
    "save_on_train_epoch_end",
    "verbose",
}
FIELDS = [f for f in dataclasses.fields(CheckpointConfig) if f.init]


def _field_docs() -> dict[str, str]:
    docstring_parser = pytest.importorskip("docstring_parser")
    parsed = docstring_parser.parse_from_object(CheckpointConfig)
    return {p.arg_name: " ".join((p.description or "").split()) for p in parsed.params}


def test_the_constructors_arguments_are_the_configs_fields() -> None:
    params = list(inspect.signature(MegatronCheckpoint.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in FIELDS]
    for param, item in zip(params, FIELDS, strict=True):
        default = inspect.Parameter.empty if item.default is dataclasses.MISSING else item.default
        assert param.default == default, item.name
        assert param.annotation == item.type, item.name  # the same Literal, the same hint


def test_each_field_is_documented_in_lightning_clis_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from jsonargparse import ArgumentParser

    docs = _field_docs()
    assert set(docs) >= {f.name for f in FIELDS}
    parser = ArgumentParser()
    parser.add_class_arguments(MegatronCheckpoint, "checkpoint")
    parser.print_help()
    shown = " ".join(capsys.readouterr().out.split())
    for item in FIELDS:
        entry = shown.rsplit(f"--checkpoint.{item.name} ", 1)[1]  # its entry (not the usage)
        first = re.split(r"(?<=[.;:])\s", docs[item.name])[0]
        assert f" {first}" in entry[:400], (item.name, first)


def test_the_callbacks_own_options_are_kept_in_its_config_alone(tmp_path: Path) -> None:
    callback = MegatronCheckpoint(tmp_path / "ckpt", max_to_keep=2, on_save_error="warn")
    own = {f.name for f in FIELDS} - LIGHTNINGS
    assert not own & set(vars(callback)), "an option copied onto the callback"
    for name in own & {n for n, _ in inspect.getmembers(MegatronCheckpoint)}:
        value = getattr(callback, name)
        expected = getattr(callback.config, name)
        assert value == (tuple(expected) if name == "save_contents" else expected), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        callback.config.max_to_keep = 3  # type: ignore[misc]


LITERALS = {
    "mode": "best",
    "on_save_error": "ignore",
    "durability": "disk",
    "save_contents": ["model", "weights"],
}


@pytest.mark.parametrize("name", sorted(LITERALS))
def test_a_value_outside_a_literal_option_is_refused_by_lightning_cli_before_any_run(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from jsonargparse import ArgumentParser

    from lightning_mcore_ckpt.callback import _config

    hint = eval({f.name: f.type for f in FIELDS}[name], vars(_config))
    assert Literal in {get_origin(hint), *map(get_origin, get_args(hint))}, hint
    init: dict[str, Any] = {"dirpath": str(tmp_path / "ckpt"), name: LITERALS[name]}
    config = {"callback": {"class_path": "lightning_mcore_ckpt.MegatronCheckpoint"}}
    config["callback"]["init_args"] = init
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callback", type=MegatronCheckpoint)
    with pytest.raises((SystemExit, argparse.ArgumentError)) as refused:
        parser.parse_object(config)
    bad = LITERALS[name][-1] if isinstance(LITERALS[name], list) else LITERALS[name]
    assert bad in str(refused.value) + capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_every_literal_choice_is_accepted_at_construction(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.callback._config import Mode, OnSaveError

    for mode in get_args(Mode):
        assert MegatronCheckpoint(tmp_path / "a", mode=mode).config.mode == mode
    for choice in get_args(OnSaveError):
        assert MegatronCheckpoint(tmp_path / "b", on_save_error=choice).on_save_error == choice
