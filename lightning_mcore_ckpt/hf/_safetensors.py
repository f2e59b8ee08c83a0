"""Safetensors files of a Hugging Face directory: a streaming writer and the readers.

- :class:`SafetensorsWriter`: one file written tensor by tensor, byte-identical to
  ``safetensors.torch.save_file``.
- :func:`write_index`: the ``model.safetensors.index.json`` of a sharded model.
- :class:`HFReader`: named tensors read lazily from a directory's files.
- :func:`safetensors_files`: which tensors each file holds.

Imports nothing from the package but :mod:`lightning_mcore_ckpt.storage.atomic`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt.safety.names import inside
from lightning_mcore_ckpt.storage import atomic as _atomic

__all__ = [
    "INDEX",
    "SINGLE",
    "HFReader",
    "SafetensorsWriter",
    "safetensors_files",
    "write_index",
]

INDEX = "model.safetensors.index.json"
"""The index of a sharded Hugging Face model (tensor name -> file)."""
SINGLE = "model.safetensors"
"""The one weights file of an unsharded Hugging Face model."""

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


class SafetensorsWriter:
    """One safetensors file written tensor by tensor, in any order, never held whole.

    The header is known up front from the shapes, so each tensor goes to its place as soon as
    it is converted. The layout is the one ``safetensors.torch.save_file`` produces for tensors
    of one dtype (names sorted, data contiguous in that order, header padded to 8 bytes), so the
    files are byte-identical to it.
    """

    def __init__(
        self, path: Path, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype
    ) -> None:
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


def write_index(
    hf_dir: Path, weight_map: Mapping[str, str], total_parameters: int, total_size: int
) -> None:
    """Write ``hf_dir``'s safetensors index (atomically), as transformers writes it."""
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(weight_map),
    }
    _atomic.write_json(hf_dir / INDEX, index)


class HFReader:
    """Reads named tensors from a Hugging Face directory's safetensors files, lazily."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        index = hf_dir / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            source = f"{index}'s weight_map"
            self.where = {k: inside(hf_dir, v, source) for k, v in weight_map.items()}
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


def safetensors_files(hf_dir: Path) -> dict[str, list[str]]:
    """``{file name: tensor names in it}`` of a Hugging Face directory (from its index if any)."""
    from safetensors import safe_open

    index = hf_dir / INDEX
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            inside(hf_dir, file, f"{index}'s weight_map")
            files.setdefault(file, []).append(name)
        return files
    out = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out[file.name] = list(f.keys())
    if not out:
        raise FileNotFoundError(f"{hf_dir} has no safetensors weights")
    return out
