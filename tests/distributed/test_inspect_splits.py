"""``inspect`` refuses exactly the layouts Megatron-Core refuses to build a model in, for the
reason Megatron-Core gives.

For a grid of model shapes (layers, heads, query groups, FFN sizes, experts) and layouts (TP,
PP, EP, expert TP; with ``--config``'s model: virtual pipeline stages, uneven first/last stages,
the embedding and loss counted in the split), the reference is Megatron-Core itself:

- in this one process: ``TransformerConfig`` built with the target sizes (heads and query
  groups against TP, uneven and virtual pipeline stages, expert parallelism without experts)
  and ``get_num_layers_to_build`` run for every pipeline rank and virtual stage (the even
  split, which the config does not check);
- only in a real multi-process build, where the layers read their sizes from the process
  groups: the FFN sizes against TP and expert TP, the experts against EP, the vocabulary
  against TP. The grid computes these with Megatron-Core's ``divide`` (the call the layers
  make), and :func:`test_what_only_a_multi_process_build_asserts_agrees_with_one` builds them
  on two gloo processes.

Steps are written from one process without training (:func:`_inspect_models.write_step`).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.cli.inspect import ModelSpec, inspect_step
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

SHAPES: dict[str, dict[str, Any]] = {
    "2 layers": dict(num_layers=2, num_attention_heads=4, ffn_hidden_size=128),
    "4 layers, 2 query groups": dict(
        num_layers=4, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96
    ),
    "6 heads, 3 query groups": dict(
        num_layers=4, num_attention_heads=6, num_query_groups=3, kv_channels=16, ffn_hidden_size=90
    ),
    "8 layers": dict(num_layers=8, num_attention_heads=4, ffn_hidden_size=128),
    "4 experts": dict(
        num_layers=2, num_attention_heads=4, num_moe_experts=4, moe_ffn_hidden_size=48
    ),
    "6 experts, 1 query group": dict(
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=1,
        num_moe_experts=6,
        moe_ffn_hidden_size=30,
        moe_shared_expert_intermediate_size=36,
        add_bias_linear=False,
    ),
}
"""Model shapes, each saved once. Query/key norms make the heads readable from the step."""

VOCAB = 128
TP, PP, EP = (1, 2, 4), (1, 2, 3, 4), (1, 2, 3)
ETP = (None, 1)  # as the tensor-parallel size (the default), or 1
PIPELINE_OPTIONS = [
    dict(virtual_pipeline_model_parallel_size=vpp, **split, **counted)
    for vpp in (None, 2)
    for split in (
        {},
        dict(num_layers_in_first_pipeline_stage=1),
        dict(num_layers_in_last_pipeline_stage=1),
        dict(num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=1),
        dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2),
    )
    for counted in (
        {},
        dict(account_for_embedding_in_pipeline_split=True),
        dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
    )
]
"""The pipeline options of a model's config (``--config``), over each layer count and PP."""

RULES = (
    ("Bias in Moe", "expert bias / expert TP"),
    ("moe_shared_expert", "shared-expert FFN / TP"),
    ("moe_ffn_hidden_size", "expert FFN / expert TP"),
    ("ffn_hidden_size", "FFN / TP"),
    ("num_attention_heads", "heads / TP"),
    ("num_query_groups", "query groups / TP"),
    ("expert", "experts / EP"),
    ("vocabulary", "vocabulary / TP"),
    ("layer", "layers / PP"),
    ("pipeline", "layers / PP"),
)
"""A refusal's rule, by the first of these words in its message (Megatron-Core's or inspect's)."""


def _rule(message: str) -> str:
    return next((rule for word, rule in RULES if word in message), f"unknown: {message}")


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from _inspect_models import write_step

    root = tmp_path_factory.mktemp("splits")
    return {
        name: write_step(root / f"shape{i}" / "global_step_1", qk_layernorm=True, **shape)
        for i, (name, shape) in enumerate(SHAPES.items())
    }


def _config(shape: dict[str, Any], sizes: dict[str, Any], **options: Any) -> Any:
    """Megatron-Core's config of ``shape`` at ``sizes`` (its own checks run here)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        hidden_size=64, pipeline_dtype=torch.float32, **shape, **sizes, **options
    )


def _megatron_refuses(shape: dict[str, Any], sizes: dict[str, Any], **options: Any) -> str | None:
    """Why Megatron-Core refuses to build ``shape`` with ``sizes`` (``None``: it builds)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.utils import divide

    try:
        config = _config(shape, sizes, **options)
        vpp = config.virtual_pipeline_model_parallel_size
        for pp_rank in range(config.pipeline_model_parallel_size):
            for vp_stage in range(vpp) if vpp else [None]:
                get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    except (ValueError, AssertionError) as err:
        return _rule(str(err))
    # What the layers assert on their process groups (real in the multi-process test below).
    groups = (
        ("FFN / TP", None if config.num_moe_experts else config.ffn_hidden_size, "tensor_model"),
        ("shared-expert FFN / TP", config.moe_shared_expert_intermediate_size, "tensor_model"),
        ("vocabulary / TP", VOCAB, "tensor_model"),
        ("experts / EP", config.num_moe_experts, "expert_model"),
        ("expert FFN / expert TP", config.moe_ffn_hidden_size, "expert_tensor"),
    )
    for rule, size, axis in groups:
        try:
            if size is not None:
                divide(size, getattr(config, f"{axis}_parallel_size"))
        except AssertionError:
            return rule
    return None


def _sizes(tp: int, pp: int, ep: int, etp: int | None) -> dict[str, Any]:
    return dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def _verdict(report: Any) -> list[str]:
    return [_rule(f.message) for f in report.blockers]


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_layouts_a_step_loads_into_are_those_megatron_core_builds_its_model_in(
    name: str, steps: dict[str, Path]
) -> None:
    """From the step alone (no ``--config``): layers, heads, FFN and experts from its keys."""
    disagree = []
    for tp, pp, ep, etp in itertools.product(TP, PP, EP, ETP):
        sizes = _sizes(tp, pp, ep, etp)
        refused = _megatron_refuses(SHAPES[name], sizes)
        target = {k: v for k, v in sizes.items() if v is not None}
        found = _verdict(inspect_step(steps[name], target))
        if (refused is None) != (not found) or (refused is not None and refused not in found):
            disagree.append(f"{target}: Megatron-Core {refused or 'builds'}, inspect {found}")
    assert not disagree, "\n".join(disagree)


@pytest.mark.parametrize("name", ["4 layers, 2 query groups", "8 layers"])
def test_the_pipeline_options_of_the_model_config_split_as_megatron_core_splits_them(
    name: str, steps: dict[str, Path]
) -> None:
    """With the model's config: virtual, uneven, embedding/loss-counted pipeline splits."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    keys = {
        k: (tuple(t.global_shape), "float32")
        for k, t in load_tensors_metadata(str(steps[name] / "model")).items()
    }
    disagree = []
    for pp, options in itertools.product(PP, PIPELINE_OPTIONS):
        refused = _megatron_refuses(SHAPES[name], _sizes(1, pp, 1, None), **options)
        # The model's config as its module holds it (built at PP=1 it may not be valid there).
        config = _config(SHAPES[name], _sizes(1, 1, 1, None))
        for field, value in options.items():
            setattr(config, field, value)
        report = inspect_step(
            steps[name], {"pipeline_model_parallel_size": pp}, ModelSpec(keys, [config])
        )
        found = _verdict(report)
        assert not report.unchecked, report.unchecked
        if (refused is None) != (not found) or (refused is not None and refused not in found):
            disagree.append(
                f"PP={pp} {options}: Megatron-Core {refused or 'builds'}, inspect {found}"
            )
    assert not disagree, "\n".join(disagree)


def test_what_the_step_does_not_record_is_named_as_not_checked(
    tmp_path: Path, steps: dict[str, Path]
) -> None:
    from _inspect_models import write_step

    report = inspect_step(steps["2 layers"], {"pipeline_model_parallel_size": 2})
    assert not report.blockers and len(report.unchecked) == 1  # the pipeline options
    assert "uneven first/last pipeline stages" in report.unchecked[0]
    assert report.to_json()["unchecked"] == report.unchecked
    # Without query/key norms (or a Hugging Face config) the heads are not in the step.
    # 4 heads do not split into TP=3, but only the FFN and vocabulary sizes (96) are known.
    plain = write_step(
        tmp_path / "global_step_1", num_attention_heads=4, ffn_hidden_size=96, vocab_size=96
    )
    report = inspect_step(plain, {"tensor_model_parallel_size": 3})
    assert not report.blockers, report.blockers
    assert any("attention heads and query groups against TP" in u for u in report.unchecked)


# Built on two gloo processes: (what, parallel sizes, the model's shape).
REAL_BUILDS: list[tuple[str, dict[str, int], dict[str, Any]]] = [
    ("FFN / TP", {"tensor_model_parallel_size": 2}, dict(ffn_hidden_size=127)),
    ("vocabulary / TP", {"tensor_model_parallel_size": 2}, dict(vocab_size=127)),
    (
        "experts / EP",
        {"expert_model_parallel_size": 2},
        dict(num_moe_experts=3, moe_ffn_hidden_size=32),
    ),
    (
        "expert FFN / expert TP",
        {"expert_tensor_parallel_size": 2},
        dict(num_moe_experts=4, moe_ffn_hidden_size=33, add_bias_linear=False),
    ),
    (
        "builds",
        {
            "tensor_model_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
        },
        dict(num_moe_experts=4, moe_ffn_hidden_size=32, ffn_hidden_size=96),
    ),
]


def _build_each(rank: int, world_size: int) -> list[str]:
    from megatron.core import parallel_state

    from lightning_mcore_ckpt.tiny import tiny_gpt
    from lightning_mcore_ckpt.training import parallel as _parallel

    found = []
    for _, sizes, shape in REAL_BUILDS:
        _parallel.initialize(device_type="cpu", **sizes)  # type: ignore[arg-type]
        try:
            tiny_gpt(**shape)
            found.append("builds")
        except (ValueError, AssertionError) as err:
            found.append(str(err))
        parallel_state.destroy_model_parallel()
    _parallel.destroy()
    return found


def test_what_only_a_multi_process_build_asserts_agrees_with_one(tmp_path: Path) -> None:
    from _inspect_models import write_step

    built = run_distributed(_build_each, 2, timeout=200)[0]
    for (expected, sizes, shape), megatron in zip(REAL_BUILDS, built, strict=True):
        assert (megatron == "builds") == (expected == "builds"), (expected, megatron)
        step = write_step(tmp_path / expected.replace(" ", "") / "global_step_1", **shape)
        found = _verdict(inspect_step(step, sizes))
        # (The vocabulary: once for the embedding, once for the output layer.)
        assert set(found) == ({expected} - {"builds"}), (expected, megatron, found)


def test_a_field_of_the_shape_is_a_field_of_megatron_cores_config() -> None:
    """The dimensions the rules read are the ``TransformerConfig`` fields of those names."""
    from megatron.core.transformer import TransformerConfig

    from lightning_mcore_ckpt.cli.splits import ModelShape

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    ours = {f.name for f in dataclasses.fields(ModelShape)}
    ours -= {"prefix", "custom_pipeline_layout", "from_config"}
    assert ours <= fields, ours - fields
