"""A benchmark run cut short keeps what it measured: the results are written while it runs, and a
time limit's SIGTERM marks them as cut short and leaves no rank running (the GPU machine's run
has a few minutes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]


def test_results_are_on_disk_while_it_runs_and_a_sigterm_marks_them_cut_short(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks", "--quick", "--skip-hf-export", "--skip-dedup"]
    command += ["--out", str(out), "--dir", str(tmp_path / "scratch")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    bench = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        # The first configuration's figures are written as soon as it is measured, while the
        # restart rows are still to come.
        deadline = time.monotonic() + 700
        figures = None
        while time.monotonic() < deadline and bench.poll() is None:
            written = list(out.glob("*-quick.json"))
            if written:
                data = json.loads(written[0].read_text())
                if data["runs"]:
                    figures = data
                    break
            time.sleep(0.5)
        assert figures is not None, "no results written while the benchmark ran"
        assert bench.poll() is None, "the benchmark ended before it could be cut short"
        assert "restart" not in figures  # written before the next rows were measured
        (run,) = figures["runs"]
        assert run["methods"]["ours-sync"]["save_s"]["median"] > 0
        assert (out / f"{written[0].stem}.progress-quick-1p.json").exists()
        assert "### State quick, 1 process(es), cpu" in written[0].with_suffix(".md").read_text()
        ranks = psutil.Process(bench.pid).children(recursive=True)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if bench.poll() is None:
            bench.kill()
    data = json.loads(written[0].read_text())
    assert data["cut_short"] is True and len(data["runs"]) == 1
    assert "The run was cut short" in written[0].with_suffix(".md").read_text()
    # Nothing it started goes on (ranks, the server they were forked from).
    _, alive = psutil.wait_procs(ranks, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
