"""Export: a saved step (any TP/PP/DP layout) to a Hugging Face directory, streamed.

:func:`export_checkpoint` reads the dist-checkpoint on disk slice by slice, so no process ever
holds the whole model, and needs no process group. The directory is staged and renamed into
place (:func:`lightning_mcore_ckpt.storage.atomic.staged_directory`): it appears complete or not at
all. :class:`HFExport` is the callback's setting for when to export.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch

import lightning_mcore_ckpt.hf._adapters as _adapters
import lightning_mcore_ckpt.hf._heads as _heads
from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._plan import DEFAULT_MAX_SHARD_BYTES, ExportPlan, plan_export
from lightning_mcore_ckpt.hf._reader import SliceReader, module_prefix
from lightning_mcore_ckpt.hf._refused import refused
from lightning_mcore_ckpt.hf._safetensors import INDEX, SafetensorsWriter, write_index
from lightning_mcore_ckpt.hf._upload import check_upload_options
from lightning_mcore_ckpt.safety.names import inside
from lightning_mcore_ckpt.storage import atomic as _atomic

__all__ = ["HF_DIR", "WHEN", "HFExport", "export_checkpoint", "is_exported"]

log = logging.getLogger(__name__)

HF_DIR = layout.HF_DIR
"""Name of a step's Hugging Face copy."""
WHEN = ("end", "every_save", "never")
"""The values of :attr:`HFExport.when`."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


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
        head: ``"auto"`` (the checkpoint's output layer decides), ``"lm"``, ``"value"``
            (``*ForTokenClassification``, verl's critic layout) or ``"reward"``
            (``*ForSequenceClassification``): see :func:`export_checkpoint`.
        check_logits: after each export, run fixed token batches through it and through the
            step's Megatron-Core model (a CPU subprocess, fp32: :func:`check_logits`); an
            export whose logits differ by more than 1e-3 is removed and reported failed.
        upload_to: a Hub model repository, ``"org/name"``: each export is checked against its
            step, then pushed there in the background (rank 0) as one commit naming the step;
            training never waits for it (see ``docs/hf-hub.md``). ``None``: no upload.
        private: create the repository private (an existing public one is refused).
        upload_attempts: attempts per upload (with backoff) before it is reported failed.
        upload_timeout_s: how long the end of ``fit`` waits for an upload in flight.
        adapters: for a model with LoRA adapters (:func:`~lightning_mcore_ckpt.add_lora`):
            ``"merged"`` (the adapters added into the weights: a plain model) or ``"peft"``
            (the adapters alone, PEFT's layout); see :func:`export_checkpoint`.

    Example::

        MegatronCheckpoint(
            "checkpoints/sft",
            every_n_train_steps=500,
            hf_export=HFExport("/models/Qwen2.5-0.5B", when="end", dtype=torch.bfloat16),
        )
    """

    hf_model_path: str | os.PathLike[str]
    when: Literal["end", "every_save", "never"] = "end"
    dtype: torch.dtype | None = None
    head: Literal["auto", "lm", "value", "reward"] = "auto"
    check_logits: bool = False
    upload_to: str | None = None
    private: bool = True
    upload_attempts: int = 3
    upload_timeout_s: float = 3600.0
    adapters: Literal["merged", "peft"] = "merged"

    def __post_init__(self) -> None:
        _adapters.check_adapters_args(self.adapters, None, "HFExport")
        if self.head not in _heads.HEAD_ARG_CHOICES:
            raise refused(
                f"HFExport(head={self.head!r}): use one of {list(_heads.HEAD_ARG_CHOICES)} "
                "('auto': what the checkpoint's output layer is)"
            )
        if self.upload_to is not None:
            args = (self.upload_to, self.private, self.upload_attempts, self.upload_timeout_s)
            check_upload_options(*args, where="HFExport")
        if self.when not in WHEN:
            raise refused(
                f"HFExport(when={self.when!r}): use one of {list(WHEN)} ('end': one export when "
                "fit ends; 'every_save': into every step; 'never')"
            )
        writable = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        if self.dtype is not None and self.dtype not in writable:
            raise refused(
                f"HFExport(dtype={self.dtype!r}): pass one of "
                f"{', '.join(str(d) for d in writable)}, or None for the checkpoint's dtype"
            )
        # Fails early, naming the path, for a missing directory or an unsupported model family.
        HFBridge(self.hf_model_path, argument="HFExport(hf_model_path=...)")

    @property
    def path(self) -> Path:
        return Path(self.hf_model_path).expanduser()


def refuse_replacing_inputs(target: Path, what: str, **inputs: Path) -> None:
    """Refuse an ``out`` that is one of the inputs or contains one (replacing it would delete
    what is being read), before anything is written."""
    out = Path(os.path.realpath(target.expanduser()))
    for name, source in inputs.items():
        src = Path(os.path.realpath(source.expanduser()))
        if out == src or out in src.parents:
            raise ValueError(
                f"{what}: --out {target} is the --{name.replace('_', '-')} directory {source} "
                "or contains it; writing there would delete what is being read. Choose an "
                "--out outside it"
            )


is_exported = layout.is_exported
"""Whether a step directory holds a finished Hugging Face export (see the format's own)."""


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
    head: str = "auto",
    adapters: str = "merged",
    lora_alpha: float | None = None,
) -> dict[str, Any]:
    """Write the weights of a saved step as a Hugging Face model directory ``out``.

    Works for any layout the step was saved with and needs no process group. Memory: one output
    file (the source model's shard size) plus one slice being converted. Everything is written
    into a temporary sibling of ``out`` that is renamed into place at the end, so ``out`` is
    either absent, the old content (``overwrite``), or complete. Checked before anything is
    written: ``out`` is neither the step, the Hugging Face model, nor a directory containing
    either; the step is complete (unless ``require_complete=False``), ``out`` is absent or empty
    (or ``overwrite``), the model family is supported and the checkpoint's shapes match the
    Hugging Face config. Returns a summary (tensors, bytes, seconds).

    ``head``: ``"auto"`` writes what the checkpoint's output layer is: a causal LM, or for a
    one-output value head the family's ``*ForTokenClassification`` (``"value"``, verl's critic
    layout) unless ``hf_model_path`` is a ``*ForSequenceClassification`` (``"reward"``); pass
    ``"value"`` or ``"reward"`` to choose (see :mod:`lightning_mcore_ckpt.hf._heads`).

    ``adapters`` (a checkpoint with LoRA adapters): ``"merged"`` writes the weights with
    ``alpha / rank * B @ A`` added; ``"peft"`` writes only ``adapter_config.json`` and
    ``adapter_model.safetensors`` for ``peft.PeftModel.from_pretrained`` on ``hf_model_path``.
    ``lora_alpha``: for adapters saved without their alpha (see ``docs/hf-lora.md``).

    Example::

        export_checkpoint("checkpoints/sft/global_step_3000", "/models/Qwen2.5-0.5B", "qwen-sft")
    """
    _adapters.check_adapters_args(adapters, lora_alpha, "export")
    start = time.perf_counter()
    step_path = Path(step).expanduser()
    target = Path(out).expanduser()
    refuse_replacing_inputs(target, "export", step=step_path, hf_model=Path(hf_model_path))
    model_dir = step_path / layout.MODEL_DIR
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"export: {step_path} is not a step directory (it has no {layout.MODEL_DIR}/); pass "
            "a global_step_<N> directory of a MegatronCheckpoint run"
        )
    if require_complete and not layout.is_complete(step_path):
        raise ValueError(
            f"export: {step_path} is incomplete (no valid {markers.METADATA_FILE}: its save never "
            "committed); export a complete step instead (see `lightning-mcore-ckpt ls`)"
        )
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(
            f"export: --out {target} exists and is not empty; choose a new directory or pass "
            "--overwrite (overwrite=True) to replace it"
        )
    reader = _adapters.open_adapters(SliceReader(model_dir), step_path, adapters, lora_alpha)
    bridge = HFBridge(hf_model_path, argument="--hf-model")
    chosen = _heads.resolve(head, bridge.head, output_rows(reader, step_path), "head")
    if chosen != bridge.head:
        bridge = HFBridge(hf_model_path, argument="--hf-model", head=chosen)
    plan = plan_export(bridge, reader, step_path, max_shard_bytes, dtype)
    out_dtype = dtype or next(iter(plan.sources.values()))[1].dtype
    # An existing `out` is empty or `overwrite` was given (checked above): replace it.
    with _atomic.staged_directory(target, replace=True) as partial:
        if adapters == "peft":
            summary = _adapters.write_peft_adapter(bridge, reader, partial, dtype, str(bridge.path))
        else:
            summary = _write_export(bridge, reader, plan, partial, out_dtype, progress)
            _copy_side_files(bridge.path, partial, bridge, out_dtype)
    summary["seconds"] = time.perf_counter() - start
    summary["path"] = str(target)
    return summary


def output_rows(reader: SliceReader, step: Path) -> int | None:
    """Rows of the checkpoint's output layer (1: a value head), None when it has none (tied)."""
    md = reader.tensors.get(f"{module_prefix(reader.tensors, step)}output_layer.weight")
    return None if md is None else int(md.size[0])


def _copy_side_files(hf_dir: Path, out: Path, bridge: HFBridge, dtype: torch.dtype) -> None:
    """Tokenizer, generation config and other files of ``hf_dir``; its config with ``dtype``."""
    for entry in sorted(hf_dir.iterdir()):
        if not entry.is_file() or entry.name in ("config.json", INDEX):
            continue
        if entry.name.endswith(_WEIGHT_SUFFIXES) or entry.name.startswith("."):
            continue
        shutil.copy2(entry, out / entry.name)
    config = bridge.export_config(dtype)
    if config is None:
        shutil.copy2(hf_dir / "config.json", out / "config.json")
    else:
        _atomic.write_json(out / "config.json", config)


def _write_export(
    bridge: HFBridge,
    reader: SliceReader,
    plan: ExportPlan,
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
            path = inside(out, filename, "the export's file list")
            writer = SafetensorsWriter(path, {n: plan.shapes[n] for n in names}, dtype)
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
        write_index(out, weight_map, total_params, total_bytes)
    return {"tensors": len(weight_map), "bytes": total_bytes, "files": len(plan.files)}
