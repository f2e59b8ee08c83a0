"""The on-disk layout of a checkpoint directory: step names, the commit marker, the tracker.

::

    <dirpath>/
      latest_checkpointed_iteration.txt   # newest committed step, written last, atomically
      .lightning_mcore_ckpt.lock          # one writer per directory (host, pid)
      global_step_<N>/
        .lightning_mcore_ckpt             # written first: this package started this step
        model/ optim/ extra/ huggingface/
        metadata.json                     # written last, by rename: makes the step complete

A step directory without a readable ``metadata.json`` is *incomplete*: it does not exist for
``"last"``, listing or retention (other than being cleaned up once a newer step commits, when it
carries this package's start marker). Everything here is pure file-system logic, safe to call
from any one rank.
"""

from __future__ import annotations

import logging
import os
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.format.markers import METADATA_FILE, read_metadata
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp
from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.safety.names import UnsafeNameError, in_step
from lightning_mcore_ckpt.storage import atomic as _atomic
from lightning_mcore_ckpt.storage import remote_files

__all__ = [
    "EXTRA_DIR",
    "EXTRA_FORMAT_VERSION",
    "HF_DIR",
    "METADATA_FORMAT_VERSION",
    "MODEL_DIR",
    "OPTIM_DIR",
    "SHARED_DIR",
    "TRACKER_FILE",
    "StepDir",
    "check_format",
    "complete_steps",
    "incomplete_steps",
    "is_complete",
    "is_exported",
    "read_tracker",
    "resolve_checkpoint",
    "resolve_last",
    "step_dir",
    "step_name",
    "step_number",
    "verify_step",
    "write_tracker",
]

log = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FORMAT_VERSION = 2
MODEL_DIR = "model"
"""Sub-directory of a step with the model's dist-checkpoint."""
OPTIM_DIR = "optim"
"""Sub-directory of a step with the optimizers' dist-checkpoint."""
EXTRA_DIR = "extra"
"""Sub-directory of a step with one ``rank_<r>.pt`` per rank (RNG, Lightning's state)."""
SHARED_DIR = "shared"
"""Directory of a run (next to its steps) holding the files of tensors written once and
referenced by several steps (``MegatronStrategy(ckpt_dedup=True)``)."""
HF_DIR = "huggingface"
"""Sub-directory of a step with its Hugging Face export."""
EXTRA_FORMAT_VERSION = 2
"""Version of the ``extra/rank_<r>.pt`` payload (2: the RNG state holds no NumPy array, so our
own state loads with ``torch.load(weights_only=True)`` and no type allowed beyond torch's)."""
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_SUBDIRS = {MODEL_DIR: "model", OPTIM_DIR: "optimizer", EXTRA_DIR: "extra", HF_DIR: "hf_model"}


@dataclass(frozen=True, order=True)
class StepDir:
    """A ``global_step_<N>`` directory: its step number and path."""

    step: int
    path: Path


def step_name(step: int) -> str:
    """The name of ``step``'s directory: ``global_step_<N>``."""
    return f"global_step_{step}"


def step_dir(dirpath: str | os.PathLike[str], step: int) -> Path:
    """The directory of ``step`` under ``dirpath``."""
    return Path(dirpath) / step_name(step)


def step_number(path: str | os.PathLike[str]) -> int | None:
    """The step of a ``global_step_<N>`` directory, or ``None`` for any other name.

    Example::

        step_number("checkpoints/run/global_step_100")  # 100
    """
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def check_format(path: str | os.PathLike[str]) -> None:
    """Refuse a step written in a newer format than this version of the package reads.

    Raises ``ValueError`` naming the step, both format versions and the fix.

    Example::

        check_format("checkpoints/run/global_step_100")  # raises if written by a newer version
    """
    meta = read_metadata(path)
    version = (meta or {}).get("format_version", METADATA_FORMAT_VERSION)
    if isinstance(version, int) and version > METADATA_FORMAT_VERSION:
        raise ValueError(
            f"{path} is in checkpoint format {version}; this lightning-mcore-ckpt reads format "
            f"{METADATA_FORMAT_VERSION} and older. Upgrade lightning-mcore-ckpt to load it"
        )


def is_exported(step: str | os.PathLike[str]) -> bool:
    """Whether a step directory holds a finished Hugging Face export (``huggingface/``, renamed
    into place once written: its ``config.json``, or a PEFT adapter's ``adapter_config.json``)."""
    hf_dir = Path(step) / HF_DIR
    return (hf_dir / "config.json").is_file() or (hf_dir / "adapter_config.json").is_file()


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether a step directory was committed (its ``metadata.json`` is in place and valid).

    Example::

        is_complete("checkpoints/run/global_step_100")
    """
    return read_metadata(path) is not None


def _step_dirs(dirpath: Path) -> list[StepDir]:
    # Links are never followed: a linked step is not this run's (and deleting through the link
    # would delete outside the run directory).
    if not dirpath.is_dir():
        return []
    out = []
    for entry in dirpath.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink():
            out.append(StepDir(int(match.group(1)), entry))
    return sorted(out)


def complete_steps(dirpath: str | os.PathLike[str]) -> list[StepDir]:
    """The complete ``global_step_<N>`` directories under ``dirpath``, oldest first.

    Example::

        [s.step for s in complete_steps("checkpoints/run")]  # e.g. [400, 500]
    """
    return [s for s in _step_dirs(Path(dirpath)) if is_complete(s.path)]


def incomplete_steps(dirpath: str | os.PathLike[str]) -> list[StepDir]:
    """The ``global_step_<N>`` directories without a commit marker, oldest first.

    Example::

        [s.path.name for s in incomplete_steps("checkpoints/run")]  # e.g. ["global_step_600"]
    """
    return [s for s in _step_dirs(Path(dirpath)) if not is_complete(s.path)]


def read_tracker(dirpath: str | os.PathLike[str]) -> int | None:
    """The step in ``latest_checkpointed_iteration.txt``, or ``None`` if missing or garbled."""
    try:
        text = (Path(dirpath) / TRACKER_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def write_tracker(dirpath: str | os.PathLike[str], step: int) -> None:
    """Point the tracker at ``step`` (atomically)."""
    _atomic.write_text(Path(dirpath) / TRACKER_FILE, f"{step}\n")


def _verify_dist_checkpoint(directory: Path) -> list[str]:
    index = directory / ".metadata"
    if not index.is_file():
        return [f"{index} is missing"]
    try:  # without torch: ls and report answer in a fraction of a second
        needed = _safe_dcp.index_extents(directory)
    except _safe_load.UnsafeCheckpointError:
        # Not damage: whether it may be opened is decided when it is loaded, on every rank
        # (refused there, unless the user trusts it), so "last" never skips it silently.
        return []
    except Exception as err:  # noqa: BLE001 - any unreadable index is a damaged checkpoint
        return [f"{index} is unreadable ({type(err).__name__}: {err})"]
    problems = []
    if not (directory / "metadata.json").is_file():  # Megatron-Core's: how to read the rest
        problems.append(f"{directory / 'metadata.json'} is missing")
    for name, size in sorted(needed.items()):
        # A name from the index: a path only inside the step, or a file of the run's shared/
        # store that a deduplicated step references (``../../shared/<name>`` from here).
        shared = f"../../{SHARED_DIR}/"
        within = name[3:] if name.startswith(shared) else f"{directory.name}/{name}"
        try:
            shard = in_step(directory.parent, within, f"{index}'s shard list", SHARED_DIR)
        except UnsafeNameError:
            problems.append(
                f"{index}'s shard list names the file {name!r}, which leads outside the step "
                f"and its run's {SHARED_DIR}/ store: refused (someone may have altered it)"
            )
            continue
        if (found := remote_files.size_of(shard)) is None:  # local, or a view's file in a store
            problems.append(f"{shard} is missing")
        elif found < size:
            problems.append(f"{shard} is truncated ({found} of {size} bytes)")
    return problems


def verify_step(
    path: str | os.PathLike[str], reading: Iterable[str] | None = None, deep: bool = False
) -> list[str]:
    """What is wrong with a step directory: missing or truncated files ([] when it is whole).

    With ``deep``, also every file whose bytes changed since the commit: each file the step
    hashed at its commit is read whole and hashed again (see :mod:`lightning_mcore_ckpt.format.integrity`).

    Checks, without loading tensors: the commit marker; every file its ``files`` list names
    (each file of the step and its size at the commit: the shards, each dist-checkpoint's
    ``.metadata``, ``metadata.json`` and ``common.pt``, ``extra/``, the Hugging Face export);
    each dist-checkpoint's index and that every shard file it names exists with all the bytes it
    references; one readable ``extra/rank_<r>.pt`` per rank of the saving run. Steps committed
    before the file list was recorded get every check but the list's.

    Example::

        problems = verify_step("checkpoints/run/global_step_100")
        # e.g. [".../model/__0_0.distcp is truncated (10 of 4096 bytes)"]
    """
    p = Path(path)
    meta = read_metadata(p)
    if meta is None:
        return [f"{p / METADATA_FILE} is missing or not valid JSON"]
    contents = meta.get("contents", ["model"])
    if reading is not None:  # a load that reads only these (e.g. evaluation: no optimizer)
        contents = [c for c in contents if c in set(reading)]
    skipped = {sub for sub, c in _SUBDIRS.items() if c not in contents}
    problems = []
    sealed = meta.get(integrity.METADATA_HASH)
    if isinstance(sealed, str) and integrity.json_digest(meta) != sealed:
        problems.append(f"{p / METADATA_FILE} is damaged: its content changed since the commit")
    files = meta.get("files")
    for name, size in sorted(files.items()) if isinstance(files, dict) else ():
        if name.split("/", 1)[0] in skipped:
            continue
        try:
            file = in_step(p, name, f"{p / METADATA_FILE}'s file list", SHARED_DIR)
        except UnsafeNameError as err:
            problems.append(str(err))
            continue
        if (actual := remote_files.size_of(file)) is None:
            problems.append(f"{file} is missing")
        elif actual < size:
            problems.append(f"{file} is truncated ({actual} of {size} bytes)")
        elif actual > size:
            problems.append(f"{file} has {actual} bytes, {size} when committed")
    for sub, wanted in ((MODEL_DIR, "model"), (OPTIM_DIR, "optimizer")):
        if wanted in contents:
            problems += [q for q in _verify_dist_checkpoint(p / sub) if q not in problems]
    hashes = meta.get("hashes")
    if deep and isinstance(hashes, dict) and hashes:
        found = integrity.check_hashes(p, hashes, skipped)
        problems += [q for q in found if q not in problems]
    elif deep:
        log.info("%s has no file hashes (committed before they were recorded): sizes checked", p)
    if "extra" in contents:
        ranks = sorted((p / EXTRA_DIR).glob("rank_*.pt"))
        world = (meta.get("parallel_layout") or {}).get("world_size")
        if isinstance(world, int) and len(ranks) != world:
            problems.append(f"{p / EXTRA_DIR} has {len(ranks)} rank files, the save had {world}")
        for rank_file in ranks:
            if not zipfile.is_zipfile(rank_file):
                problems.append(f"{rank_file} is truncated or damaged")
    return problems


def resolve_last(
    dirpath: str | os.PathLike[str],
    verify: bool = True,
    reading: Iterable[str] | None = None,
    deep: bool = False,
) -> Path | None:
    """The newest complete, undamaged step under ``dirpath``, or ``None`` when there is none.

    The tracker is trusted when it names a complete step that is the newest complete one; when
    it is missing, garbled, points at an incomplete or missing step, or lags behind a newer
    complete step, the directory scan decides (with a warning saying why). With ``verify``, a
    damaged step (see :func:`verify_step`) is skipped with a warning naming the file, and the
    previous complete step is taken.

    Example::

        step = resolve_last("checkpoints/run")  # .../global_step_<N>, or None
    """
    root = Path(dirpath)
    complete = complete_steps(root)
    newest = complete[-1] if complete else None
    tracked = read_tracker(root)
    if (root / TRACKER_FILE).exists() and not (
        tracked is not None and newest is not None and tracked == newest.step
    ):
        if tracked is None:
            why = f"{root / TRACKER_FILE} is unreadable"
        elif not is_complete(step_dir(root, tracked)):
            why = f"the tracker names {step_name(tracked)}, which is incomplete or missing"
        else:
            why = f"the tracker names {step_name(tracked)}, but a newer complete step exists"
        found = newest.path.name if newest is not None else "none"
        log.warning("%s; newest complete step by scan: %s", why, found)
    for candidate in reversed(complete):
        problems = verify_step(candidate.path, reading, deep) if verify else []
        if not problems:
            return candidate.path
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        log.warning(
            "skipping damaged %s: %s%s; trying the previous complete step",
            candidate.path,
            problems[0],
            more,
        )
    return None


def _describe_complete(root: Path) -> str:
    names = [s.path.name for s in complete_steps(root)]
    return ", ".join(names) if names else "none"


def resolve_checkpoint(
    path: str | os.PathLike[str], reading: Iterable[str] | None = None, deep: bool = False
) -> Path:
    """Resolve what a user passed as ``ckpt_path``: a step directory or a checkpoint ``dirpath``.

    A ``dirpath`` (no ``model/`` inside) resolves to its newest complete step. A step directory
    inside a managed ``dirpath`` (one with a tracker file or complete steps) must be complete.
    Raises ``FileNotFoundError`` naming the path and the complete steps that exist.

    Example::

        resolve_checkpoint("checkpoints/run")  # its newest complete step
        resolve_checkpoint("checkpoints/run/global_step_100")  # that step, if complete
    """
    p = Path(path)
    if not p.is_dir():
        parent = p.parent
        steps = _describe_complete(parent) if parent.is_dir() else f"{parent} does not exist"
        raise FileNotFoundError(
            f"checkpoint path {p} does not exist or is not a directory; complete steps in "
            f"{parent}: {steps}. Pass one of them, a checkpoint dirpath, or ckpt_path='last'"
        )
    if (p / MODEL_DIR).is_dir() or (p / METADATA_FILE).exists():
        parent = p.parent
        managed = (parent / TRACKER_FILE).exists() or bool(complete_steps(parent))
        if managed and _STEP_RE.match(p.name) and not is_complete(p):
            raise FileNotFoundError(
                f"checkpoint {p} is incomplete ({METADATA_FILE} missing or unreadable: its save "
                f"never finished); complete steps in {parent}: {_describe_complete(parent)}. "
                "Pass one of them, or ckpt_path='last'"
            )
        whole = is_complete(p)
        problems = (
            verify_step(p, reading, deep) if whole else _verify_dist_checkpoint(p / MODEL_DIR)
        )
        if problems:
            listed = "\n  ".join(problems[:10])
            intact = [
                s.path.name
                for s in complete_steps(parent)
                if not verify_step(s.path, reading, deep)
            ]
            raise FileNotFoundError(
                f"checkpoint {p} is damaged:\n  {listed}\ncomplete undamaged steps in {parent}: "
                f"{', '.join(intact) or 'none'}. Pass one of them, or ckpt_path='last' (which "
                "skips damaged steps)"
            )
        return p
    newest = resolve_last(p, reading=reading, deep=deep)
    complete = complete_steps(p)
    if newest is None and complete:
        damage = "\n  ".join(
            f"{s.path.name}: {verify_step(s.path, reading, deep)[0]}" for s in complete[-10:]
        )
        raise FileNotFoundError(
            f"every complete step under {p} is damaged:\n  {damage}\nrestore the files from a "
            "copy, or start a new run in a new dirpath"
        )
    if newest is None:
        incomplete = [s.path.name for s in incomplete_steps(p)]
        extra = f" (incomplete, ignored: {', '.join(incomplete)})" if incomplete else ""
        raise FileNotFoundError(
            f"no complete checkpoint under {p}{extra}; pass a step directory, "
            "or ckpt_path='last' to start from scratch when there is none"
        )
    return newest
