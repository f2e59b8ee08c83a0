"""Opening a checkpoint never runs code from it: every pickle in a step is checked first.

A step directory holds four kinds of pickles, and unpickling can call any function it names:

- ``extra/rank_<r>.pt`` (ours, ``torch.save``): loaded here with ``torch.load(weights_only=True)``;
- ``model/common.pt``, ``optim/common.pt`` (``torch.save``, megatron-core 0.16 writes them);
- the non-tensor objects inside the torch_dist shard files (``torch.save`` bytes: the common state,
  optimizer parameter groups, ``_extra_state``), which ``torch.distributed.checkpoint`` unpickles
  with ``weights_only=False`` while Megatron-Core loads;
- each torch_dist directory's ``.metadata`` index, which it reads with a plain ``pickle.load``.

The ``torch.save`` kinds are allowed when every global they import is on torch's ``weights_only``
allowlist: torch's own, plus what ``torch.serialization.add_safe_globals`` added in this
process (Megatron-Core adds a few of its own types when it is imported). The index is read by an
unpickler that resolves only what such an index is made of (``_safe_dcp``). Anything else is
refused with :class:`UnsafeCheckpointError` before any byte of it is unpickled, unless the user
trusts the checkpoint as a whole (:func:`trusted_by_user`).

The files we cannot load ourselves are scanned without unpickling them
(``torch.serialization.get_unsafe_globals_in_checkpoint`` lists a ``torch.save`` pickle's
globals; it refuses pickle instructions it does not know, so nothing can hide from it), and
their loader then finds only allowed globals. A file swapped between the check and the load is
out of reach of any check: do not load from a directory that others write to while you load.

Imports nothing from the package (``_safe_dcp`` and ``layout`` build on it).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.storage import remote_files

__all__ = [
    "SECURITY_DOC",
    "TRUST_ALL",
    "TRUST_ENV",
    "UnsafeCheckpointError",
    "allowing",
    "extra_globals",
    "load_torch_file",
    "refuse",
    "refused_in_extra",
    "save_warning",
    "scan",
    "trusted_by_user",
    "unsafe_parts",
]

SECURITY_DOC = 'the "Loading checkpoints you did not write" section of docs/strategy.md'
TRUST_ENV = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
"""torch's switch for loading pickles unchecked where the caller did not ask for a safe load."""
TRUST_ALL = (
    "To load a checkpoint you trust as a whole, as it is, set "
    f"{TRUST_ENV}=1 in the environment of the run that loads it"
)


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint file would import something unpickling must not run; nothing was loaded.

    The message names the file, the globals and the fix: ``torch.serialization.add_safe_globals``
    for types of your own in a checkpoint you trust, or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
    in the environment for a checkpoint you trust as a whole.

    Example::

        try:
            trainer.fit(module, ckpt_path="downloaded/global_step_1000")
        except UnsafeCheckpointError as err:
            print(err)  # e.g. "... extra/rank_00000.pt would import my_project.Config ..."
    """


def _fix(globals_: Sequence[str]) -> str:
    allow = (
        "If you trust this checkpoint and these are classes of your own (e.g. a hyperparameter "
        "dataclass), allow them before loading: torch.serialization.add_safe_globals("
        f"[{', '.join(sorted(globals_))}]); a function that runs commands or code (os.system, "
        "eval, ...) among them means the file was made to run it: do not load it. "
        if globals_
        else ""
    )
    return f"{allow}{TRUST_ALL}. See {SECURITY_DOC}"


def refuse(where: str, globals_: Sequence[str], why: str = "") -> UnsafeCheckpointError:
    """The refusal of ``where``: because of ``globals_``, or ``why``; names the fix."""
    listed = ", ".join(sorted(globals_))
    reason = why or (
        f"it would import {listed}, which the weights_only allowlist does not hold, so "
        "unpickling it could run code"
    )
    return UnsafeCheckpointError(
        f"refusing to load {where}: {reason}. Nothing of it was unpickled. {_fix(globals_)}"
    )


# --- allowlists ---------------------------------------------------------------------------


def extra_globals() -> list[Any]:
    """What ``extra/`` files may hold beyond torch's defaults: NumPy arrays and dtypes.

    Steps of extra-state format 1 hold NumPy's RNG state as an array; format 2 stores it as a
    tensor, but users' state (a callback's, a dataloader's) may hold arrays too. An array's
    reconstruction resolves its items through the same restricted unpickler, so these run no
    code of the file's. Both spellings of ``_reconstruct`` are accepted (NumPy 1 wrote
    ``numpy.core``, NumPy 2 writes ``numpy._core``).
    """
    import numpy as np

    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
    allowed: list[Any] = [np.ndarray, np.dtype, reconstruct]
    allowed += [
        (reconstruct, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core")
    ]
    allowed += [type(np.dtype(t)) for t in ("u4", "i8", "f8", "f4", "i4", "b1", "u1")]
    return allowed


@contextmanager
def allowing(extra: Iterable[Any]) -> Iterator[None]:
    """Add ``extra`` to torch's ``weights_only`` allowlist for the duration of the block.

    Only entries not already allowed are added, and only those are removed afterwards (torch's
    own ``safe_globals`` context would also remove a user's earlier ``add_safe_globals`` of the
    same type). The allowlist is process-wide: another thread's ``weights_only`` load during the
    block sees these entries too, which only widens it by types that run no code.
    """
    from torch.serialization import get_safe_globals, safe_globals

    present = set(get_safe_globals())
    added = [g for g in extra if g not in present]
    with safe_globals(added):
        yield


# --- torch.save files -----------------------------------------------------------------------


def scan(f: Any, where: str) -> list[str]:
    """The globals of a ``torch.save`` pickle that are not allowed, without unpickling it.

    ``f``: a path or a seekable binary file. Raises :class:`UnsafeCheckpointError` for a pickle
    that cannot be checked (not a ``torch.save`` zip file, or pickle instructions the scan does
    not read); a truncated or damaged file raises what torch's zip reader raises.
    """
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        return sorted(get_unsafe_globals_in_checkpoint(f))
    except (ValueError, pickle.UnpicklingError) as err:
        raise refuse(
            where,
            [],
            f"it cannot be checked without unpickling it ({type(err).__name__}: {err}), as a "
            "file written by torch.save can",
        ) from err


def trusted_by_user(weights_only: bool | None = None) -> bool:
    """Whether the user asked to load checkpoints unchecked, trusting them as a whole.

    ``weights_only=False`` given to Lightning's ``fit``/``validate``/``test``/``predict``, when
    Lightning passes it on (Lightning 2.6 does not pass it to a strategy that restores after
    setup, as ``MegatronStrategy`` does); else, where the caller did not ask for a safe load
    (``None``), torch's own ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, read as ``torch.load`` reads it.
    """
    if weights_only is not None:
        return not weights_only
    return os.environ.get(TRUST_ENV, "0").lower() in ("1", "y", "yes", "true")


def load_torch_file(
    path: Path, *, trusted: bool = False, data: Any = None, share: bool = False
) -> Any:
    """Load a ``torch.save`` file of ours (``extra/rank_<r>.pt``) on CPU.

    Checked first (see the module docstring), then loaded with ``weights_only=True`` and the
    :func:`extra_globals`. With ``trusted`` (:func:`trusted_by_user`), loaded as torch would
    load any pickle. ``data``: the file's bytes, already read (and checked against a digest):
    loaded from memory, the file not read again; ``path`` names it in errors.

    ``share`` (with a writable ``data``): the tensors loaded are views of ``data``'s memory, as
    ``torch.load(mmap=True)`` makes them of a file's, not copies of it: for a caller that copies
    each tensor where it goes and keeps none of them (they keep ``data`` alive, and change with
    it). The same check, the same unpickler; only the storages are not copied.
    """
    import torch

    def source() -> Any:
        return str(path) if data is None else remote_files.MemoryFile(data, str(path))

    def load(weights_only: bool) -> Any:
        if data is not None and share:
            loaded = _load_shared(data, str(path), weights_only)
            if loaded is not _UNSHARED:
                return loaded
        return torch.load(source(), map_location="cpu", weights_only=weights_only)

    if trusted:
        return load(weights_only=False)
    with allowing(extra_globals()):
        unsafe = scan(source(), str(path))
        if unsafe:
            raise refuse(str(path), unsafe)
        try:
            return load(weights_only=True)
        except pickle.UnpicklingError as err:
            # The scan reads globals as written; the restricted unpickler also refuses what
            # would be done with allowed ones.
            raise refuse(
                str(path), [], f"torch's weights_only unpickler refused it: {err}"
            ) from err


_UNSHARED = object()
""":func:`_load_shared` could not share the bytes: ``torch.load`` copies them instead."""


def _load_shared(data: Any, name: str, weights_only: bool) -> Any:
    """A ``torch.save`` file's bytes in memory, unpickled as ``torch.load`` does (``weights_only``:
    its restricted unpickler), each storage a view of ``data`` (none copied): torch's own load
    with ``mmap=True``, given ``data`` as the memory a file is mapped to. :data:`_UNSHARED` where
    that is not possible (read-only bytes, not a zip file, a torch without that load): the
    caller loads it the ordinary way."""
    import torch
    import torch.serialization

    ser: Any = torch.serialization  # its private parts: checked for below, not typed
    internals = (
        "_load",
        "_open_zipfile_reader",
        "_is_zipfile",
        "_is_torchscript_zip",
        "_weights_only_unpickler",
    )
    if not all(hasattr(ser, n) for n in internals):
        return _UNSHARED
    view = memoryview(data).cast("B")
    if view.readonly or not view.nbytes or not ser._is_zipfile(remote_files.MemoryFile(view)):
        return _UNSHARED
    memory = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
    with ser._open_zipfile_reader(remote_files.MemoryFile(view, name)) as archive:
        if ser._is_torchscript_zip(archive):
            return _UNSHARED  # torch.load says what it says of one
        unpickler = ser._weights_only_unpickler if weights_only else pickle
        try:
            return ser._load(archive, "cpu", unpickler, overall_storage=memory, encoding="utf-8")
        except pickle.UnpicklingError as err:
            if not weights_only:
                raise
            explain = getattr(ser, "_get_wo_message", str)  # torch.load's own wording
            raise pickle.UnpicklingError(explain(str(err))) from None


def _without_tensor_data(value: Any) -> Any:
    """``value`` with its plain tensors emptied (same globals, none of their bytes)."""
    import torch

    if type(value) is torch.Tensor:
        return torch.empty(0, dtype=value.dtype)
    if type(value) is dict:
        return {k: _without_tensor_data(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_without_tensor_data(v) for v in value)
    return value


def unsafe_parts(
    obj: Any, name: str, extra: Iterable[Any] = (), *, named: bool = False
) -> dict[str, list[str]]:
    """Where in ``obj`` the globals that a safe load refuses sit: ``{"name['key']": [globals]}``.

    For the warnings at save time. Descends plain dicts, lists and tuples, down to the deepest
    values that hold a refused global (a container of another type is reported as a whole).
    With ``named``, ``obj`` is a ``{where: value}`` dict whose keys are the places to report.
    """
    import torch

    with allowing(extra):

        def unsafe(value: Any) -> list[str]:
            buffer = io.BytesIO()
            torch.save(_without_tensor_data(value), buffer)
            buffer.seek(0)
            return scan(buffer, name)

        def walk(value: Any, path: str, root: bool = False) -> dict[str, list[str]]:
            found = unsafe(value)
            if not found:
                return {}
            if type(value) in (dict, list, tuple):
                items = value.items() if isinstance(value, dict) else enumerate(value)
                deeper: dict[str, list[str]] = {}
                for key, child in items:
                    deeper.update(walk(child, str(key) if root else f"{path}[{key!r}]"))
                if deeper:
                    return deeper
            return {path: found}

        return walk(obj, name, root=named)


def refused_in_extra(path: Path, payload: Any, data: bytes | None = None) -> dict[str, list[str]]:
    """What of ``payload``, written to ``path`` (an ``extra/`` file; ``data``: its bytes, when
    they are not in the file yet), a load will refuse."""
    extra = extra_globals()
    with allowing(extra):
        if not scan(str(path) if data is None else io.BytesIO(data), str(path)):
            return {}
    return unsafe_parts(payload, "extra", extra)


def save_warning(where: str, parts: dict[str, list[str]]) -> str:
    """The warning for a save whose load will refuse ``parts`` (see :func:`unsafe_parts`)."""
    listed = "; ".join(f"{k} ({', '.join(v)})" for k, v in sorted(parts.items())[:10])
    names = ", ".join(sorted({g for found in parts.values() for g in found}))
    return (
        f"{where} holds objects that loading it will refuse, because unpickling their types "
        f"could run code: {listed}. To resume from it, allow them in the resuming process "
        f"before trainer.fit (only types you trust): torch.serialization.add_safe_globals("
        f"[{names}]); or keep plain data (dicts, lists, numbers, strings, tensors) in "
        f"hyperparameters and in module, callback and dataloader state. See {SECURITY_DOC}"
    )
