"""All-pairs covering of the resume matrix's axes: every value of every axis meets every value
of every other axis in at least one cell (pure; checked by tests/unit/test_resume_matrix.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
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


def allpairs(
    axes: Mapping[str, Sequence[Any]], allowed: Callable[[Cell], bool] = lambda c: True
) -> list[Cell]:
    """A small set of cells covering every allowed pair (greedy, deterministic)."""
    names = list(axes)
    todo = {
        (a, x, b, y)
        for (a, av), (b, bv) in itertools.combinations(axes.items(), 2)
        for x, y in itertools.product(av, bv)
    }
    cells: list[Cell] = []
    candidates = [dict(zip(names, v, strict=True)) for v in itertools.product(*axes.values())]
    candidates = [c for c in candidates if allowed(c)]
    possible = {p for p in todo if any(c[p[0]] == p[1] and c[p[2]] == p[3] for c in candidates)}
    todo &= possible
    while todo:
        best = max(
            candidates,
            key=lambda c: sum(1 for p in todo if c[p[0]] == p[1] and c[p[2]] == p[3]),
        )
        cells.append(best)
        todo = {p for p in todo if not (best[p[0]] == p[1] and best[p[2]] == p[3])}
    return cells
