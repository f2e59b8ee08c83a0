"""MegatronStrategy's options are StrategyConfig's fields, written once: the constructor's
signature, its documented arguments (what LightningCLI's ``--help`` prints) and its refusals
all come from them."""

from __future__ import annotations

import dataclasses
import os
import typing

import pytest

from lightning_mcore_ckpt import MegatronStrategy
from lightning_mcore_ckpt.strategy import StrategyConfig


def test_lightning_cli_help_prints_every_fields_text_and_the_literal_choices() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(MegatronStrategy, "strategy")
    text = parser.format_help()
    flat = " ".join(text.split())
    for field in dataclasses.fields(StrategyConfig):
        assert f"--strategy.{field.name}" in text, field.name
    # Each field's docstring, from its first words, is the option's help.
    assert "Ranks each layer's tensors are split across." in flat
    assert "Who writes the shard files." in flat
    assert "How long any rank waits for a peer that does not answer before it fails" in flat
    assert "Initial weights for a ``fit`` that does not resume from a checkpoint" in flat
    # A Literal option lists its values.
    assert "--strategy.ckpt_writer {threads,megatron}" in text
    assert "--strategy.ckpt_optimizer_sharding {dp_reshardable,fully_reshardable}" in text


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(StrategyConfig)])
def test_every_string_option_is_a_literal_and_a_value_outside_it_is_refused(name: str) -> None:
    hint = typing.get_type_hints(StrategyConfig)[name]
    types = (hint, *typing.get_args(hint))
    if not any(typing.get_origin(a) is typing.Literal for a in types):
        # A path (init_from) may be any string; no other option is a plain str.
        path = any(typing.get_origin(a) is os.PathLike for a in types)
        assert str not in types or path, f"{name}: a plain str option"
        return
    with pytest.raises(ValueError, match=rf"MegatronStrategy\({name}='bogus'\): use "):
        MegatronStrategy(**{name: "bogus"})


def test_an_unknown_option_is_refused_naming_the_closest_field() -> None:
    with pytest.raises(
        TypeError,
        match=r"MegatronStrategy\(tensor_paralel_size=2\): no such option; did you mean "
        r"tensor_model_parallel_size\?",
    ):
        MegatronStrategy(tensor_paralel_size=2)


def test_the_spelled_out_arguments_are_the_configs_fields_for_type_checkers() -> None:
    """The constructor as written (what a type checker reads at a call, the Literal options
    included) lists the config's fields, one for one: names, defaults and type hints."""
    import inspect

    written = inspect.signature(MegatronStrategy.__init__.__wrapped__)  # type: ignore[attr-defined]
    params = list(written.parameters.values())[1:]
    fields = [f for f in dataclasses.fields(StrategyConfig) if f.init]
    assert [p.name for p in params] == [f.name for f in fields]
    for param, item in zip(params, fields, strict=True):
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, item.name
        default = item.default_factory() if item.default is dataclasses.MISSING else item.default  # type: ignore[misc]
        assert param.default == default, item.name
        assert param.annotation == item.type, item.name
