"""``lightning-mcore-ckpt diff``: what differs between two steps, tensor by tensor.

The steps may have been saved in different layouts (TP/PP/DP/EP): tensors are compared whole,
as the checkpoint's global tensors, read straight from each step's dist-checkpoint on one
process without a process group. A mixture of experts saves each routed expert weight as one
tensor of every expert, whichever rank held which expert; it is read one expert at a time, and a
difference names the experts it is in. Memory stays bounded: each tensor is read in slices of
whole rows (``chunk_bytes`` per step at a time), never a whole model.

Example::

    from lightning_mcore_ckpt.cli import diff

    result = diff.diff_steps("run/global_step_100", "run/global_step_200")
    for t in result.differing:
        print(t.key, t.max_abs, t.differing, "of", t.numel)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt.cli.failure import fail
from lightning_mcore_ckpt.format import layout

if TYPE_CHECKING:  # torch is imported where a comparison runs: the parser imports this module
    import torch

__all__ = ["StepDiff", "TensorDiff", "add_parsers", "diff_steps"]


@dataclass
class TensorDiff:
    """One tensor present in both steps.

    Example::

        t = diff_steps(a, b).tensors[0]
        print(t.key, t.differing, "of", t.numel, "max |a-b|", t.max_abs)
    """

    key: str
    part: str
    """``model`` or ``optim``."""
    shape: list[int]
    dtype: str
    numel: int
    differing: int = 0
    """Elements that are not equal (NaN equals NaN)."""
    max_abs: float = 0.0
    """Largest ``|a - b|``."""
    max_rel: float = 0.0
    """``max_abs`` relative to the largest ``|a|`` of the tensor (0 when ``a`` is all zeros
    and so is the difference)."""
    experts: list[str] = field(default_factory=list)
    """For a mixture of experts' routed expert weight (one tensor of every expert): the experts
    that differ, each by its parameter's name in a model with every expert on one process
    (``decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight``: layer 1, expert 3)."""


@dataclass
class StepDiff:
    """What :func:`diff_steps` found: ``a`` and ``b`` as given.

    Example::

        result = diff_steps(a, b)
        print(result.identical, result.only_a, result.only_b, result.changed)
    """

    a: Path
    b: Path
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    """Keys in both whose shape or dtype differ (``key: a -> b``)."""
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def differing(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.differing]

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.changed or self.differing)

    def to_json(self) -> dict[str, Any]:
        return {
            "a": str(self.a),
            "b": str(self.b),
            "identical": self.identical,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "changed": self.changed,
            "compared": len(self.tensors),
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
        }


_EXPERTS = re.compile(r"(?P<head>.*decoder\.layers\.)(?P<layer>\d+\.)?mlp\.experts\.experts\.")
"""A routed expert weight: ``experts.experts.<weight>`` of every layer (a GPT model stacks the
layers on the first axis, the experts on the second) or of one layer (a hybrid model: the
experts on the first axis)."""


def _expert_axes(match: re.Match[str] | None) -> int:
    """How many leading axes index one expert (layer and expert, or expert): 0 when ``match``
    (of :data:`_EXPERTS` in a key) is None, not an expert weight."""
    return 0 if match is None else 1 if match["layer"] else 2


def _expert_name(key: str, match: re.Match[str], index: tuple[int, ...]) -> str:
    """The name of one expert's weight (``index``: its leading axes) in a model that holds
    every expert: ``...decoder.layers.<l>.mlp.experts.local_experts.<e>.<weight>``."""
    layer = match["layer"] or f"{index[0]}."
    return f"{match['head']}{layer}mlp.experts.local_experts.{index[-1]}.{key[match.end() :]}"


def _blocks(
    md: Any, chunk_bytes: int, whole_axes: int
) -> Iterator[tuple[tuple[int, ...], list[int], list[int]]]:
    """``(index, offsets, sizes)`` of the blocks a tensor is read in: one index at a time along
    its first ``whole_axes`` axes (one expert of one layer), then slices of whole rows along
    the next axis, ``chunk_bytes`` each (all of a 0-d tensor)."""
    import torch

    shape = list(md.size)
    if not shape:
        yield (), [], []
        return
    lead, rest = shape[:whole_axes], shape[whole_axes:]
    itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
    step = max(1, chunk_bytes // max(1, math.prod(rest[1:]) * itemsize)) if rest else 1
    for index in itertools.product(*(range(n) for n in lead)):
        ones = [1] * len(index)
        if not rest:
            yield index, list(index), ones
            continue
        for start in range(0, rest[0], step):
            rows = min(step, rest[0] - start)
            tail = [0] * (len(rest) - 1)
            yield index, [*index, start, *tail], [*ones, rows, *rest[1:]]


def _read(reader: Any, key: str, md: Any, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """The block of a checkpoint tensor at ``offsets`` of ``sizes`` (all of a 0-d one)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from lightning_mcore_ckpt.hf._reader import SlicePlanner

    out = torch.empty(sizes, dtype=md.properties.dtype)

    class Rows(SlicePlanner):  # type: ignore[misc]
        def create_local_plan(self) -> Any:
            from torch.distributed.checkpoint.metadata import MetadataIndex
            from torch.distributed.checkpoint.planner import LoadPlan
            from torch.distributed.checkpoint.planner_helpers import (
                create_read_items_for_chunk_list,
            )

            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items = [
                dataclasses.replace(
                    item, dest_index=MetadataIndex("rows", item.dest_index.offset, None)
                )
                for item in create_read_items_for_chunk_list(key, md, [chunk])
            ]
            return LoadPlan(items)

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            view = out
            for dim, (begin, length) in enumerate(
                zip(read_item.dest_offsets, read_item.lengths, strict=True)
            ):
                view = view.narrow(dim, begin, length)
            return view

    dcp.load({}, storage_reader=reader.reader, planner=Rows({}), no_dist=True)
    return out


def _compare(a: torch.Tensor, b: torch.Tensor, found: TensorDiff, scale: list[float]) -> int:
    """Add one block's differences to ``found``; the elements of the block that differ."""
    import torch

    x, y = a.double(), b.double()
    both_nan = torch.isnan(x) & torch.isnan(y)
    unequal = (x != y) & ~both_nan
    differing = int(unequal.sum())
    found.differing += differing
    if found.differing:
        delta = (x - y).abs().masked_fill(both_nan, 0.0)
        found.max_abs = max(found.max_abs, float(delta.max()))
    if x.numel():
        scale[0] = max(scale[0], float(x.abs().masked_fill(torch.isnan(x), 0.0).max()))
    return differing


def _diff_part(a: Path, b: Path, part: str, chunk_bytes: int, result: StepDiff) -> None:
    from lightning_mcore_ckpt.hf._reader import SliceReader

    ra, rb = SliceReader(a), SliceReader(b)
    keys_a, keys_b = set(ra.tensors), set(rb.tensors)
    result.only_a += sorted(f"{part}/{k}" for k in keys_a - keys_b)
    result.only_b += sorted(f"{part}/{k}" for k in keys_b - keys_a)
    for key in sorted(keys_a & keys_b):
        ma, mb = ra.tensors[key], rb.tensors[key]
        shape_a, shape_b = list(ma.size), list(mb.size)
        dtype_a, dtype_b = ma.properties.dtype, mb.properties.dtype
        if shape_a != shape_b or dtype_a != dtype_b:
            result.changed.append(
                f"{part}/{key}: {shape_a} {str(dtype_a)[6:]} -> {shape_b} {str(dtype_b)[6:]}"
            )
            continue
        found = TensorDiff(key, part, shape_a, str(dtype_a)[6:], math.prod(shape_a))
        scale = [0.0]
        expert = _EXPERTS.search(key)
        for index, offsets, sizes in _blocks(ma, chunk_bytes, _expert_axes(expert)):
            block_a = _read(ra, key, ma, offsets, sizes)
            differing = _compare(block_a, _read(rb, key, mb, offsets, sizes), found, scale)
            if differing and expert is not None:
                name = _expert_name(key, expert, index)
                if name not in found.experts:
                    found.experts.append(name)
        found.max_rel = found.max_abs / scale[0] if scale[0] else 0.0
        result.tensors.append(found)


def diff_steps(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    optimizer: bool = False,
    chunk_bytes: int = 64 << 20,
) -> StepDiff:
    """Compare the weights (and with ``optimizer``, the optimizer state) of two steps.

    Raises ``FileNotFoundError`` when either is not a step with ``model/``.

    Example::

        result = diff_steps("tp2/global_step_100", "tp1/global_step_100", optimizer=True)
        assert result.identical  # a resharded copy
    """
    result = StepDiff(Path(a), Path(b))
    parts = [layout.MODEL_DIR] + ([layout.OPTIM_DIR] if optimizer else [])
    for step in (result.a, result.b):
        if not (step / layout.MODEL_DIR / ".metadata").is_file():
            raise FileNotFoundError(f"{step} is not a step directory with {layout.MODEL_DIR}/")
    for part in parts:
        da, db = result.a / part, result.b / part
        missing = [str(d) for d in (da, db) if not (d / ".metadata").is_file()]
        if missing:
            raise FileNotFoundError(f"--optimizer: {', '.join(missing)} does not exist")
        _diff_part(da, db, part, chunk_bytes, result)
    return result


def add_parsers(commands: Any) -> None:
    """Add ``diff`` to the command line's subparsers."""
    compare = commands.add_parser(
        "diff",
        help="compare two steps tensor by tensor (any layouts), in bounded memory",
        description="Compare the weights of two steps (and with --optimizer, the optimizer "
        "state), whatever layouts saved them: keys only in A or only in B, shape and dtype "
        "changes, and per tensor the elements that differ, the largest |a-b| and its size "
        "relative to the largest |a|. Read slice by slice (--chunk-mib per step at a time). "
        "Exit code 0 when identical, 1 when they differ.",
    )
    compare.add_argument("a", help="a step directory")
    compare.add_argument("b", help="another step directory")
    compare.add_argument("--optimizer", action="store_true", help="also compare optim/")
    compare.add_argument(
        "--chunk-mib", type=float, default=64, help="MiB of a tensor read at once (default 64)"
    )
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.set_defaults(handler=_diff)


def _diff(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.chunk_mib <= 0:
        return fail(f"--chunk-mib: {args.chunk_mib} is not a positive size")
    try:
        result = diff_steps(
            args.a, args.b, optimizer=args.optimizer, chunk_bytes=int(args.chunk_mib * 2**20)
        )
    except (FileNotFoundError, ValueError) as err:
        return fail(err)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0 if result.identical else 1
    for key in result.only_a:
        print(f"only in A: {key}")
    for key in result.only_b:
        print(f"only in B: {key}")
    for change in result.changed:
        print(f"changed:   {change}")
    for t in result.differing:
        print(
            f"differs:   {t.part}/{t.key} {t.shape} {t.dtype}: {t.differing} of {t.numel} "
            f"elements, max |a-b| {t.max_abs:.6g} ({t.max_rel:.3g} of max |a|)"
        )
        for name in t.experts:
            print(f"  in expert {name}")
    print(
        f"compared {len(result.tensors)} tensors: {len(result.differing)} differ"
        + ("; identical" if result.identical else "")
    )
    return 0 if result.identical else 1
