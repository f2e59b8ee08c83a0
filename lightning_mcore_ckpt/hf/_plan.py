"""Export planning: which Hugging Face tensor comes from which checkpoint slice, in which file.

Everything is checked here before a byte is written: every checkpoint tensor has a Hugging Face
name and converts to the shape the Hugging Face config implies, and every Hugging Face tensor
has a source. Output files mirror the source model's (its index, or ``model.safetensors``), or
are shards of at most ``max_shard_bytes`` when it has no weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._reader import Slice, SliceReader, module_prefix
from lightning_mcore_ckpt.hf._safetensors import INDEX, SINGLE
from lightning_mcore_ckpt.safety.names import check_name

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ExportPlan", "plan_export"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Largest output file when the source model has no weights to mirror."""


@dataclasses.dataclass
class ExportPlan:
    """What an export writes, and where each tensor comes from."""

    files: dict[str, list[str]]
    """Output file -> Hugging Face names in it, in order."""
    sources: dict[str, tuple[str, Slice]]
    """Hugging Face name -> (Megatron-Core name, checkpoint slice) it comes from."""
    sharded: bool
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Hugging Face name -> shape."""


def plan_export(
    bridge: HFBridge,
    reader: SliceReader,
    source: Path,
    max_shard_bytes: int,
    dtype: torch.dtype | None,
) -> ExportPlan:
    """Plan the export of ``reader``'s checkpoint (from step ``source``) with ``bridge``.

    Raises ``ValueError`` listing what does not match the Hugging Face config.
    """
    prefix = module_prefix(reader.tensors, source)
    expected = bridge.expected_hf_shapes()
    sources: dict[str, tuple[str, Slice]] = {}
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
    index = bridge.path / INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        for filename in set(weight_map.values()):  # the export writes files by these names
            check_name(filename, f"{index}'s weight_map")
        files: dict[str, list[str]] = {}
        for name in sorted(names, key=lambda n: (weight_map.get(n, "~extra.safetensors"), n)):
            files.setdefault(weight_map.get(name, "model-extra.safetensors"), []).append(name)
        return ExportPlan(files, sources, sharded=True, shapes=produced)
    if (bridge.path / SINGLE).is_file():
        return ExportPlan({SINGLE: sorted(names)}, sources, sharded=False, shapes=produced)
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
        return ExportPlan({SINGLE: files["part-0"]}, sources, sharded=False, shapes=produced)
    total = len(files)
    named = {
        f"model-{i + 1:05d}-of-{total:05d}.safetensors": v for i, v in enumerate(files.values())
    }
    return ExportPlan(named, sources, sharded=True, shapes=produced)


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
