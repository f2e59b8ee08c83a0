"""The one async request a save hands to Megatron-Core's writer, and the save in flight."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt import _compat
from lightning_mcore_ckpt.engine._agreeing_save_strategy import defer_metadata_errors
from lightning_mcore_ckpt.engine._records import SaveOptions
from lightning_mcore_ckpt.engine._shards import BackgroundWrites
from lightning_mcore_ckpt.format import layout, markers, retention
from lightning_mcore_ckpt.format.layout import EXTRA_DIR, MODEL_DIR, OPTIM_DIR

__all__ = [
    "PendingSave",
    "clear_unsealed_part",
    "combine_async_requests",
    "create_step_directories",
    "plan_requests",
    "run_in_order",
    "stop_writers",
]

log = logging.getLogger(__name__)


@dataclass
class PendingSave:
    """The async save in flight: written in the background, not yet finalised."""

    path: Path
    call_ids: list[int]
    timings: dict[str, float]
    base: dict[str, Any]
    options: SaveOptions
    write_timer: torch.Tensor
    """Shared memory the background writer stores its write duration in."""
    device: torch.device
    """Where the finalising collectives place their tensors."""
    kept: list[BaseException]
    """Rank 0's finalisation errors, kept to be shared (see ``_agreeing_save_strategy``)."""


def clear_unsealed_part(path: Path) -> None:
    """A node's leader, where the directory is node-local: remove this node's part of ``path``
    that a killed or failed save left (this package's, never sealed here), before it is
    written again. Another node's part is its own leader's."""
    if path.is_dir() and markers.is_managed(path) and not layout.is_complete(path):
        log.warning("removing this node's unsealed part of %s before saving it again", path)
        retention.remove_step(path)


def create_step_directories(path: Path, contents: Sequence[str], managed: bool) -> str | None:
    """Rank 0: the new step directory and its sub-directories; what went wrong, if any."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        return (
            f"checkpoint directory {path} exists and is not empty; "
            "save each step to a new directory"
        )
    try:
        markers.mark_step_started(path, managed=managed)
        for sub, wanted in ((MODEL_DIR, "model"), (OPTIM_DIR, "optimizer"), (EXTRA_DIR, "extra")):
            if wanted in contents:
                (path / sub).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create checkpoint directory {path}: {err}"
    return None


def plan_requests(
    parts: Sequence[tuple[dict[str, Any], Path, dict[str, Any] | None]],
    strategies: dict[str, Any],
    kept: list[BaseException],
    writer: str,
    validate: bool = True,
) -> list[tuple[str, Any]]:
    """Megatron-Core's planned save request of each ``(sharded state dict, directory, content
    metadata)``, named by its directory; rank 0's finalisation errors go to ``kept``.
    ``validate``: Megatron-Core's check that the ranks' shards cover every tensor once."""
    from megatron.core import dist_checkpointing

    requests = []
    for sharded_state_dict, directory, content_metadata in parts:
        strategy = strategies[directory.name]
        getattr(strategy, "base_strategy", strategy).deferred_errors = kept
        request = dist_checkpointing.save(
            sharded_state_dict,
            str(directory),
            sharded_strategy=strategy,
            async_sharded_save=True,
            content_metadata=content_metadata,
            validate_access_integrity=validate,
            **_compat.save_kwargs(writer),
        )
        if request is not None:
            defer_metadata_errors(request, kept, strategy, str(directory))
            requests.append((directory.name, request))
    return requests


def run_in_order(
    calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]],
    write_timer: torch.Tensor,
    writer: str,
) -> None:
    """Run the staged writes one after the other; store their duration in ``write_timer``."""
    # Runs in the background writer process for an async save: write_timer is shared memory.
    start = time.perf_counter()
    for fn, args, kwargs in calls:
        if writer == _compat.BUILTIN:
            with _compat.write_errors_keep_their_cause(args) as args:
                fn(*args, **kwargs)
        else:
            fn(*args, **kwargs)
    write_timer[0] = time.perf_counter() - start


def combine_async_requests(requests: Sequence[Any], write_timer: torch.Tensor) -> Any:
    """One async request that stages, writes and finalises ``requests`` in order.

    Megatron-Core's async writer returns its write results through one process-wide queue, so
    two saves in flight at once (model/ and optim/) can pick up each other's results. Written by
    one background process, one after the other, their results arrive in the order their
    finalisers read them. Staging (``preload_fn``) happens here, on the training thread: it is
    the snapshot the background writes from.
    """
    _, async_request = _compat.async_classes()
    calls = []
    finalize_fns: list[Callable[[], None]] = []
    for req in requests:
        args = list(req.async_fn_args)
        if req.preload_fn is not None:
            args[1] = req.preload_fn()
        if req.async_fn is not None:
            calls.append((req.async_fn, tuple(args), dict(req.async_fn_kwargs)))
        finalize_fns.extend(req.finalize_fns)
    return async_request(run_in_order, (calls, write_timer, _compat.async_strategy()), finalize_fns)


def stop_writers(queue: Any) -> None:
    """Kill this rank's background writer processes of ``queue`` and close it, finalising
    nothing (their saves stay uncommitted). Local; logs what goes wrong, raises nothing."""
    if isinstance(queue, BackgroundWrites):
        queue.close(abort=True)  # its thread stops at the next record
        return
    try:
        for call in list(getattr(queue, "async_calls", ())):
            # The writer process and the worker processes it started (megatron-core 0.16 writes
            # with processes, 0.19 with threads): none may write after this returns.
            process = getattr(call.async_caller, "process", None)
            if process is not None and process.pid is not None:
                _kill_tree(process.pid)
            call.async_caller.close(abort=True)  # kills (already dead) and forgets the writer
        getattr(queue, "async_calls", []).clear()
        queue.close(abort=True)
    except Exception as err:  # noqa: BLE001 - logged: the run's own error propagates
        log.error("stopping the async checkpoint writer: %s", err)


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=10)
