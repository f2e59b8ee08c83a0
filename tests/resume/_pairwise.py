"""All-pairs coverage of the resume matrix: every value of every axis must meet every value of
every other axis in at least one cell (pure logic, used by tests/resume/test_matrix.py)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

Cell = dict[str, Any]


Pair = tuple[str, Any, str, Any]


def _is_excluded(pair: Pair, excluded: Collection[Pair]) -> bool:
    a, x, b, y = pair
    return pair in excluded or (b, y, a, x) in excluded


def uncovered(
    axes: Mapping[str, Sequence[Any]], cells: Sequence[Cell], excluded: Collection[Pair] = ()
) -> list[Pair]:
    """The (axis, value, axis, value) pairs that no cell covers, but those ``excluded`` (pairs
    of values that cannot meet)."""
    missing = []
    for (a, av), (b, bv) in itertools.combinations(axes.items(), 2):
        for x, y in itertools.product(av, bv):
            if _is_excluded((a, x, b, y), excluded):
                continue
            if not any(c[a] == x and c[b] == y for c in cells):
                missing.append((a, x, b, y))
    return missing


def excluded_pairs_met(cells: Sequence[Cell], excluded: Collection[Pair]) -> list[Pair]:
    """The ``excluded`` pairs that some cell nevertheless contains."""
    return [p for p in excluded if any(c[p[0]] == p[1] and c[p[2]] == p[3] for c in cells)]


def coverage_problems(
    axes: Mapping[str, Sequence[Any]],
    rows: Sequence[Sequence[Any]],
    excluded: Collection[Pair] = (),
) -> list[Any]:
    """What is wrong with a matrix's cells (``rows``: one value per axis, in the axes' order):
    the pairs no cell covers, the excluded pairs a cell contains, and the cells holding a value
    that is not one of its axis's. Empty for a matrix that covers every pair."""
    cells = [dict(zip(axes, row, strict=True)) for row in rows]
    strays = [c for c in cells if not all(c[a] in values for a, values in axes.items())]
    return [*uncovered(axes, cells, excluded), *excluded_pairs_met(cells, excluded), *strays]
