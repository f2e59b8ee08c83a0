"""The public classes are constructible from YAML by LightningCLI's jsonargparse."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import yaml


def test_strategy_and_callback_with_a_nested_hf_export_come_from_yaml(tmp_path: Path) -> None:
    from jsonargparse import ArgumentParser

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src")
    config = yaml.safe_load(
        f"""
        strategy:
          class_path: lightning_mcore_ckpt.MegatronStrategy
          init_args:
            tensor_model_parallel_size: 2
            ckpt_async_save: true
            init_from: {src}
        callback:
          class_path: lightning_mcore_ckpt.MegatronCheckpoint
          init_args:
            dirpath: {tmp_path / "ckpt"}
            every_n_train_steps: 100
            save_contents: [model, optimizer, extra]
            on_save_error: warn
            hf_export:
              hf_model_path: {src}
              when: end
              dtype: torch.bfloat16
        """
    )
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=MegatronStrategy)
    parser.add_argument("--callback", type=MegatronCheckpoint)
    built = parser.instantiate_classes(parser.parse_object(config))
    assert built.strategy.tensor_model_parallel_size == 2 and built.strategy.ckpt_async_save
    assert built.strategy.init_from == src
    assert built.callback.on_save_error == "warn"
    assert built.callback.hf_export == HFExport(str(src), when="end", dtype=torch.bfloat16)


def test_every_export_kind_is_a_field_of_hf_export_in_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from jsonargparse import ArgumentParser

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src")
    config = yaml.safe_load(
        f"""
        callback:
          class_path: lightning_mcore_ckpt.MegatronCheckpoint
          init_args:
            dirpath: {tmp_path / "ckpt"}
            hf_export:
              hf_model_path: {src}
              head: value
              check_logits: true
              adapters: peft
              upload_to: org/critic
              private: true
        """
    )
    parser = ArgumentParser()
    parser.add_argument("--callback", type=MegatronCheckpoint)
    built = parser.instantiate_classes(parser.parse_object(config))
    assert built.callback.hf_export == HFExport(
        str(src), head="value", check_logits=True, adapters="peft", upload_to="org/critic"
    )
    bad = yaml.safe_load(
        f"callback: {{init_args: {{hf_export: {{hf_model_path: {src}, head: critic}}}}}}"
    )
    bad["callback"]["class_path"] = "lightning_mcore_ckpt.MegatronCheckpoint"
    bad["callback"]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    strict = ArgumentParser(exit_on_error=False)
    strict.add_argument("--callback", type=MegatronCheckpoint)
    with pytest.raises((SystemExit, argparse.ArgumentError)) as refused:  # before any run
        strict.parse_object(bad)
    # Older jsonargparse prints the error and exits; newer raises it.
    assert "'auto', 'lm', 'value', 'reward'" in str(refused.value) + capsys.readouterr().err
