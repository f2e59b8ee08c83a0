"""``tests/combination.txt`` (what CI also runs on the other combination) names real tests."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_listed_path_exists_and_holds_tests() -> None:
    lines = (TESTS / "combination.txt").read_text().splitlines()
    listed = [line for line in lines if line.strip() and not line.startswith("#")]
    assert listed
    for entry in listed:
        path = TESTS.parent / entry
        assert path.exists(), f"tests/combination.txt names {entry}, which does not exist"
        files = [path] if path.is_file() else list(path.glob("test_*.py"))
        assert files and all(f.name.startswith("test_") for f in files), entry
