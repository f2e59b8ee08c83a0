"""``tests/combination.txt`` (what CI also runs on the other combination) names real tests, and
what ``docs/testing.md`` and ``docs/versions.md`` say CI runs on Python 3.11 is that file
exactly; the README's test command is the one CI runs on Python 3.12."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def _listed() -> list[str]:
    lines = (TESTS / "combination.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _tier(entry: str) -> str:
    return entry.split("/")[1]


def test_every_listed_path_exists_and_holds_tests() -> None:
    listed = _listed()
    assert listed
    for entry in listed:
        path = ROOT / entry
        assert path.exists(), f"tests/combination.txt names {entry}, which does not exist"
        files = [path] if path.is_file() else list(path.glob("test_*.py"))
        assert files and all(f.name.startswith("test_") for f in files), entry


def test_versions_md_names_every_entry_and_only_them() -> None:
    text = (ROOT / "docs" / "versions.md").read_text()
    section = text.split("## The two combinations in CI", 1)[1].split("\n## ", 1)[0]
    on_311, only_312 = section.split("Everything else runs on Python 3.12 only", 1)
    named = set(re.findall(r"`(tests/[\w/.]+)`", on_311)) - {"tests/combination.txt"}
    listed = set(_listed())
    assert named == listed, (
        f"docs/versions.md names {sorted(named - listed)} that tests/combination.txt does not "
        f"list, and leaves out {sorted(listed - named)}"
    )
    # What it says runs on 3.12 only holds none of the entries.
    for path in re.findall(r"`(tests/[\w/.]+)`", only_312):
        assert not [e for e in listed if e == path or e.startswith(path + "/")], path


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_testing_md_names_the_tiers_and_the_command_ci_runs() -> None:
    text = " ".join((ROOT / "docs" / "testing.md").read_text().split())
    found = re.search(
        r"on Python 3\.11 while the default environment is built, the (?P<whole>[\w ,]+?) tiers "
        r"and the (?P<partial>[\w ,]+?) tests "
        r"whose code paths differ between the two combinations, as `tests/combination.txt` "
        r"lists them .*?: `(?P<command>[^`]+)`",
        text,
    )
    assert found, "docs/testing.md no longer says what CI runs on Python 3.11 in the expected words"

    def tiers(words: str) -> set[str]:
        return set(re.split(r",\s*|\s+and\s+", words.strip()))

    listed = _listed()
    whole = {_tier(e) for e in listed if (ROOT / e).is_dir()}
    partial = {_tier(e) for e in listed if (ROOT / e).is_file()}
    assert tiers(found["whole"]) == whole, (found["whole"], whole)
    assert tiers(found["partial"]) == partial, (found["partial"], partial)
    # The command is .ci/run's own.
    assert found["command"] in _ci_lines(), found["command"]


def test_the_readme_test_command_is_the_one_ci_runs_on_python_3_12() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "\nbash scripts/test.sh " in readme
    assert "LMC_REQUIRE_OTHER=1 LMC_NODES_EXTENDED=1 bash scripts/test.sh" in _ci_lines()
    # CI's last command, word for word, is in the README too.
    assert _ci_lines()[-1] in readme, _ci_lines()[-1]
