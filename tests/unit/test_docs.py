"""Every public name in the API reference has a docstring with an example."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _documented() -> list[str]:
    text = DOCS.read_text()
    names = []
    for block in re.split(r"^::: ", text, flags=re.M)[1:]:
        target = block.split()[0]
        members = re.search(r"members: \[([^\]]*)\]", block)
        if members:
            names += [f"{target}.{m.strip()}" for m in members.group(1).split(",")]
        else:
            names.append(target)
    return names


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_api_reference_covers_every_public_name_with_an_example() -> None:
    names = _documented()
    assert len(names) > 30
    missing = [n for n in names if "Example" not in (inspect.getdoc(_resolve(n)) or "")]
    assert missing == []
    import lightning_mcore_ckpt

    for name in lightning_mcore_ckpt.__all__:
        if name != "__version__":
            assert f"lightning_mcore_ckpt.{name}" in names, name
