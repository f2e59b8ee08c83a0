"""An async save's recorded blocking is its own: it never includes waiting for the previous
save's write.

On a GPU the steps between saves (about 30 ms) are far shorter than a save's write, so each
save's blocking used to include finalising the previous one (0.5 s for 1 GiB against 0.02 s of
pinned device-to-host copy). Here the steps are short and every background write is slowed by
``SLOW`` seconds; a save every step. Matrix: the writer {ours (threads), Megatron-Core's}. Each
save's blocking must stay well under ``SLOW``, and the wait before it, reported apart, must
hold the previous write's time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
SLOW = 3.0
SAVES = 3


def _async_fit(rank: int, world: int, tmp: str, writer: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from benchmarks import workloads
    from lightning_mcore_ckpt.engine import _shards

    def slow_schedule(self: Any, request: Any) -> int:
        # Each save's background write takes SLOW more seconds (in the background thread).
        write = request.async_fn

        def slow_write(*args: Any, **kwargs: Any) -> Any:
            # After the write: its staging (which the save's blocking waits for) is not delayed.
            done = write(*args, **kwargs)
            time.sleep(SLOW)
            return done

        return schedule(self, request._replace(async_fn=slow_write))

    queues = {"threads": _shards.BackgroundWrites, "megatron": AsyncCallsQueue}
    schedule = queues[writer].schedule_async_request
    queues[writer].schedule_async_request = slow_schedule  # type: ignore[method-assign]
    cfg = {"size": "quick", "saves": SAVES, "every": 1, "device": "cpu"}
    return workloads._our_fit(rank, world, cfg, "async", writer, Path(tmp) / "ckpt")


@pytest.mark.parametrize("writer", ["threads", "megatron"])
def test_an_async_saves_blocking_excludes_waiting_for_the_previous_write(
    tmp_path: Path, writer: str
) -> None:
    figures = run_distributed(_async_fit, 1, str(tmp_path), writer, timeout=800)[0]
    assert figures["writer"] == {"threads": "threads", "megatron": "mcore"}[writer]
    # Every save but the first: the previous write (SLOW at least) was in flight when the step
    # before it began. Its blocking is its own...
    assert figures["blocking_s"]["n"] == SAVES - 1
    assert figures["blocking_s"]["max"] < SLOW / 2, figures
    # ... and the wait for the previous write is reported apart.
    assert figures["wait_for_previous_s"]["n"] == SAVES - 1
    assert figures["wait_for_previous_s"]["min"] > SLOW / 2, figures["wait_for_previous_s"]
