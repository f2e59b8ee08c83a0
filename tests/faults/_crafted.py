"""Checkpoint files crafted to run code when they are unpickled, as an attacker would make them.

Each runs ``touch <marker>``: a test proves that loading refused the file by the marker's
absence, and that the file really runs code by loading it the unsafe way afterwards.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import shlex
import zipfile
from pathlib import Path
from typing import Any

import torch


class RunsCommand:
    """Unpickling this calls ``os.system(command)``.

    Copies of it are itself (``copy.deepcopy`` would otherwise go through ``__reduce__`` and
    run the command while the state is being saved): only unpickling runs it.
    """

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))

    def __copy__(self) -> RunsCommand:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> RunsCommand:
        return self


def touching(marker: Path) -> RunsCommand:
    """An object whose unpickling creates ``marker``."""
    return RunsCommand(f"touch {shlex.quote(str(marker))}")


def crafted_index(directory: Path, marker: Path) -> None:
    """Replace a torch_dist directory's ``.metadata`` index with one that creates ``marker``."""
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(touching(marker), f)


def replace_objects(directory: Path, key_prefix: str, value: Any) -> list[str]:
    """Point every non-tensor object of ``directory`` whose key starts with ``key_prefix`` at
    ``value`` (``torch.save`` bytes appended to its shard file); returns the keys replaced."""
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the crafting side: this is our own, real index
    buffer = io.BytesIO()
    torch.save(value, buffer)
    data = buffer.getvalue()
    replaced = []
    for index, info in metadata.storage_data.items():
        if not index.fqn.startswith(key_prefix):
            continue
        shard = directory / info.relative_path
        info.offset = shard.stat().st_size
        info.length = len(data)
        with open(shard, "ab") as f:
            f.write(data)
        replaced.append(index.fqn)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return replaced


def globals_in(path: Path) -> set[str]:
    """Every global a ``torch.save`` file names (read with pickletools: nothing is loaded)."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    return {
        str(arg).replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"
    }


def relist(step: Path) -> None:
    """Record a crafted step's files, sizes and digests in its metadata.json, and seal it, as a
    whole crafted step (not a damaged one) would carry them: digests are integrity checks, not
    signatures."""
    import json

    from lightning_mcore_ckpt.format import integrity, markers

    meta = json.loads((step / markers.METADATA_FILE).read_text())
    files = [
        p
        for p in sorted(step.rglob("*"))
        if p.is_file() and p.relative_to(step).as_posix() != markers.METADATA_FILE
    ]
    meta["files"] = {p.relative_to(step).as_posix(): p.stat().st_size for p in files}
    meta["hashes"] = {p.relative_to(step).as_posix(): integrity.hash_file(p) for p in files}
    meta[integrity.METADATA_HASH] = integrity.json_digest(meta)
    (step / markers.METADATA_FILE).write_text(json.dumps(meta))
