"""``docs/promises.md`` names, for each promise, the tests that prove it and whether CI runs them:
every test it names exists, and its "In CI" cell agrees with what ``.ci/run`` does with those
files.

What CI does (``.ci/run``, ``docs/testing.md``): the whole suite on Python 3.12, and on Python
3.11 the files and directories that ``tests/combination.txt`` lists ("both combinations"); cells
marked ``nodes_extended`` are skipped there (run by hand with ``-m nodes_extended``); the tests
under ``tests/gpu`` skip without CUDA (run on a GPU machine).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PROMISES = ROOT / "docs" / "promises.md"
COMBINATION = TESTS / "combination.txt"

_FILE = re.compile(r"^(?P<path>[\w./-]+\.py)(?:::(?P<name>\w+))?(?:\[.*\])?$")
_NAME_ONLY = re.compile(r"^::(?P<name>\w+)(?:\[.*\])?$")


@dataclass(frozen=True)
class Promise:
    number: int
    proven_by: str
    in_ci: str


def _cells(row: str) -> list[str]:
    """A Markdown table row's cells; a ``|`` inside a code span does not split."""
    cells, current, in_code = [], "", False
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += char
    return [*cells, current.strip()]


def promises(text: str) -> list[Promise]:
    """The rows of the promises table, read by its header's column names."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = _cells(next(row for row in rows if "Proven by" in row))
    proven = next(i for i, name in enumerate(header) if name.startswith("Proven by"))
    in_ci = header.index("In CI")
    found = []
    for row in rows:
        cells = _cells(row)
        if cells[0].isdigit():
            found.append(Promise(int(cells[0]), cells[proven], cells[in_ci]))
    return found


def _resolve(path: str) -> Path:
    """A test path as the table writes it: under ``tests/``, with or without that prefix."""
    return ROOT / path if path.startswith("tests/") else TESTS / path


def named_tests(proven_by: str) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The files and the ``file::test`` names a "Proven by" cell names; a ``::test`` on its own
    is in the file named last before it."""
    paths: list[Path] = []
    names: list[tuple[Path, str]] = []
    for span in re.findall(r"`([^`]+)`", proven_by):
        if match := _FILE.match(span):
            paths.append(_resolve(match["path"]))
            if match["name"]:
                names.append((paths[-1], match["name"]))
        elif match := _NAME_ONLY.match(span):
            assert paths, f"{span!r} names a test before any file"
            names.append((paths[-1], match["name"]))
    return paths, names


def in_combination(path: Path, listed: list[Path]) -> bool:
    """Whether ``path`` is, or lies under, an entry of ``tests/combination.txt``."""
    return any(path == entry or entry in path.parents for entry in listed)


def _combination() -> list[Path]:
    lines = COMBINATION.read_text().splitlines()
    return [ROOT / line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _has_extended_cells(path: Path) -> bool:
    return path.exists() and "nodes_extended" in path.read_text()


def disagreements(promise: Promise, listed: list[Path]) -> list[str]:
    """What the promise's "In CI" cell claims that its named tests do not bear out."""
    paths, _ = named_tests(promise.proven_by)
    claims = {
        "both combinations": (
            "both combinations" in promise.in_ci,
            any(in_combination(path, listed) for path in paths),
        ),
        "the extended cells": (
            "extended" in promise.in_ci,
            any(_has_extended_cells(path) for path in paths),
        ),
        "the GPU machine": (
            "GPU" in promise.in_ci,
            any(TESTS / "gpu" in path.parents for path in paths),
        ),
    }
    return [
        f"promise {promise.number}: {'mentions' if said else 'does not mention'} {what}, "
        f"but {'none' if said else 'one'} of its named tests bears it out"
        for what, (said, true) in claims.items()
        if said != true
    ]


PROMISES_TABLE = promises(PROMISES.read_text())


def test_the_table_has_every_promise_in_order_with_its_in_ci_cell() -> None:
    numbers = [promise.number for promise in PROMISES_TABLE]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 19
    assert all(promise.in_ci for promise in PROMISES_TABLE)


@pytest.mark.parametrize("promise", PROMISES_TABLE, ids=lambda p: f"promise-{p.number}")
def test_every_test_a_promise_names_exists(promise: Promise) -> None:
    paths, names = named_tests(promise.proven_by)
    assert paths, f"promise {promise.number} names no test"
    assert [str(p.relative_to(ROOT)) for p in paths if not p.exists()] == []
    missing = [
        f"{path.relative_to(ROOT)}::{name}"
        for path, name in names
        if not re.search(rf"^\s*(async\s+)?def {name}\(", path.read_text(), re.M)
    ]
    assert missing == []


@pytest.mark.parametrize("promise", PROMISES_TABLE, ids=lambda p: f"promise-{p.number}")
def test_each_in_ci_cell_says_what_ci_runs_of_its_tests(promise: Promise) -> None:
    assert disagreements(promise, _combination()) == []


def test_a_wrong_in_ci_cell_is_caught() -> None:
    """Each claim of promise 18's cell, flipped in turn, and its files dropped from the list."""
    row = next(promise for promise in PROMISES_TABLE if promise.number == 18)
    listed = _combination()
    assert disagreements(row, listed) == []
    for claim in ("both combinations", "extended", "GPU"):
        wrong = Promise(row.number, row.proven_by, row.in_ci.replace(claim, "-"))
        assert len(disagreements(wrong, listed)) == 1, claim
    paths, _ = named_tests(row.proven_by)
    unlisted = [entry for entry in listed if not any(in_combination(p, [entry]) for p in paths)]
    assert len(unlisted) < len(listed)
    assert len(disagreements(row, unlisted)) == 1


def test_a_test_name_alone_is_in_the_file_named_before_it() -> None:
    cell = "`nodes/test_fast_tier.py::first` (cells); `[a-b]`; `::second[c]`; `tests/unit/x.py`"
    paths, names = named_tests(cell)
    fast_tier = TESTS / "nodes" / "test_fast_tier.py"
    assert paths == [fast_tier, TESTS / "unit" / "x.py"]
    assert names == [(fast_tier, "first"), (fast_tier, "second")]
