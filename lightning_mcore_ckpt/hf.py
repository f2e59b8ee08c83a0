"""Hugging Face export and import through mbridge: names, formats, streaming, validation.

Three operations share one converter (mbridge's name maps and tensor formats for the model
family of ``hf_model_path``):

- :func:`export_checkpoint`: a saved step (any TP/PP/DP layout) to a Hugging Face directory. It
  reads the dist-checkpoint on disk slice by slice (one layer of one weight at a time, all
  tensor-parallel pieces of it), so no process ever holds the whole model, and needs no process
  group: rank 0 runs it in the background during training, the CLI on one CPU process.
- :func:`load_hf_weights`: Hugging Face weights into a live, sharded Megatron-Core model; each
  rank reads only the layers of its pipeline stage and keeps its tensor-parallel part.
- :func:`import_checkpoint`: a Hugging Face directory to a step directory that
  ``trainer.fit(ckpt_path=...)`` (or ``MegatronStrategy(init_from=...)``) takes weights from.

Megatron-Core checkpoints name tensors the way Transformer Engine layers do
(``linear_qkv.layer_norm_weight``) with either layer spec, which are the names mbridge maps; the
local-spec model used on CPU is built here (mbridge's ``get_model`` hard-codes Transformer Engine
and ``.cuda()``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_mcore_ckpt import _atomic, _compat, _cpu, layout

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

__all__ = [
    "HF_DIR",
    "HFBridge",
    "HFExport",
    "check_model_matches",
    "export_checkpoint",
    "import_checkpoint",
    "is_exported",
    "load_hf_weights",
    "supported_model_types",
    "verify_export",
]

log = logging.getLogger(__name__)

HF_DIR = layout.HF_DIR
"""Name of a step's Hugging Face copy."""
WHEN = ("end", "every_save", "never")
_LAYERS = "decoder.layers."
_EMBEDDING = "embedding.word_embeddings.weight"
_VOCAB_KEYS = (_EMBEDDING, "output_layer.weight")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


# --- public settings ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HFExport:
    """When and how :class:`~lightning_mcore_ckpt.MegatronCheckpoint` writes a Hugging Face copy.

    Args:
        hf_model_path: a local Hugging Face model directory (``config.json``; tokenizer files,
            ``generation_config.json`` and the safetensors index are mirrored when present). Its
            model family must be one mbridge supports; its shapes must be the trained model's.
        when: ``"end"``: exactly one export, when ``fit`` ends, into the final step's
            ``huggingface/`` (the final step is saved if it was not; a resumed run that already
            exported that step does not again). ``"every_save"``: into every step.
            ``"never"``: only steps whose ``save_contents`` include ``"hf_model"``.
        dtype: dtype of the exported weights (default: the checkpoint's).

    Example::

        MegatronCheckpoint(
            "checkpoints/sft",
            every_n_train_steps=500,
            hf_export=HFExport("Qwen2.5-0.5B", when="end", dtype=torch.bfloat16),
        )
    """

    hf_model_path: str | os.PathLike[str]
    when: Literal["end", "every_save", "never"] = "end"
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.when not in WHEN:
            raise ValueError(
                f"HFExport(when={self.when!r}): use one of {list(WHEN)} ('end': one export when "
                "fit ends; 'every_save': into every step; 'never')"
            )
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(
                f"HFExport(dtype={self.dtype!r}): pass a torch.dtype such as torch.bfloat16, or "
                "None for the checkpoint's dtype"
            )
        # Fails early, naming the path, for a missing directory or an unsupported model family.
        HFBridge(self.hf_model_path, argument="HFExport(hf_model_path=...)")

    @property
    def path(self) -> Path:
        return Path(self.hf_model_path).expanduser()


def supported_model_types() -> list[str]:
    """Hugging Face ``model_type`` values mbridge can convert.

    Example::

        >>> "qwen2" in supported_model_types()
        True
    """
    import mbridge  # noqa: F401 - registers the model families
    from mbridge.core.bridge import _MODEL_REGISTRY

    return sorted(_MODEL_REGISTRY)


def is_exported(step: str | os.PathLike[str]) -> bool:
    """Whether a step directory holds a finished Hugging Face export (it is renamed into place)."""
    return (Path(step) / HF_DIR / "config.json").is_file()


# --- the converter --------------------------------------------------------------------------


class HFBridge:
    """mbridge's conversion for the model family of one Hugging Face directory.

    Name maps and tensor formats (fused QKV, gate/up) come from mbridge; this class adds what a
    checkpoint-level converter needs: layer-stacked checkpoint names, vocabulary padding, shape
    checks against the Hugging Face config, and a model builder that works without Transformer
    Engine.

    Example::

        bridge = HFBridge("Qwen2.5-0.5B")  # in LightningModule.configure_model
        self.model = bridge.gpt_model(bridge.transformer_config())
    """

    def __init__(
        self,
        hf_model_path: str | os.PathLike[str],
        dtype: torch.dtype | None = None,
        argument: str = "hf_model_path",
    ) -> None:
        path = Path(hf_model_path).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            raise FileNotFoundError(
                f"{argument}: {str(hf_model_path)!r} {what}; pass a local Hugging Face model "
                "directory (config.json, tokenizer files, safetensors weights)"
            )
        try:
            raw = json.loads((path / "config.json").read_text())
        except ValueError as err:
            raise ValueError(
                f"{argument}: {path / 'config.json'} is not valid JSON: {err}"
            ) from err
        model_type = raw.get("model_type")
        supported = supported_model_types()
        if model_type not in supported:
            raise ValueError(
                f"{argument}: {path} has model_type={model_type!r}, which mbridge does not "
                f"convert; supported model types: {', '.join(supported)}"
            )
        from mbridge.core.bridge import _MODEL_REGISTRY
        from mbridge.core.parallel_states import ParallelStates
        from transformers import AutoConfig

        self.path = path
        self.hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        named = raw.get("torch_dtype") or raw.get("dtype")
        config_dtype = getattr(torch, named, None) if isinstance(named, str) else None
        self.config_dtype: torch.dtype = (
            config_dtype if isinstance(config_dtype, torch.dtype) else torch.float32
        )
        self.dtype = dtype or self.config_dtype
        base = _MODEL_REGISTRY[model_type]
        # mbridge edits class-level name maps for tied embeddings; give this instance its own.
        maps = {
            name: dict(getattr(base, name))
            for name in ("_DIRECT_MAPPING", "_ATTENTION_MAPPING", "_MLP_MAPPING", "_OTHER_MAPPING")
            if isinstance(getattr(base, name, None), dict)
        }
        if "_DIRECT_MAPPING" in maps and not getattr(self.hf_config, "tie_word_embeddings", False):
            maps["_DIRECT_MAPPING"]["output_layer.weight"] = "lm_head.weight"
        cls = type(f"_{base.__name__}", (base,), maps)
        self.bridge = cls(
            _compat.mbridge_hf_config(self.hf_config),
            dtype=self.dtype,
            parallel_states=ParallelStates(),
        )
        self.model_type: str = model_type
        self.vocab_size: int = int(self.hf_config.vocab_size)
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))

    # names and formats

    def hf_names(self, mcore_name: str) -> list[str]:
        """Hugging Face names of one Megatron-Core tensor (layer-indexed, no module prefix)."""
        try:
            return list(self.bridge._weight_name_mapping_mcore_to_hf(mcore_name))
        except (NotImplementedError, KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"Megatron-Core tensor {mcore_name!r} has no Hugging Face counterpart in "
                f"mbridge's {self.model_type} mapping ({err})"
            ) from err

    def to_hf(self, mcore_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One full (tensor-parallel merged) Megatron-Core tensor as Hugging Face tensors."""
        if mcore_name.endswith(_VOCAB_KEYS) and tensor.shape[0] > self.vocab_size:
            tensor = tensor[: self.vocab_size]  # Megatron-Core's vocabulary padding
        names, tensors = self.bridge._weight_to_hf_format(mcore_name, tensor)
        if self.tied and mcore_name == "output_layer.weight":
            return []  # the same tensor as the embedding
        return list(zip(names, tensors, strict=True))

    def to_mcore(
        self, mcore_name: str, hf_tensors: Sequence[torch.Tensor], rows: int | None = None
    ) -> torch.Tensor:
        """Hugging Face tensors as one full Megatron-Core tensor (``rows``: padded vocabulary)."""
        out = self.bridge._weight_to_mcore_format(mcore_name, list(hf_tensors))
        if rows is not None and mcore_name.endswith(_VOCAB_KEYS) and rows > out.shape[0]:
            pad = out.new_zeros((rows - out.shape[0], *out.shape[1:]))
            out = torch.cat([out, pad])
        return out

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the Hugging Face model's tensors (built on the meta device: free)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.hf_config)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if self.tied:
            shapes.pop("lm_head.weight", None)
        return {k: v for k, v in shapes.items() if not k.endswith("rotary_emb.inv_freq")}

    # the model

    def transformer_config(self, **overrides: Any) -> TransformerConfig:
        """The Megatron-Core ``TransformerConfig`` of this model for the current parallel layout.

        mbridge's config, made runnable where it is not by default: sequence parallelism only
        with tensor parallelism, and on CPU what :mod:`lightning_mcore_ckpt._cpu` requires.
        ``overrides`` win.
        """
        from megatron.core import parallel_state

        settings: dict[str, Any] = {}
        if parallel_state.model_parallel_is_initialized():
            settings.update(
                tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                pipeline_model_parallel_size=(
                    parallel_state.get_pipeline_model_parallel_world_size()
                ),
                context_parallel_size=parallel_state.get_context_parallel_world_size(),
                expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            )
        settings["sequence_parallel"] = settings.get("tensor_model_parallel_size", 1) > 1
        settings["pipeline_dtype"] = self.dtype
        settings["params_dtype"] = self.dtype
        settings["bf16"] = self.dtype is torch.bfloat16
        settings["fp16"] = self.dtype is torch.float16
        settings.update(_cpu.transformer_config_overrides())
        settings.update(overrides)
        config = self.bridge.config
        return dataclasses.replace(config, **settings)

    def gpt_model(
        self,
        config: TransformerConfig | None = None,
        pre_process: bool | None = None,
        post_process: bool | None = None,
    ) -> torch.nn.Module:
        """A Megatron-Core ``GPTModel`` of this architecture for the current parallel layout.

        Transformer Engine layers when it is installed, Megatron-Core's local layers otherwise
        (CPU). Weights are randomly initialised: load them with :func:`load_hf_weights` or from a
        checkpoint.
        """
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        config = config or self.transformer_config()
        if _has_transformer_engine():
            spec = self.bridge._get_transformer_layer_spec()
        else:
            spec = get_gpt_layer_local_spec(
                qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
                normalization=config.normalization,
            )
        initialized = parallel_state.model_parallel_is_initialized()
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage() if initialized else True
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage() if initialized else True
        args = self.bridge._get_gptmodel_args()
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=self.tied,
            **args,
        )


def _has_transformer_engine() -> bool:
    try:
        import transformer_engine  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


# --- reading a dist-checkpoint slice by slice, without a process group ----------------------


@dataclasses.dataclass(frozen=True)
class _Slice:
    key: str
    """The checkpoint key (module prefix included)."""
    layer: int | None
    """Index on the stacked layer axis, or None for an unstacked tensor."""
    shape: tuple[int, ...]
    """Shape of the slice (without the layer axis)."""
    dtype: torch.dtype


class _CheckpointReader:
    """Reads the tensors of one dist-checkpoint directory (``model/``) on one process."""

    def __init__(self, model_dir: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        class IndexReadOnce(FileSystemReader):
            # dcp.load reads the index at every call; an export makes one call per tensor.
            _index: Any = None

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                if self._index is None:
                    self._index = super().read_metadata(*args, **kwargs)
                return self._index

        self.dir = model_dir
        self.reader = IndexReadOnce(str(model_dir))
        metadata = self.reader.read_metadata()
        self.tensors = {
            k: v
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }

    def slices(self, prefix: str) -> list[tuple[str, _Slice]]:
        """``(mcore_name, slice)`` for every tensor under ``prefix``, one per layer if stacked."""
        out = []
        for key, md in self.tensors.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            shape = tuple(md.size)
            dtype = md.properties.dtype
            if name.startswith(_LAYERS):
                rest = name[len(_LAYERS) :]
                for layer in range(shape[0]):
                    out.append((f"{_LAYERS}{layer}.{rest}", _Slice(key, layer, shape[1:], dtype)))
            else:
                out.append((name, _Slice(key, None, shape, dtype)))
        return out

    def read(self, wanted: Mapping[str, _Slice]) -> dict[str, torch.Tensor]:
        """Load the given slices (``{request id: slice}``) in one pass over the files."""
        import torch.distributed.checkpoint as dcp

        if not wanted:
            return {}
        out = {rid: torch.empty(s.shape, dtype=s.dtype) for rid, s in wanted.items()}
        planner = _SlicePlanner({rid: (s, out[rid]) for rid, s in wanted.items()})
        dcp.load({}, storage_reader=self.reader, planner=planner, no_dist=True)
        return out


class _SlicePlanner(LoadPlanner):
    """Load slices of checkpoint tensors into given buffers, with or without a process group."""

    def __init__(self, requests: Mapping[str, tuple[_Slice, torch.Tensor]]) -> None:
        self.requests = dict(requests)

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for rid, (piece, _) in self.requests.items():
            md = self.metadata.state_dict_metadata[piece.key]
            if piece.layer is None:
                offsets, sizes = [0] * len(piece.shape), list(piece.shape)
            else:
                offsets, sizes = [piece.layer] + [0] * len(piece.shape), [1, *piece.shape]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for item in create_read_items_for_chunk_list(piece.key, md, [chunk]):
                # Requests are keyed by id: one checkpoint key may be read for several layers.
                index = MetadataIndex(rid, item.dest_index.offset, item.dest_index.index)
                items.append(dataclasses.replace(item, dest_index=index))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise RuntimeError(f"unexpected non-tensor read of {read_item.storage_index}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece, dest = self.requests[read_item.dest_index.fqn]
        view = dest if piece.layer is None else dest.unsqueeze(0)
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None


def _module_prefix(keys: Iterable[str], source: Path) -> str:
    prefixes = sorted({k[: -len(_EMBEDDING)] for k in keys if k.endswith(_EMBEDDING)})
    if len(prefixes) != 1:
        found = "no" if not prefixes else f"{len(prefixes)} ({', '.join(prefixes)})"
        raise ValueError(
            f"{source}: found {found} GPT embedding tensors (*{_EMBEDDING}); the Hugging Face "
            "bridge converts a checkpoint of exactly one Megatron-Core GPT model"
        )
    return prefixes[0]


# --- export ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _ExportPlan:
    files: dict[str, list[str]]
    """Output file -> Hugging Face names in it, in order."""
    sources: dict[str, tuple[str, _Slice]]
    """Hugging Face name -> (Megatron-Core name, checkpoint slice) it comes from."""
    sharded: bool
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Hugging Face name -> shape."""


def _plan_export(
    bridge: HFBridge,
    reader: _CheckpointReader,
    source: Path,
    max_shard_bytes: int,
    dtype: torch.dtype | None,
) -> _ExportPlan:
    prefix = _module_prefix(reader.tensors, source)
    expected = bridge.expected_hf_shapes()
    sources: dict[str, tuple[str, _Slice]] = {}
    produced: dict[str, tuple[int, ...]] = {}
    problems: list[str] = []
    for mcore_name, piece in reader.slices(prefix):
        bridge.hf_names(mcore_name)  # a clear error for a tensor mbridge cannot name
        try:
            outputs = bridge.to_hf(mcore_name, torch.empty(piece.shape, device="meta"))
        except (RuntimeError, AssertionError, ValueError) as err:
            problems.append(f"{prefix}{mcore_name} {list(piece.shape)}: cannot convert ({err})")
            continue
        for hf_name, tensor in outputs:
            sources[hf_name] = (mcore_name, piece)
            produced[hf_name] = tuple(tensor.shape)
    for name, shape in produced.items():
        want = expected.get(name)
        if want is None:
            problems.append(f"{name} {list(shape)}: not in the Hugging Face model")
        elif want != shape:
            problems.append(f"{name}: checkpoint gives {list(shape)}, config expects {list(want)}")
    missing = sorted(set(expected) - set(produced))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        problems.append(
            f"{len(missing)} Hugging Face tensors have no source in the checkpoint: {shown}"
        )
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise ValueError(
            f"the checkpoint {source} does not match the Hugging Face config "
            f"{bridge.path / 'config.json'} ({bridge.model_type}):\n  {shown}{more}\n"
            "pass the Hugging Face model this checkpoint was trained from"
        )
    names = list(produced)
    index = bridge.path / _INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name in sorted(names, key=lambda n: (weight_map.get(n, "~extra.safetensors"), n)):
            files.setdefault(weight_map.get(name, "model-extra.safetensors"), []).append(name)
        return _ExportPlan(files, sources, sharded=True, shapes=produced)
    if (bridge.path / _SINGLE).is_file():
        return _ExportPlan({_SINGLE: sorted(names)}, sources, sharded=False, shapes=produced)
    # No weights to mirror: shards of at most max_shard_bytes, in name order.
    files = {}
    current: list[str] = []
    size = 0
    for name in sorted(names, key=_natural_key):
        _, piece = sources[name]
        nbytes = math.prod(produced[name]) * (dtype or piece.dtype).itemsize
        if current and size + nbytes > max_shard_bytes:
            files[f"part-{len(files)}"] = current
            current, size = [], 0
        current.append(name)
        size += nbytes
    files[f"part-{len(files)}"] = current
    if len(files) == 1:
        return _ExportPlan({_SINGLE: files["part-0"]}, sources, sharded=False, shapes=produced)
    total = len(files)
    named = {
        f"model-{i + 1:05d}-of-{total:05d}.safetensors": v for i, v in enumerate(files.values())
    }
    return _ExportPlan(named, sources, sharded=True, shapes=produced)


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _copy_side_files(hf_dir: Path, out: Path, bridge: HFBridge, dtype: torch.dtype) -> None:
    for entry in sorted(hf_dir.iterdir()):
        if not entry.is_file() or entry.name in ("config.json", _INDEX):
            continue
        if entry.name.endswith(_WEIGHT_SUFFIXES) or entry.name.startswith("."):
            continue
        shutil.copy2(entry, out / entry.name)
    if dtype == bridge.config_dtype:
        shutil.copy2(hf_dir / "config.json", out / "config.json")
    else:
        config = json.loads((hf_dir / "config.json").read_text())
        name = str(dtype).removeprefix("torch.")
        for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
            config[key] = name
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_checkpoint(
    step: str | os.PathLike[str],
    hf_model_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    require_complete: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Write the weights of a saved step as a Hugging Face model directory ``out``.

    Works for any layout the step was saved with and needs no process group. Memory: one output
    file (the source model's shard size) plus one slice being converted. Everything is written
    into a temporary sibling of ``out`` that is renamed into place at the end, so ``out`` is
    either absent, the old content (``overwrite``), or complete. Checked before anything is
    written: the step is complete (unless ``require_complete=False``), ``out`` is absent or empty
    (or ``overwrite``), the model family is supported and the checkpoint's shapes match the
    Hugging Face config. Returns a summary (tensors, bytes, seconds).

    Example::

        export_checkpoint("checkpoints/sft/global_step_3000", "Qwen2.5-0.5B", "qwen-sft")
    """
    start = time.perf_counter()
    step_path = Path(step).expanduser()
    model_dir = step_path / "model"
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"export: {step_path} is not a step directory (it has no model/); pass a "
            "global_step_<N> directory of a MegatronCheckpoint run"
        )
    if require_complete and not layout.is_complete(step_path):
        raise ValueError(
            f"export: {step_path} is incomplete (no valid {layout.METADATA_FILE}: its save never "
            "committed); export a complete step instead (see `lightning-mcore-ckpt ls`)"
        )
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(
            f"export: --out {target} exists and is not empty; choose a new directory or pass "
            "--overwrite (overwrite=True) to replace it"
        )
    bridge = HFBridge(hf_model_path, argument="--hf-model")
    reader = _CheckpointReader(model_dir)
    plan = _plan_export(bridge, reader, step_path, max_shard_bytes, dtype)
    out_dtype = dtype or next(iter(plan.sources.values()))[1].dtype
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    try:
        summary = _write_export(bridge, reader, plan, partial, out_dtype, progress)
        _copy_side_files(bridge.path, partial, bridge, out_dtype)
        _fsync_tree(partial)
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            target.rename(old)
            partial.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(target)
        _atomic.fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    summary["seconds"] = time.perf_counter() - start
    summary["path"] = str(target)
    return summary


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class _SafetensorsWriter:
    """One safetensors file written tensor by tensor, in any order, never held whole.

    The header is known up front from the shapes, so each tensor goes to its place as soon as
    it is converted. The layout is the one ``safetensors.torch.save_file`` produces for tensors
    of one dtype (names sorted, data contiguous in that order, header padded to 8 bytes), so the
    files are byte-identical to it.
    """

    def __init__(self, path: Path, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype):
        self.dtype = dtype
        self.item = torch.empty((), dtype=dtype).element_size()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self.offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name in sorted(shapes):
            size = math.prod(shapes[name]) * self.item
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shapes[name]),
                "data_offsets": [offset, offset + size],
            }
            self.offsets[name] = (offset, tuple(shapes[name]))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((8 - len(text) % 8) % 8)
        self.base = 8 + len(text)
        self.size = offset
        self.file = open(path, "wb")
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.file.truncate(self.base + offset)
        self.missing = set(shapes)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, shape = self.offsets[name]
        if tuple(tensor.shape) != shape:
            raise RuntimeError(
                f"export: {name} has shape {list(tensor.shape)}, planned {list(shape)}"
            )
        data = tensor.detach().to(self.dtype).contiguous().reshape(-1).view(torch.uint8)
        self.file.seek(self.base + offset)
        self.file.write(data.numpy().data)
        self.missing.discard(name)

    def close(self) -> None:
        self.file.close()
        if self.missing:
            raise RuntimeError(f"export: tensors never written: {sorted(self.missing)[:5]}")


def _write_export(
    bridge: HFBridge,
    reader: _CheckpointReader,
    plan: _ExportPlan,
    out: Path,
    dtype: torch.dtype,
    progress: bool | None,
) -> dict[str, Any]:
    # Memory: one Megatron-Core tensor slice (e.g. one layer's fused QKV) and what it converts
    # to; outputs that belong to a later file wait for it (rare, and small).
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(plan.sources), desc="export", unit="tensor")
    pending: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total_bytes = total_params = 0
    try:
        for number, (filename, names) in enumerate(plan.files.items(), start=1):
            writer = _SafetensorsWriter(out / filename, {n: plan.shapes[n] for n in names}, dtype)
            try:
                wanted = set(names)
                for name in names:
                    if name in pending:
                        writer.write(name, pending.pop(name))
                        continue
                    if name not in writer.missing:
                        continue  # written with an earlier name of the same source tensor
                    mcore_name, piece = plan.sources[name]
                    tensor = reader.read({mcore_name: piece})[mcore_name]
                    for hf_name, value in bridge.to_hf(mcore_name, tensor):
                        if hf_name in wanted:
                            writer.write(hf_name, value)
                        else:
                            pending[hf_name] = value.to(dtype).clone()
                        if bar is not None:
                            bar.update(1)
                    del tensor
            finally:
                writer.close()
            total_bytes += writer.size
            total_params += sum(math.prod(plan.shapes[n]) for n in names)
            weight_map.update(dict.fromkeys(names, filename))
            log.info("export: wrote %s (%d/%d)", filename, number, len(plan.files))
    finally:
        if bar is not None:
            bar.close()
    if plan.sharded:
        # As transformers writes it.
        index = {
            "metadata": {"total_parameters": total_params, "total_size": total_bytes},
            "weight_map": weight_map,
        }
        (out / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"tensors": len(weight_map), "bytes": total_bytes, "files": len(plan.files)}


def _fsync_tree(path: Path) -> None:
    for entry in path.iterdir():
        if entry.is_file():
            with open(entry, "rb") as f:
                os.fsync(f.fileno())
    _atomic.fsync_dir(path)


# --- Hugging Face weights into a live model -------------------------------------------------


class _HFReader:
    """Reads named tensors from a Hugging Face directory's safetensors files, lazily."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        index = hf_dir / _INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: hf_dir / v for k, v in weight_map.items()}
        else:
            files = sorted(hf_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{hf_dir} has no safetensors weights (model.safetensors or an index); "
                    "convert the model to safetensors first"
                )
            self.where = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        self.where[key] = file

    def get(self, names: Sequence[str]) -> list[torch.Tensor]:
        out = []
        for name in names:
            if name not in self.where:
                raise KeyError(name)
            with self._open(str(self.where[name]), framework="pt") as f:
                out.append(f.get_tensor(name))
        return out


def _local_pieces(
    sharded_state_dict: dict[str, Any], prefixes: Sequence[str]
) -> list[tuple[str, Any, list[int]]]:
    """``(mcore_name, sharded tensor, offsets without the layer axis)`` of a live model."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    out = []
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        prefix = next((p for p in prefixes if sh.key.startswith(p)), None)
        if prefix is None:
            continue
        name = sh.key[len(prefix) :]
        offsets = list(sh.global_offset)
        if sh.prepend_axis_num:
            layer = offsets[0]
            offsets = offsets[sh.prepend_axis_num :]
            if name.startswith(_LAYERS):
                name = f"{_LAYERS}{layer}.{name[len(_LAYERS) :]}"
        out.append((name, sh, offsets))
    return out


def check_model_matches(
    bridge: HFBridge,
    sharded_state_dict: dict[str, Any],
    prefixes: Sequence[str],
    argument: str = "hf_model_path",
) -> None:
    """Raise when a live model's tensors do not have the shapes the Hugging Face config implies.

    Checks this rank's tensors (their global shapes), without reading any weights.
    """
    expected = bridge.expected_hf_shapes()
    problems = []
    checked: set[str] = set()
    for name, sh, _ in _local_pieces(sharded_state_dict, prefixes):
        if name in checked:
            continue
        checked.add(name)
        want = tuple(sh.global_shape[sh.prepend_axis_num :])
        try:
            hf_names = bridge.hf_names(name)
        except ValueError as err:
            problems.append(str(err))
            continue
        missing = [n for n in hf_names if n not in expected]
        if missing:
            problems.append(f"{sh.key}: the Hugging Face model has no {', '.join(missing)}")
            continue
        fake = [torch.empty(expected[n], device="meta") for n in hf_names]
        rows = want[0] if name.endswith(_VOCAB_KEYS) else None
        try:
            got = tuple(bridge.to_mcore(name, fake, rows=rows).shape)
        except (RuntimeError, AssertionError, ValueError) as err:
            problems.append(f"{sh.key} {list(want)}: cannot be built from the config ({err})")
            continue
        if got != want:
            problems.append(f"{sh.key}: the model has {list(want)}, the config gives {list(got)}")
    if problems:
        shown = "\n  ".join(problems[:12])
        raise ValueError(
            f"{argument}={str(bridge.path)!r}: the model does not match this Hugging Face config "
            f"({bridge.model_type}):\n  {shown}\npass the Hugging Face model the Megatron-Core "
            "model was built from"
        )


def load_hf_weights(
    prefixes: Sequence[str],
    hf_model_path: str | os.PathLike[str],
    sharded_state_dict: Callable[[], dict[str, Any]],
) -> int:
    """Copy Hugging Face weights into live Megatron-Core modules, each rank its own shards.

    ``sharded_state_dict()`` returns the modules' sharded state dict; ``prefixes`` are the key
    prefixes of the GPT models in it (``"model."`` for ``self.model``). Each rank reads only the layers
    it holds and keeps its tensor-parallel part; tensors are checked against the Hugging Face
    shapes first. Returns the number of tensors loaded.

    Example::

        load_hf_weights(["model."], "Qwen2.5-0.5B", strategy.model_sharded_state_dict)
    """
    bridge = HFBridge(hf_model_path, argument="init_from")
    check_model_matches(bridge, sharded_state_dict(), prefixes, argument="init_from")
    reader = _HFReader(bridge.path)
    cache: dict[str, torch.Tensor] = {}
    count = 0
    for name, sh, offsets in _local_pieces(sharded_state_dict(), prefixes):
        if name not in cache:
            cache.clear()  # pieces of one tensor (gate/up halves) arrive one after the other
            hf_names = bridge.hf_names(name)
            try:
                hf_tensors = reader.get(hf_names)
            except KeyError as err:
                raise ValueError(
                    f"init_from={bridge.path}: the model's {sh.key} needs {err.args[0]!r}, which "
                    "is not in its weights; is this the model's Hugging Face checkpoint?"
                ) from None
            rows = sh.global_shape[sh.prepend_axis_num] if name.endswith(_VOCAB_KEYS) else None
            cache[name] = bridge.to_mcore(name, hf_tensors, rows=rows)
        full = cache[name]
        want = tuple(sh.global_shape[sh.prepend_axis_num :])
        if tuple(full.shape) != want:
            raise ValueError(
                f"init_from={bridge.path}: {sh.key} has shape {list(want)} in the model but "
                f"{list(full.shape)} from the Hugging Face weights; the model does not match "
                "its config"
            )
        piece = full
        for dim, (start, length) in enumerate(zip(offsets, sh.local_shape, strict=True)):
            piece = piece.narrow(dim, start, length)
        with torch.no_grad():
            sh.data.copy_(piece)
        count += 1
    return count


# --- import ---------------------------------------------------------------------------------


def import_checkpoint(
    hf_model_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write a Hugging Face model as a step directory of Megatron-Core weights (``model/``).

    ``prefix`` is the attribute path of the GPT model in the LightningModule that will load it
    (``"model."`` for ``self.model``), as the strategy names checkpoint keys. Runs on one process
    (a single-rank group is created when none exists); the model is held in memory once. The
    step gets a ``metadata.json`` (contents ``["model"]``), so ``fit(ckpt_path=out)`` starts
    from these weights with a fresh optimizer and training state.

    Example::

        import_checkpoint("Qwen2.5-0.5B", "init/qwen", prefix="model.")
        trainer.fit(module, ckpt_path="init/qwen")  # or MegatronStrategy(init_from="init/qwen")
    """
    import torch.distributed as dist

    from lightning_mcore_ckpt import _parallel

    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(
            f"import: --out {target} exists and is not empty; choose a new directory or pass "
            "--overwrite to replace it"
        )
    if not prefix.endswith(".") and prefix:
        raise ValueError(
            f"import: --prefix {prefix!r} must end with '.' (the LightningModule attribute path "
            "of the GPT model, e.g. 'model.')"
        )
    bridge = HFBridge(hf_model_path, dtype=dtype, argument="import: hf_dir")
    start = time.perf_counter()
    from megatron.core import parallel_state

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise RuntimeError("import_checkpoint runs on one process (world size 1)")
    created_dist = not dist.is_initialized()
    created_mp = not parallel_state.model_parallel_is_initialized()
    launch_env = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved_env = {k: os.environ.get(k) for k in launch_env}
    if created_mp:
        if created_dist:
            from lightning_mcore_ckpt.testing import find_free_port

            os.environ.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(find_free_port()),
            )
        _parallel.initialize(backend="gloo")
    try:
        model: Any = bridge.gpt_model()

        def ssd() -> dict[str, Any]:
            return dict(model.sharded_state_dict(prefix=prefix))

        count = load_hf_weights([prefix], bridge.path, ssd)
        partial = target.parent / f".{target.name}.partial-{os.getpid()}"
        if partial.exists():
            shutil.rmtree(partial)
        (partial / layout.MODEL_DIR).mkdir(parents=True)
        try:
            from megatron.core import dist_checkpointing

            dist_checkpointing.save(ssd(), str(partial / layout.MODEL_DIR))
            metadata = {
                "format_version": layout.METADATA_FORMAT_VERSION,
                "global_step": 0,
                "epoch": 0,
                "contents": ["model"],
                "imported_from": str(bridge.path),
                "model_type": bridge.model_type,
                "module_prefix": prefix,
                "dtype": str(bridge.dtype).removeprefix("torch."),
            }
            _atomic.write_json(partial / layout.METADATA_FILE, metadata)
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial.rename(target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    finally:
        if created_mp:
            parallel_state.destroy_model_parallel()
        if created_dist:
            dist.destroy_process_group()
        # A launcher started after this (e.g. Lightning's) must not mistake this process for
        # one of its ranks.
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"tensors": count, "path": str(target), "seconds": time.perf_counter() - start}


# --- verify ---------------------------------------------------------------------------------


@dataclasses.dataclass
class VerifyResult:
    """What :func:`verify_export` found."""

    compared: int = 0
    max_abs_diff: float = 0.0
    worst: str | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    atol: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and self.max_abs_diff <= self.atol


def _safetensors_files(hf_dir: Path) -> dict[str, list[str]]:
    from safetensors import safe_open

    index = hf_dir / _INDEX
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(file, []).append(name)
        return files
    out = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out[file.name] = list(f.keys())
    if not out:
        raise FileNotFoundError(f"{hf_dir} has no safetensors weights")
    return out


def verify_export(
    exported: str | os.PathLike[str],
    reference: str | os.PathLike[str],
    atol: float = 0.0,
) -> VerifyResult:
    """Compare a Hugging Face directory with a reference, tensor by tensor.

    ``reference`` is another Hugging Face directory, or a step directory (converted on the fly
    with the exported directory's config, cast to its dtypes). Names, shapes and dtypes must be
    equal and values within ``atol`` (0: bit-identical). Streams one file at a time.

    Example::

        result = verify_export("qwen-sft", "checkpoints/sft/global_step_3000")
        assert result.ok, result.problems
    """
    from safetensors import safe_open

    out_dir = Path(exported).expanduser()
    ref = Path(reference).expanduser()
    if not (out_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"verify: {out_dir} is not a Hugging Face directory (no config.json)"
        )
    result = VerifyResult(atol=atol)
    files = _safetensors_files(out_dir)
    names = {n for ns in files.values() for n in ns}
    if (ref / "model").is_dir():
        bridge = HFBridge(out_dir, argument="verify")
        reader = _CheckpointReader(ref / "model")
        plan = _plan_export(bridge, reader, ref, DEFAULT_MAX_SHARD_BYTES, None)
        ref_names = set(plan.sources)

        def reference_tensors(wanted: Sequence[str]) -> dict[str, torch.Tensor]:
            slices = {plan.sources[n][0]: plan.sources[n][1] for n in wanted}
            got: dict[str, torch.Tensor] = {}
            for mcore_name, tensor in reader.read(slices).items():
                got.update(bridge.to_hf(mcore_name, tensor))
            return {n: got[n] for n in wanted}

        cast_to_exported = True
    elif (ref / "config.json").is_file():
        ref_files = _safetensors_files(ref)
        where = {n: ref / f for f, ns in ref_files.items() for n in ns}
        ref_names = set(where)

        def reference_tensors(wanted: Sequence[str]) -> dict[str, torch.Tensor]:
            got = {}
            for n in wanted:
                with safe_open(str(where[n]), framework="pt") as f:
                    got[n] = f.get_tensor(n)
            return got

        cast_to_exported = False
    else:
        raise FileNotFoundError(
            f"verify: --reference {ref} is neither a Hugging Face directory (config.json) nor a "
            "step directory (model/)"
        )
    for name in sorted(names - ref_names):
        result.problems.append(f"{name}: only in {out_dir}")
    for name in sorted(ref_names - names):
        result.problems.append(f"{name}: only in {ref}")
    for file, file_names in files.items():
        common = [n for n in file_names if n in ref_names]
        theirs = reference_tensors(common)
        with safe_open(str(out_dir / file), framework="pt") as f:
            for name in common:
                mine = f.get_tensor(name)
                other = theirs.pop(name)
                if cast_to_exported:
                    other = other.to(mine.dtype)
                result.compared += 1
                if mine.shape != other.shape:
                    result.problems.append(
                        f"{name}: shape {list(mine.shape)} != {list(other.shape)}"
                    )
                    continue
                if mine.dtype != other.dtype:
                    result.problems.append(f"{name}: dtype {mine.dtype} != {other.dtype}")
                    continue
                diff = (mine.double() - other.double()).abs().max().item() if mine.numel() else 0.0
                if diff != diff:  # NaN
                    diff = math.inf
                if diff > result.max_abs_diff:
                    result.max_abs_diff, result.worst = diff, name
    return result
