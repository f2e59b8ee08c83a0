"""MegatronStrategy rejects bad arguments at construction, naming the argument and the fix.

Each refusal is a ``ConfigurationError``: a ``ValueError`` and Lightning's
``MisconfigurationException``, so that code written for either catches it.
"""

from __future__ import annotations

import datetime

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mcore_ckpt import MegatronStrategy, SaveOptions


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tensor_model_parallel_size": 0},
            r"tensor_model_parallel_size=0\): must be a positive int",
        ),
        ({"pipeline_model_parallel_size": 1.5}, r"pipeline_model_parallel_size=1.5\)"),
        ({"context_parallel_size": True}, r"context_parallel_size=True\)"),
        ({"expert_model_parallel_size": -2}, r"expert_model_parallel_size=-2\)"),
        ({"ckpt_async_save": "yes"}, r"ckpt_async_save='yes'\): must be True or False"),
        ({"seed": -1}, r"seed=-1\): must be a non-negative int"),
        (
            {"process_group_backend": "mpi"},
            r"process_group_backend='mpi'\): use 'nccl', 'gloo' or None",
        ),
        (
            {"ckpt_optimizer_sharding": "fully_sharded_model_space"},
            r"ckpt_optimizer_sharding='fully_sharded_model_space'\): use one of "
            r"'dp_reshardable', 'fully_reshardable'",
        ),
        (
            {"ckpt_writer": "processes"},
            r"ckpt_writer='processes'\): use one of 'threads', 'megatron'",
        ),
        ({"ckpt_write_threads": 0}, r"ckpt_write_threads=0\): must be a positive int"),
        ({"ckpt_read_threads": 2.0}, r"ckpt_read_threads=2.0\): must be a positive int"),
        ({"ckpt_cache_plans": 1}, r"ckpt_cache_plans=1\): must be True or False"),
        (
            {"sequence_parallel": True},
            r"sequence_parallel=True\) needs tensor_model_parallel_size > 1",
        ),
        ({"timeout": 60}, r"timeout=60\): pass a positive datetime.timedelta"),
        ({"ckpt_dedup": True, "ckpt_writer": "megatron"}, r"ckpt_dedup=True, ckpt_writer="),
        (
            {"init_from": "/nonexistent/model"},
            r"init_from='/nonexistent/model'\): '/nonexistent/model' does not exist\. Pass",
        ),
    ],
)
def test_bad_arguments_are_rejected_with_the_argument_named(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(MisconfigurationException, match=message) as caught:
        MegatronStrategy(**kwargs)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError), type(caught.value)


def test_defaults_are_those_of_the_public_interface() -> None:
    strategy = MegatronStrategy()
    assert strategy.tensor_model_parallel_size == 1
    assert strategy.seed == 1234
    assert strategy.ckpt_parallel_save is True
    assert strategy.ckpt_async_save is False
    assert strategy.process_group_backend is None
    assert strategy.config.ckpt_optimizer_sharding == "dp_reshardable"
    # The fast path is the default: our writer, its thread count from the cores, cached plans.
    assert strategy.config.ckpt_writer == "threads"
    assert strategy.config.ckpt_cache_plans is True
    assert strategy._writer.shards.threads >= 4 and strategy._reader.read_threads >= 4
    # A silent peer ends the job in minutes, not Lightning's 30 (docs/nodes.md).
    assert strategy.config.timeout == datetime.timedelta(minutes=10)


def test_save_options_reject_unknown_contents() -> None:
    with pytest.raises(
        ValueError, match=r"unknown \['weights'\]; choose from \['model', 'optimizer', 'extra'\]"
    ):
        SaveOptions(contents=("model", "weights"))


def test_the_constructor_takes_exactly_the_config_fields_with_the_same_defaults() -> None:
    import dataclasses
    import inspect

    from lightning_mcore_ckpt.strategy import StrategyConfig

    params = list(inspect.signature(MegatronStrategy.__init__).parameters.values())[1:]
    fields = dataclasses.fields(StrategyConfig)
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [f.default for f in fields]
    strategy = MegatronStrategy(tensor_model_parallel_size=2, seed=7)
    assert strategy.config == StrategyConfig(tensor_model_parallel_size=2, seed=7)


def test_the_process_group_backend_follows_the_accelerator_not_the_machine() -> None:
    from lightning_mcore_ckpt.training.parallel import backend_for

    # accelerator="cpu" on a machine with GPUs trains on CPU tensors: gloo, not NCCL.
    assert backend_for("cpu", None) == "gloo"
    assert backend_for("cuda", None) == "nccl"
    assert backend_for("cuda", "gloo") == "gloo"
    with pytest.raises(ValueError, match=r"process_group_backend='nccl'.*accelerator='cpu'"):
        backend_for("cpu", "nccl")
