"""Sizes are printed in the binary unit that fits them, the same everywhere: the report's table,
``ls``, the report's plot and ``export``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.cli import report
from lightning_mcore_ckpt.cli.entry import main as cli_main


@pytest.mark.parametrize(
    ("num", "said"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (365_488, "356.9 KiB"),  # the demo's tiny Hugging Face copy
        (1_368_453, "1.3 MiB"),  # one of the demo's steps
        (5 * 1024**3, "5.0 GiB"),
        (2 * 1024**4, "2.0 TiB"),
        (3 * 1024**5, "3072.0 TiB"),
        (None, "-"),
        (True, "-"),
    ],
)
def test_a_size_is_said_in_the_unit_that_fits(num: Any, said: str) -> None:
    assert report.human_bytes(num) == said


def test_the_plot_labels_size_in_mib_as_the_table_says_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    drawn: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    steps = [
        {"global_step": s, "size_bytes": 1_368_453, "blocking_time_s": 0.05, "total_time_s": 0.1}
        for s in (6, 8)
    ]
    report.plot(report.Report(tmp_path, steps, [], 8), tmp_path / "saves.png")
    size_axis = drawn[0].axes[1]
    assert size_axis.get_ylabel() == "size (MiB)"
    assert list(size_axis.get_lines()[0].get_ydata()) == pytest.approx([1_368_453 / 2**20] * 2)


def test_export_says_a_small_model_s_size_in_kib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_mcore_ckpt import hf

    out = tmp_path / "exported"
    summary = {"tensors": 27, "bytes": 365_488, "path": str(out), "seconds": 0.2}
    monkeypatch.setattr(hf, "export_checkpoint", lambda *args, **kwargs: summary)
    step, hf_model = tmp_path / "global_step_8", tmp_path / "hf_source"
    step.mkdir(), hf_model.mkdir()
    argv = ["export", str(step), "--hf-model", str(hf_model), "--out", str(out)]
    assert cli_main(argv) == 0
    assert capsys.readouterr().out == f"exported 27 tensors (356.9 KiB) to {out} in 0.2s\n"
