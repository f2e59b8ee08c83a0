"""run_distributed's ranks can use CUDA: the forkserver they are forked from never initialises it.

Torch marks every fork of a process that has asked CUDA anything (even the device count, even
on a machine without a GPU) as unable to use CUDA. These tests watch the forkserver itself, on
any machine: a spy module preloaded into it before everything else records every CUDA call made
there, and each rank reports what the spy saw in the server's memory (a forked rank inherits
it) and whether torch considers the rank a bad fork.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]

# Imported first in the forkserver: it records every call that asks or initialises CUDA there.
SPY = """
import os
import traceback

import torch

SERVER = os.getpid()  # the forkserver: this module is imported there first
CALLS = []
SPIES = {}


def _spy(owner, name):
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        CALLS.append({"pid": os.getpid(), "call": name, "stack": "".join(traceback.format_stack())})
        return original(*args, **kwargs)

    setattr(owner, name, spy)
    SPIES[name] = spy


_spy(torch._C, "_cuda_getDeviceCount")
_spy(torch._C, "_cuda_init")
_spy(torch.cuda, "_lazy_init")


def report(rank, world_size):
    import sys

    import torch

    server = sys.modules.get("lightning_mcore_ckpt.launch.forkserver")
    import gc

    meant = list(getattr(server, "_MODULES", ()))
    preloaded = [m for m in meant if m in sys.modules]
    return {
        "forked_from_server": os.getppid() == SERVER,
        "server_calls": [c for c in CALLS if c["pid"] == SERVER],
        "bad_fork": torch._C._cuda_isInBadFork(),
        "preloaded": preloaded,
        "meant": meant,
        "frozen": gc.get_freeze_count(),
        "recorded": list(getattr(server, "CUDA_INITIALISED_BY", [])),
        "preload_failed": dict(getattr(server, "PRELOAD_FAILED", {})),
        "answered_counts": list(server.answered_counts().values()) if server else [],
        # What the rank gets when it asks, itself (it may: it is the process that uses CUDA).
        "spies_in_place": torch._C._cuda_getDeviceCount is SPIES["_cuda_getDeviceCount"],
        "device_count": torch.cuda.device_count(),
        "available": torch.cuda.is_available(),
    }


def use_cuda(rank, world_size):
    torch.cuda._lazy_init()


def train_on_gpu(rank, world_size):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    total = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {
        "server_calls": [c for c in CALLS if c["pid"] == SERVER],
        "total": total.tolist(),
        "device": torch.cuda.get_device_name(),
    }
"""

# Preloaded after ours: asks CUDA for its device count, as a careless library would.
POISON = """
import torch

torch._C._cuda_getDeviceCount()
"""

MAIN = """
import json
import sys

from lightning_mcore_ckpt.launch import local as _launch
from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

import cuda_spy


def main(mode):
    _launch._PRELOAD[:0] = ["cuda_spy"]
    if mode == "poisoned":
        _launch._PRELOAD.append("cuda_poison")
        try:
            run_distributed(cuda_spy.use_cuda, 1, timeout=300)
        except DistributedFailure as failure:
            return {"failure": str(failure)}
        return {"failure": None}
    if mode == "gpu":
        return {"ranks": run_distributed(cuda_spy.train_on_gpu, 1, timeout=300)}
    ranks = run_distributed(cuda_spy.report, 2, timeout=300)
    import torch

    return {"ranks": ranks, "parent_available": torch.cuda.is_available()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
"""


def _launch(tmp_path: Path, mode: str) -> dict[str, Any]:
    (tmp_path / "cuda_spy.py").write_text(textwrap.dedent(SPY))
    (tmp_path / "cuda_poison.py").write_text(POISON)
    (tmp_path / "main.py").write_text(MAIN)
    # The forkserver finds the spy through PYTHONPATH (it is started as a fresh interpreter).
    paths = [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # as in a plain shell
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(tmp_path / "main.py"), mode],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_forkserver_never_asks_or_initialises_cuda_and_its_ranks_can(tmp_path: Path) -> None:
    out = _launch(tmp_path, "clean")
    for rank in out["ranks"]:
        assert rank["forked_from_server"]
        # Nothing asked CUDA anything in the server while torch, Lightning and Megatron-Core
        # were imported there (Megatron-Core asks torch.cuda.is_available() on import).
        assert rank["server_calls"] == [], "\n".join(c["stack"] for c in rank["server_calls"])
        assert rank["recorded"] == []
        assert rank["bad_fork"] is False
        # ... and the libraries are still imported there, so that a rank starts at once.
        assert {"lightning.pytorch", "megatron.core", "lightning_mcore_ckpt.strategy"} <= set(
            rank["meant"]
        )
        assert rank["preloaded"] == rank["meant"], "\n".join(
            f"{name} not preloaded:\n{why}" for name, why in rank["preload_failed"].items()
        )
        # What they imported is out of the garbage collector's sight in the ranks.
        assert rank["frozen"] > 100_000
        # What the libraries were told on import, when NVML could not say, is what CUDA says.
        assert all(count == rank["device_count"] for count in rank["answered_counts"])
        assert rank["spies_in_place"]  # torch's own functions are back in the ranks
        assert rank["available"] == out["parent_available"]


def test_a_rank_whose_forkserver_was_made_to_initialise_cuda_says_what_did(
    tmp_path: Path,
) -> None:
    out = _launch(tmp_path, "poisoned")
    failure = out["failure"]
    # torch's own refusal, then why: a module preloaded after ours asked CUDA in the server.
    assert "Cannot re-initialize CUDA in forked subprocess" in failure
    assert "another module preloaded into it" in failure
    assert "lightning_mcore_ckpt.launch.forkserver" in failure


def test_a_cuda_call_while_the_libraries_are_imported_is_asked_elsewhere_or_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch

    from lightning_mcore_ckpt.launch import forkserver as _forkserver

    asked_by = tmp_path / "asked_by"

    def device_count() -> int:
        asked_by.write_text(str(os.getpid()))
        return 3

    inits: list[int] = []
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", device_count, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_init", lambda: inits.append(1), raising=False)
    monkeypatch.setattr(_forkserver, "CUDA_INITIALISED_BY", [])
    monkeypatch.setattr(_forkserver, "_counts", {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with _forkserver.no_cuda_initialisation():
        assert torch._C._cuda_getDeviceCount() == 3
        assert int(asked_by.read_text()) != os.getpid()  # asked in a child process
        assert torch._C._cuda_getDeviceCount() == 3  # and once
        assert _forkserver.CUDA_INITIALISED_BY == []
        torch._C._cuda_init()
    assert inits == [1]  # still done, and recorded with where it came from
    (stack,) = _forkserver.CUDA_INITIALISED_BY
    assert "test_a_cuda_call_while_the_libraries_are_imported" in stack
    assert _forkserver.answered_counts() == {"0,1,2": 3}
    assert torch._C._cuda_getDeviceCount is device_count  # restored on the way out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_rank_started_from_a_plain_shell_trains_on_the_gpu(tmp_path: Path) -> None:
    # The failure the GPU benchmark met: from a plain shell (no Lightning imported in the parent,
    # so no NVML check set), a rank forked from the server could not initialise CUDA.
    (rank,) = _launch(tmp_path, "gpu")["ranks"]
    assert rank["server_calls"] == [], "\n".join(c["stack"] for c in rank["server_calls"])
    assert rank["total"] == [1.0] * 4 and rank["device"]
