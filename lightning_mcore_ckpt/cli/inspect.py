"""``lightning-mcore-ckpt inspect``: will this step load into that layout and that model?

Answered from metadata only, on one CPU process, in about 6 s on a 2-core machine whatever the
step's size (importing torch, Megatron-Core and Lightning is most of it): the commit marker, each
dist-checkpoint's index (``.metadata``: keys, global shapes, dtypes; no shard file is opened),
the ``extra/`` files (RNG and Lightning's state: a few KB per rank) and the Hugging Face copy's
``config.json`` and safetensors headers. The model a LightningCLI config builds
(:func:`spec_from_config`, for ``--config``) is built on the meta device (no weights). Whether
the step's files are whole is ``fsck``'s question, not this one's.

The splits Megatron-Core asserts when it builds the model with the target sizes (layers / PP,
heads / TP, experts / EP...) are :mod:`~lightning_mcore_ckpt.cli.splits`'s, on the dimensions of
the ``--config`` model or else of the step's shapes; what neither tells is listed in
:attr:`Inspection.unchecked`.

Every finding is a :class:`Finding`; a blocker (``blocker=True``) says what would fail or go
wrong, and how to fix it (see :func:`inspect_step`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt import _compat
from lightning_mcore_ckpt.cli import splits
from lightning_mcore_ckpt.cli.failure import fail
from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.format.loops import between_epochs
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp
from lightning_mcore_ckpt.safety import safe_load as _safe_load

__all__ = [
    "SIZES",
    "Finding",
    "Inspection",
    "ModelSpec",
    "add_parsers",
    "inspect_step",
    "spec_from_config",
]

SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "data_parallel_size",
)
"""The parallel sizes of a layout, as ``metadata.json``'s ``parallel_layout`` names them."""
_MODEL_PARALLEL = SIZES[:4]
_ETP = "expert_tensor_parallel_size"
"""Recorded (and kept in a layout here) only where it differs from the tensor-parallel size."""


@dataclass
class Finding:
    """One answer: ``topic`` (``format``, ``versions``, ``layout``, ``model``, ``optimizer``,
    ``data``, ``rng``, ``hf``), whether it blocks the load, and the message (with the fix).

    Example: ``Finding("data", "no dataloader state (the loader was not stateful)")``.
    """

    topic: str
    message: str
    blocker: bool = False


@dataclass
class ModelSpec:
    """The model a load would fill: its checkpoint keys with global shapes and dtypes, and
    Megatron-Core's configs of its modules (checked against the target layout).

    Example: ``inspect_step(step, model=ModelSpec({"gpt.scale": ((4,), "float32")}))``.
    """

    keys: dict[str, tuple[tuple[int, ...], str]]
    configs: list[Any] = field(default_factory=list)


@dataclass
class Inspection:
    """What :func:`inspect_step` found.

    Example::

        report = inspect_step(step, {"data_parallel_size": 4})
        print(json.dumps(report.to_json()), "loads" if not report.blockers else "blocked")
    """

    step: Path
    saved_layout: dict[str, int]
    target_layout: dict[str, int]
    findings: list[Finding] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    """The checks it could not make (what the step does not record; ``--config`` gives most)."""

    @property
    def blockers(self) -> list[Finding]:
        return [f for f in self.findings if f.blocker]

    def to_json(self) -> dict[str, Any]:
        return {
            "step": str(self.step),
            "saved_layout": self.saved_layout,
            "target_layout": self.target_layout,
            "loadable": not self.blockers,
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "unchecked": self.unchecked,
        }


def inspect_step(
    step: str | os.PathLike[str],
    target: Mapping[str, int] | None = None,
    model: ModelSpec | None = None,
) -> Inspection:
    """Check whether ``step`` loads into the ``target`` layout (sizes by :data:`SIZES` name;
    missing ones: as saved) and, given its :class:`ModelSpec`, into that model.

    Example::

        report = inspect_step("checkpoints/run/global_step_100", {"tensor_model_parallel_size": 4})
        for finding in report.blockers:
            print(finding.topic, finding.message)
    """
    path = Path(step)
    meta = markers.read_metadata(path)
    if meta is None:
        raise FileNotFoundError(
            f"{path} is not a committed step ({markers.METADATA_FILE} missing or unreadable); "
            "`lightning-mcore-ckpt ls` lists a run's complete steps"
        )
    recorded = meta.get("parallel_layout") or {}
    saved = {k: int(v) for k, v in recorded.items() if k in (*SIZES, _ETP)}
    given = {k: int(v) for k, v in (target or {}).items() if v is not None}
    wanted = {**saved, **given}
    for sizes in (saved, wanted):
        if sizes.get(_ETP) == sizes.get("tensor_model_parallel_size", 1):
            del sizes[_ETP]
    report = Inspection(path, saved, wanted)
    add = report.findings.append
    _format_and_versions(path, meta, add)
    changed = [k for k in SIZES if saved.get(k, 1) != wanted.get(k, 1)]
    add(
        Finding(
            "layout",
            f"saved with {_describe(saved)}; loading into {_describe(wanted)}"
            + (f" (changes: {', '.join(_short(k) for k in changed)})" if changed else ""),
        )
    )
    contents = meta.get("contents") or ["model"]
    if "model" in contents:
        _model(path, wanted, model, add, report.unchecked.append)
    if "optimizer" in contents:
        _optimizer(path, meta, saved, wanted, add)
    if "extra" in contents:
        _extra(path, meta, saved, wanted, add)
    if (path / layout.HF_DIR / "config.json").is_file():
        _hf(path / layout.HF_DIR, add)
    return report


def spec_from_config(config: str | os.PathLike[str]) -> tuple[ModelSpec, dict[str, int]]:
    """The model a LightningCLI config builds (on the meta device, with TP=PP=1 on this one
    process: checkpoint keys and global shapes do not depend on the layout) and the layout the
    config trains with (its ``MegatronStrategy`` sizes, and ``trainer.devices`` x
    ``num_nodes`` for the data-parallel size), for ``inspect --config``."""
    import yaml

    data = yaml.safe_load(Path(config).read_text())
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"--config {config}: not a LightningCLI config with a 'model'")
    trainer = data.get("trainer") or {}
    strategy = trainer.get("strategy") or {}
    options = dict(strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    target = _config_layout(trainer, options)
    return _meta_model(data["model"], options), target


def _config_layout(trainer: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, int]:
    """The layout a config trains with: its strategy's sizes, and the data-parallel size its
    devices and nodes leave."""
    target = {k: int(v) for k, v in options.items() if k in (*SIZES, _ETP) and v is not None}
    devices = trainer.get("devices", 1)
    devices = len(devices) if isinstance(devices, list) else devices
    if isinstance(devices, int) and not isinstance(devices, bool):
        world = devices * int(trainer.get("num_nodes", 1) or 1)
        model_parallel = 1
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            model_parallel *= target.get(name, 1)
        model_parallel *= target.get("context_parallel_size", 1)
        target["data_parallel_size"] = max(1, world // model_parallel)
    return target


def _meta_model(model: Any, options: Mapping[str, Any]) -> ModelSpec:
    """The model of a config's ``model`` entry, attached to a one-process CPU Trainer with the
    config's strategy options (modules read them in configure_model) but TP=PP=CP=EP=1, built
    on the meta device: its checkpoint keys, global shapes and dtypes."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.cli import instantiate_class
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.transformer.module import MegatronModule

    from lightning_mcore_ckpt.engine import module_sharded_state_dict
    from lightning_mcore_ckpt.hf._import import (
        megatron_environ_writes_undone,
        single_process_parallel_state,
    )
    from lightning_mcore_ckpt.strategy import MegatronStrategy

    kept = {k: v for k, v in options.items() if k not in SIZES and k != "sequence_parallel"}
    with single_process_parallel_state(), megatron_environ_writes_undone():
        module = instantiate_class((), model)
        module.trainer = pl.Trainer(
            strategy=MegatronStrategy(**kept),
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with torch.device("meta"):
            module.configure_model()
        ssd = module_sharded_state_dict(module)
        apply_factories(ssd)
        keys = {
            sh.key: (tuple(sh.global_shape), str(sh.dtype).replace("torch.", ""))
            for sh in nested_values(ssd)
            if isinstance(sh, ShardedTensor)
        }
        configs = [
            m.config
            for m in module.modules()
            if isinstance(m, MegatronModule) and hasattr(m, "config")
        ][:1]
    return ModelSpec(keys, configs)


def _short(name: str) -> str:
    return {"tensor": "TP", "pipeline": "PP", "context": "CP", "expert": "EP", "data": "DP"}[
        name.split("_", 1)[0]
    ]


def _describe(sizes: Mapping[str, int]) -> str:
    etp = f" ETP={sizes[_ETP]}" if _ETP in sizes else ""
    return " ".join(f"{_short(k)}={sizes.get(k, 1)}" for k in SIZES) + etp


def _format_and_versions(path: Path, meta: dict[str, Any], add: Any) -> None:
    try:
        layout.check_format(path)
        _compat.check_readable(path)
    except ValueError as err:
        add(Finding("format", str(err), blocker=True))
    else:
        version = meta.get("format_version")
        add(Finding("format", f"format {version}; this lightning-mcore-ckpt reads it"))
    # As installed, without importing the libraries (seconds): their distributions' versions,
    # compared without the local build label a module's own version may carry (+cu130).
    wrote, have = meta.get("versions") or {}, _compat.installed_versions()
    for name in ("megatron_core", "torch", "lightning", "lightning_mcore_ckpt"):
        if name in wrote:
            same = _same_release(str(wrote[name]), have.get(name))
            said = "the same" if same else f"{have.get(name)} installed"
            add(Finding("versions", f"{name} {wrote[name]} wrote it; {said}"))


def _same_release(wrote: str, have: str | None) -> bool:
    """Whether two versions are one release (``2.13.0+cu130`` and ``2.13.0`` are)."""
    from packaging.version import InvalidVersion, Version

    if have is None or wrote == have:
        return wrote == have
    try:
        return Version(wrote).public == Version(have).public
    except InvalidVersion:
        return False


def _model(
    path: Path, wanted: Mapping[str, int], model: ModelSpec | None, add: Any, skip: Any
) -> None:
    index = _safe_dcp.read_dcp_metadata(path / layout.MODEL_DIR)
    saved = {
        key: (tuple(md.size), str(md.properties.dtype).replace("torch.", ""))
        for key, md in index.state_dict_metadata.items()
        if hasattr(md, "size")
    }
    add(Finding("model", f"{len(saved)} tensors in model/"))
    for prefix, pattern in _hybrid_models(saved):
        add(
            Finding(
                "model",
                f"{prefix!r} is a Megatron-Core HybridModel of {len(pattern)} layers {pattern!r} "
                "(saved one by one); it resumes and reshards like a GPTModel, and has no Hugging "
                "Face export (mbridge maps no hybrid architecture)",
            )
        )
    tp = wanted.get("tensor_model_parallel_size", 1)
    for key, (shape, _) in sorted(saved.items()):
        if key.endswith(("word_embeddings.weight", "output_layer.weight")) and shape[0] % tp:
            add(
                Finding(
                    "model",
                    f"{key}: its vocabulary ({shape[0]} rows) does not divide by TP={tp}; "
                    "choose a tensor-parallel size that divides it, or pad the vocabulary when "
                    "building the model (Megatron-LM's make_vocab_size_divisible_by)",
                    blocker=True,
                )
            )
    split = _splits(path, saved, wanted, model, add, skip)
    if model is not None:
        _against_model(saved, model, add)
        if split:  # else Megatron-Core's own config check, for anything the rules miss
            _against_configs(model, wanted, add)


def _splits(
    path: Path,
    saved: Mapping[str, tuple[tuple[int, ...], str]],
    wanted: Mapping[str, int],
    model: ModelSpec | None,
    add: Any,
    skip: Any,
) -> bool:
    """Every split Megatron-Core asserts when it builds the model with the target sizes
    (:mod:`~lightning_mcore_ckpt.cli.splits`), on the dimensions of the model (``--config``)
    or else of the step; whether all hold."""
    keys = model.keys if model is not None else saved
    shapes = splits.shape_from_keys({k: shape for k, (shape, _) in keys.items()})
    hf_config = path / layout.HF_DIR / "config.json"
    if hf_config.is_file():
        hf = json.loads(hf_config.read_text())
        shapes = [splits.shape_from_hf_config(s, hf) for s in shapes]
    if model is not None and model.configs:
        shapes = [splits.shape_from_config(s, model.configs[0]) for s in shapes]
    if not shapes:
        skip(
            "the model's splits against the layout (layers, heads, FFN, experts): no "
            f"Megatron-Core GPT model (no '{splits.EMBEDDING}') in the step"
        )
    sizes = splits.SplitSizes.of(wanted)
    holds = True
    for shape in shapes:
        problems = splits.check_splits(shape, sizes)
        for problem in problems:
            add(
                Finding(
                    "layout",
                    f"{shape.prefix!r} cannot be built with {_describe(wanted)}: {problem}",
                    blocker=True,
                )
            )
        holds = holds and not problems
        if not problems:
            add(
                Finding(
                    "layout", f"{shape.prefix!r} splits into {_describe(wanted)}: {_dims(shape)}"
                )
            )
        for what in splits.unknown_dimensions(shape):
            skip(f"{shape.prefix!r}: {what}")
    if any(not s.from_config for s in shapes):
        skip(splits.UNCHECKED_WITHOUT_CONFIG)
    return holds


def _dims(shape: splits.ModelShape) -> str:
    """The dimensions a split was checked on, by their ``TransformerConfig`` names."""
    names = (
        "num_layers",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "num_moe_experts",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
    )
    known = [(n, getattr(shape, n)) for n in names if getattr(shape, n) is not None]
    return ", ".join(f"{name}={size}" for name, size in known) or "no dimension known"


def _against_model(
    saved: Mapping[str, tuple[tuple[int, ...], str]], model: ModelSpec, add: Any
) -> None:
    """The step's keys against the model's: missing (renamed?), unexpected, reshaped."""
    missing = {k: v for k, v in model.keys.items() if k not in saved}
    unexpected = {k: v for k, v in saved.items() if k not in model.keys}
    for key in sorted(missing):
        twins = [k for k, v in unexpected.items() if v == missing[key]]
        hint = (
            f" (renamed? the checkpoint has {twins[0]!r} of that shape and dtype)" if twins else ""
        )
        add(
            Finding(
                "model",
                f"the model's {key!r} {list(missing[key][0])} is not in the checkpoint{hint}; "
                "build the model with the names it was saved with (same attribute path and "
                "config)",
                blocker=True,
            )
        )
    for key in sorted(unexpected):
        add(Finding("model", f"{key!r} is in the checkpoint but not in the model: not loaded"))
    for key in sorted(set(saved) & set(model.keys)):
        if saved[key][0] != model.keys[key][0]:
            add(
                Finding(
                    "model",
                    f"{key!r} has shape {list(saved[key][0])} in the checkpoint but "
                    f"{list(model.keys[key][0])} in the model; load it into a model with the "
                    "configuration it was saved with",
                    blocker=True,
                )
            )


def _against_configs(model: ModelSpec, wanted: Mapping[str, int], add: Any) -> None:
    """Whether the model's Megatron-Core configs take the target model-parallel sizes."""
    sizes = {k: wanted.get(k, 1) for k in _MODEL_PARALLEL}
    sizes[_ETP] = splits.SplitSizes.of(wanted).etp
    for config in model.configs:
        try:
            dataclasses.replace(config, **sizes)
        except (ValueError, AssertionError) as err:
            add(
                Finding(
                    "layout",
                    f"the model cannot be built with {_describe(sizes)}: {err}; choose sizes "
                    "that divide the model's dimensions",
                    blocker=True,
                )
            )
            break


def _hybrid_models(keys: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key prefix, layer pattern)`` of each hybrid model in a checkpoint (one per input
    embedding)."""
    from lightning_mcore_ckpt.hf._names import EMBEDDING, hybrid_layer_pattern

    found = []
    for prefix in sorted({k[: -len(EMBEDDING)] for k in keys if k.endswith(EMBEDDING)}):
        pattern = hybrid_layer_pattern(k[len(prefix) :] for k in keys if k.startswith(prefix))
        if pattern is not None:
            found.append((prefix, pattern))
    return found


def _optimizer(
    path: Path, meta: dict[str, Any], saved: dict[str, int], wanted: dict[str, int], add: Any
) -> None:
    index = _safe_dcp.read_dcp_metadata(path / layout.OPTIM_DIR)
    states = sorted(
        {
            key.split(".state.", 1)[1].split(".", 1)[0]
            for key in index.state_dict_metadata
            if ".state." in key
        }
    )
    kind = "Adam/AdamW" if {"exp_avg", "exp_avg_sq"} <= set(states) else "optimizer"
    sharding = meta.get("optimizer_sharding")
    how = (
        f"Megatron-Core's distributed optimizer, saved {sharding!r}"
        if sharding
        else "sharded like the weights (reshards into any layout)"
    )
    add(Finding("optimizer", f"{kind} state ({', '.join(states) or 'none'}): {how}"))
    differs = [k for k in _MODEL_PARALLEL if saved.get(k, 1) != wanted.get(k, 1)]
    if sharding == "dp_reshardable" and differs:
        what = ", ".join(
            f"{_short(k)}={saved.get(k, 1)} saved, {wanted.get(k, 1)} wanted" for k in differs
        )
        add(
            Finding(
                "optimizer",
                f"its state reshards across data-parallel sizes only ({what}): resume with the "
                "saving layout, or save one step with MegatronStrategy("
                "ckpt_optimizer_sharding='fully_reshardable') from it first, or load the weights "
                "only (MegatronStrategy(init_from=...))",
                blocker=True,
            )
        )
    elif sharding == "fully_reshardable" and "expert_model_parallel_size" in differs:
        parts = meta.get("distributed_optimizer_parts")
        if parts:
            add(
                Finding(
                    "optimizer",
                    f"EP {saved.get('expert_model_parallel_size', 1)} -> "
                    f"{wanted.get('expert_model_parallel_size', 1)}: its inner optimizers "
                    f"({parts}: dense and expert where 2) are mapped onto the target's by the "
                    "parameters each one's groups held",
                )
            )
        else:
            add(
                Finding(
                    "optimizer",
                    "saved before the parameters of each inner optimizer were recorded: its "
                    "state cannot be mapped onto another expert-parallel size; resume with the "
                    "saving layout and save a step again, or load the weights only "
                    "(MegatronStrategy(init_from=...))",
                    blocker=True,
                )
            )
    elif sharding not in (None, "dp_reshardable", "fully_reshardable"):
        add(Finding("optimizer", f"sharding type {sharding!r} cannot be loaded", blocker=True))


def _extra(
    path: Path, meta: dict[str, Any], saved: dict[str, int], wanted: dict[str, int], add: Any
) -> None:
    files = sorted((path / layout.EXTRA_DIR).glob("rank_*.pt"))
    world = (meta.get("parallel_layout") or {}).get("world_size", len(files))
    if len(files) != world:
        add(
            Finding(
                "data",
                f"extra/ has {len(files)} rank files, the save had {world}: run "
                f"`lightning-mcore-ckpt fsck {path}`",
                blocker=True,
            )
        )
    ranks = _read_rank_states(files)
    _dataloaders(ranks, len(files), world, add)
    _data_parallel_change(ranks, saved, wanted, add)
    _rng(ranks, len(files), saved, wanted, add)


@dataclass
class _RankStates:
    """What the ``extra/`` files of a step hold, rank by rank."""

    with_loader: list[tuple[int, bool]] = field(default_factory=list)
    """Ranks with dataloader state, and whether all of it is ElasticSampler's."""
    without_rng: list[int] = field(default_factory=list)
    mid_epoch: int | None = None
    """Batches done in the epoch, when a rank was saved inside one."""


def _read_rank_states(files: list[Path]) -> _RankStates:
    # Megatron-Core's import allows its types in weights_only loads (PosixPath...), as in the
    # training process that would load these files.
    import megatron.core  # noqa: F401

    from lightning_mcore_ckpt.training.sampler import is_elastic_state

    found = _RankStates()
    for file in files:
        payload = _safe_load.load_torch_file(file)
        rank = int(payload.get("rank", files.index(file)))
        if not payload.get("rng"):
            found.without_rng.append(rank)
        fit = (payload.get("lightning") or {}).get("loops", {}).get("fit_loop") or {}
        state = fit.get("state_dict") or {}
        loaders = state.get("combined_loader") or []
        if loaders:
            found.with_loader.append((rank, all(is_elastic_state(s) for s in loaders)))
        batches = fit.get("epoch_loop.batch_progress") or {}
        progress = batches.get("current") or {}
        done = max(int(progress.get("completed", 0)), int(progress.get("processed", 0)))
        if done and not batches.get("is_last_batch") and not between_epochs(fit):
            found.mid_epoch = done
    return found


def _dataloaders(found: _RankStates, files: int, world: int, add: Any) -> None:
    ranks = [r for r, _ in found.with_loader]
    add(
        Finding(
            "data",
            f"dataloader state for ranks {_ranges(ranks)} of {world}"
            if ranks
            else "no dataloader state (the loader was not stateful)",
        )
    )
    if found.mid_epoch and len(ranks) < files:
        lacking = sorted(set(range(files)) - set(ranks))
        add(
            Finding(
                "data",
                f"saved inside an epoch (after {found.mid_epoch} batches) without the "
                f"dataloader's position on ranks {_ranges(lacking)}: a resume is refused (the "
                "rest of the epoch would not see the data the uninterrupted run sees). Train "
                "with torchdata.stateful_dataloader.StatefulDataLoader, save at epoch ends, or "
                "resume with MegatronCheckpoint(restore_dataloader=False) to restart the epoch",
                blocker=True,
            )
        )


def _data_parallel_change(
    found: _RankStates, saved: dict[str, int], wanted: dict[str, int], add: Any
) -> None:
    dp_saved, dp_wanted = saved.get("data_parallel_size", 1), wanted.get("data_parallel_size", 1)
    if dp_saved == dp_wanted or not found.with_loader:
        return
    if all(elastic for _, elastic in found.with_loader):
        add(
            Finding(
                "data",
                f"DP {dp_saved} -> {dp_wanted}: ElasticSampler continues at the next global sample",
            )
        )
    else:
        add(
            Finding(
                "data",
                f"DP {dp_saved} -> {dp_wanted}: the dataloader positions are per rank and "
                "cannot be mapped; use lightning_mcore_ckpt.ElasticSampler, or resume with "
                "MegatronCheckpoint(restore_dataloader=False) to restart the epoch's order",
                blocker=True,
            )
        )


def _rng(
    found: _RankStates, files: int, saved: dict[str, int], wanted: dict[str, int], add: Any
) -> None:
    if found.without_rng:
        add(Finding("rng", f"no RNG state for ranks {_ranges(found.without_rng)}"))
    elif saved == wanted:
        add(Finding("rng", f"RNG state of every rank ({files}): restored exactly"))
    else:
        add(
            Finding(
                "rng",
                "the layout changes: RNG streams are per rank, so they are derived again from "
                "the seed and rank 0's state (the run continues, not bit for bit)",
            )
        )


def _hf(hf_dir: Path, add: Any) -> None:
    from safetensors import safe_open

    from lightning_mcore_ckpt.hf._safetensors import safetensors_files

    config = json.loads((hf_dir / "config.json").read_text())
    shapes: dict[str, list[int]] = {}
    for file, names in safetensors_files(hf_dir).items():
        with safe_open(str(hf_dir / file), framework="pt") as f:
            for name in names:
                shapes[name] = list(f.get_slice(name).get_shape())
    layers = {n.split(".")[2] for n in shapes if n.startswith("model.layers.")}
    expected = {
        "model.embed_tokens.weight": [config.get("vocab_size"), config.get("hidden_size")],
    }
    problems = [
        f"{name} is {shapes.get(name)}, config.json says {want}"
        for name, want in expected.items()
        if name in shapes and shapes[name] != want
    ]
    if "num_hidden_layers" in config and len(layers) != config["num_hidden_layers"]:
        problems.append(f"{len(layers)} layers, config.json says {config['num_hidden_layers']}")
    for problem in problems:
        add(Finding("hf", f"huggingface/: {problem}; export it again", blocker=True))
    if not problems:
        add(Finding("hf", f"huggingface/: {len(shapes)} tensors, consistent with config.json"))


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    spans = []
    for _, group in itertools.groupby(enumerate(sorted(ranks)), lambda p: p[1] - p[0]):
        run = [rank for _, rank in group]
        spans.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(spans) or "none"


def add_parsers(commands: Any) -> None:
    """Add ``inspect`` to the command line's subparsers."""
    inspect = commands.add_parser(
        "inspect",
        help="will a step load into a layout and a model? From metadata only (seconds: "
        "importing torch and Megatron-Core is most of it)",
        description="Answer, from a step's metadata (no tensor data), on one CPU process: "
        "whether it loads into the target layout and the model a config builds (missing, "
        "unexpected, renamed and reshaped keys), its optimizer state and whether it reshards "
        "there, which ranks have dataloader and RNG state and what a data-parallel change does "
        "to them, the versions that wrote it, and the Hugging Face copy against its config. "
        "The splits Megatron-Core asserts when it builds the model: layers against PP (an even "
        "split; with --config also virtual pipeline stages, uneven first/last stages and the "
        "embedding/loss counted as layers), attention heads and query groups against TP, the "
        "FFN and shared-expert sizes against TP, the vocabulary against TP, experts against EP, "
        "the experts' FFN size (and biases) against expert TP. Without --config the model's "
        "dimensions come from the step's tensor shapes; the heads only where query/key norms or "
        "huggingface/config.json give them, and the pipeline options not at all: what could "
        "not be checked is listed ('skipped', and 'unchecked' in --json). Exit code 1 on any "
        "blocker, each with its fix; 0 when it loads.",
    )
    inspect.add_argument("step", help="a step directory (global_step_<N>/)")
    inspect.add_argument(
        "--config",
        metavar="run.yaml",
        help="a LightningCLI config: the model to compare with (built on the meta device) and "
        "its layout (MegatronStrategy sizes, trainer.devices x num_nodes)",
    )
    for flag, size in (
        ("--tp", "tensor_model_parallel_size"),
        ("--pp", "pipeline_model_parallel_size"),
        ("--cp", "context_parallel_size"),
        ("--ep", "expert_model_parallel_size"),
        ("--etp", _ETP),
        ("--dp", "data_parallel_size"),
    ):
        default = "as saved, else the target TP" if size == _ETP else "as saved"
        inspect.add_argument(
            flag, dest=size, type=int, metavar="N", help=f"target {size} (default: {default})"
        )
    inspect.add_argument("--json", action="store_true", help="print the findings as JSON")
    inspect.set_defaults(handler=_inspect)


def _inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    target: dict[str, int] = {}
    spec = None
    for size in (*SIZES, _ETP):
        value = getattr(args, size)
        if value is not None and value < 1:
            return fail(f"--{size}: {value} is not a positive size")
    try:
        if args.config is not None:
            spec, target = spec_from_config(args.config)
        target.update({s: getattr(args, s) for s in (*SIZES, _ETP) if getattr(args, s)})
        report = inspect_step(args.step, target, spec)
    except (FileNotFoundError, ValueError) as err:
        return fail(err)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for finding in report.findings:
            mark = "BLOCKER" if finding.blocker else "ok     "
            print(f"{mark} [{finding.topic}] {finding.message}")
        for what in report.unchecked:
            print(f"skipped [layout] not checked: {what}")
        blockers = len(report.blockers)
        skipped = f" (as far as checked: {len(report.unchecked)} check(s) skipped)"
        print(
            f"FAILED: {blockers} blocker(s)"
            if blockers
            else "OK: it loads" + (skipped if report.unchecked else "")
        )
    return 1 if report.blockers else 0
