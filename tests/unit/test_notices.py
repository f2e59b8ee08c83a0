"""The known notices of the libraries underneath are hidden (or, with Lightning's banners, kept in
a log) where our entry points ask, and nowhere else: importing the package changes no filter;
everything else is still shown."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

from lightning_mcore_ckpt.notices import (
    KNOWN,
    ROUTINE,
    hide_known_notices,
    known_notices_hidden,
    python_warnings,
)


def _emit_all() -> None:
    for notice in KNOWN:
        text = f"{notice.message} (as {notice.source} says it)"
        if notice.logger:
            logging.getLogger(notice.source).warning(text)
        else:
            warnings.warn(text, notice.category, stacklevel=1)


def _emit_others() -> None:
    warnings.warn("Apex said something else", UserWarning, stacklevel=1)
    warnings.warn("a deprecation of the user's own", FutureWarning, stacklevel=1)
    logging.getLogger("megatron.core.models.gpt.gpt_model").error("a real Megatron-Core error")
    logging.getLogger("torch.utils.cpp_extension").warning("No CUDA compiler: a real problem?")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_inside_the_block_only_the_known_notices_are_hidden() -> None:
    records = _Records()
    names = {n.source for n in KNOWN if n.logger}
    for name in names:  # on each logger itself: torch's loggers may not propagate
        logging.getLogger(name).addHandler(records)
    filters = list(warnings.filters)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with known_notices_hidden(cpu=True):
                _emit_all()
                _emit_others()
            logged_inside, records.messages = records.messages, []
            _emit_all()  # after the block: shown again
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(records)
    shown = [str(w.message) for w in seen]
    assert shown[:2] == ["Apex said something else", "a deprecation of the user's own"]
    assert logged_inside == ["a real Megatron-Core error", "No CUDA compiler: a real problem?"]
    assert shown[2:] == [f"{n.message} (as {n.source} says it)" for n in KNOWN if not n.logger]
    assert records.messages == [f"{n.message} (as {n.source} says it)" for n in KNOWN if n.logger]
    assert warnings.filters == filters
    for notice in KNOWN:
        if notice.logger:
            assert logging.getLogger(notice.source).filters == []


def test_advice_for_cuda_kernels_is_hidden_on_cpu_only() -> None:
    advice = "When using async grad allreduce it is recommended to set the environment variable"
    for cpu, hidden in ((True, True), (False, False)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with known_notices_hidden(cpu=cpu):
                warnings.warn(advice, UserWarning, stacklevel=1)
        assert (seen == []) == hidden, cpu


_IMPORTS = (
    "import warnings, logging; import torch, lightning.pytorch, megatron.core; "
    "before = list(warnings.filters); "
    "import lightning_mcore_ckpt, lightning_mcore_ckpt.cli.entry, lightning_mcore_ckpt.notices; "
    "from lightning_mcore_ckpt import MegatronStrategy, MegatronCheckpoint, check_resume; "
    "assert warnings.filters == before, 'the import changed the warning filters'; "
    "loggers = [logging.getLogger(n.source) for n in lightning_mcore_ckpt.notices.KNOWN]; "
    "assert all(lg.filters == [] for lg in loggers), 'the import added logging filters'; "
)


def test_importing_the_package_changes_no_warning_filter_or_logger() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS + "print('ok')"],
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
    )
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-3000:]


def test_the_process_wide_filters_and_pythonwarnings_hide_the_same_warnings() -> None:
    script = (
        "import warnings, sys; from lightning_mcore_ckpt.notices import KNOWN; "
        "[warnings.warn(n.message + ' ...', n.category) for n in KNOWN if not n.logger]; "
        "warnings.warn('a warning of the user', UserWarning)"
    )
    for how in ("PYTHONWARNINGS", "hide_known_notices"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        code = script
        if how == "PYTHONWARNINGS":
            env["PYTHONWARNINGS"] = python_warnings(cpu=True)
        else:
            code = "from lightning_mcore_ckpt.notices import hide_known_notices as h; " + (
                "h(cpu=True); " + script
            )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
        )
        assert done.returncode == 0, done.stderr
        assert "a warning of the user" in done.stderr, how
        for notice in KNOWN:
            assert notice.message not in done.stderr, (how, notice.message)
    assert hide_known_notices.__doc__  # the entry points' call, documented


_ROUTED = """
import logging, os, sys, warnings
from lightning_mcore_ckpt.notices import KNOWN, ROUTINE, log_known_notices
if sys.argv[2] == "routed":
    log_known_notices(sys.argv[1], cpu=True)
from lightning.fabric.utilities.distributed import log as distributed
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

def emit(who):
    rank_zero_info(f"GPU available: False, used: False ({who})")  # Lightning's banners
    distributed.info(f"Initializing distributed: GLOBAL_RANK: 0 ({who})")
    for n in (*KNOWN, *ROUTINE):  # the libraries' known notices, Lightning's routine warnings
        text = f"{n.message} ({who}, as {n.source} says it)"
        if n.logger:
            logging.getLogger(n.source).warning(text)
        else:
            warnings.warn_explicit(text, n.category, who, len(text))
    logging.getLogger("lightning_mcore_ckpt.callback").warning(f"a notice of ours ({who})")
    warnings.warn_explicit(f"a warning of the user ({who})", UserWarning, who, 1)
    logging.getLogger("lightning.pytorch").error(f"an error of Lightning's ({who})")

emit("parent")
if os.fork() == 0:  # a rank forked from it (as the resume check's are)
    emit("rank")
    os._exit(0)
os.wait()
"""


def _run_routed(log: Path, how: str) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _ROUTED, str(log), how],
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr, log.read_text() if log.exists() else ""


def test_the_log_takes_lightnings_banners_and_the_known_notices_in_every_process(
    tmp_path: Path,
) -> None:
    stderr, log = _run_routed(tmp_path / "out" / "run.log", "routed")
    for who in ("parent", "rank"):
        kept = [
            f"GPU available: False, used: False ({who})",
            f"Initializing distributed: GLOBAL_RANK: 0 ({who})",
            *(f"{n.message} ({who}, as {n.source} says it)" for n in (*KNOWN, *ROUTINE)),
        ]
        shown = [
            f"a notice of ours ({who})",
            f"a warning of the user ({who})",
            f"an error of Lightning's ({who})",
        ]
        assert [t for t in kept if t not in log] == [], log
        assert [t for t in kept if t in stderr] == [], stderr
        assert [t for t in shown if t not in stderr] == [], stderr
    assert "a notice of ours" not in log and "a warning of the user" not in log


def test_without_the_log_lightnings_banners_are_on_stderr(tmp_path: Path) -> None:
    stderr, log = _run_routed(tmp_path / "run.log", "as usual")
    assert log == ""
    assert "GPU available: False, used: False (parent)" in stderr
    assert "a notice of ours (rank)" in stderr
