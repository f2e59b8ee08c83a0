"""All-pairs coverage of the resume matrix: every value of every axis must meet every value of
every other axis in at least one cell (pure logic, used by tests/resume/test_matrix.py)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

Cell = dict[str, Any]


def uncovered(axes: Mapping[str, Sequence[Any]], cells: Sequence[Cell]) -> list[tuple[Any, ...]]:
    """The (axis, value, axis, value) pairs that no cell covers."""
    missing = []
    for (a, av), (b, bv) in itertools.combinations(axes.items(), 2):
        for x, y in itertools.product(av, bv):
            if not any(c[a] == x and c[b] == y for c in cells):
                missing.append((a, x, b, y))
    return missing
