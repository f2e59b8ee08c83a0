"""``StrategyConfig``: the options of ``MegatronStrategy``, checked once, at construction.

The options are written here only: the fields are ``MegatronStrategy``'s keyword arguments (its
signature and documented arguments come from them, see :mod:`lightning_mcore_ckpt._options`).
"""

from __future__ import annotations

import datetime
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_mcore_ckpt.engine import OptimizerSharding, WriterKind
from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.format.layout import MODEL_DIR

__all__ = ["DEFAULT_TIMEOUT", "ProcessGroupBackend", "StrategyConfig"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""``MegatronStrategy(timeout=...)``'s default: how long a rank waits for a peer that stopped
answering (a node lost without its sockets closing) before the job ends with an error.
Lightning's default, 30 minutes, is three times longer."""

ProcessGroupBackend = Literal["nccl", "gloo"]
"""The values of ``process_group_backend`` (``None``: chosen from the devices)."""


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"MegatronStrategy({name}={value!r}): must be a positive int")


def _check_choice(name: str, value: Any, choices: Any) -> None:
    allowed = typing.get_args(choices)
    if value not in allowed:
        raise ConfigurationError(
            f"MegatronStrategy({name}={value!r}): use one of {', '.join(map(repr, allowed))}"
        )


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """Every option of :class:`~lightning_mcore_ckpt.MegatronStrategy`, validated.

    ``MegatronStrategy(**options)`` builds one from its keyword arguments (same names and
    defaults) and keeps it as ``strategy.config``. A bad value raises
    :class:`~lightning_mcore_ckpt.ConfigurationError` (a ``ValueError`` and Lightning's
    ``MisconfigurationException``) naming the argument, the value and the fix.

    Example::

        config = StrategyConfig(tensor_model_parallel_size=2, ckpt_async_save=True)
        strategy = MegatronStrategy(**dataclasses.asdict(config))
    """

    tensor_model_parallel_size: int = 1
    """Ranks each layer's tensors are split across."""
    pipeline_model_parallel_size: int = 1
    """Ranks the layers are split across."""
    context_parallel_size: int = 1
    """Ranks the sequence is split across."""
    expert_model_parallel_size: int = 1
    """Ranks the MoE experts are split across."""
    expert_tensor_parallel_size: int | None = None
    """Ranks each MoE expert's tensors are split across; ``None``: as
    ``tensor_model_parallel_size`` (Megatron-Core's default). With tensor parallelism, experts
    split over ranks instead (``expert_model_parallel_size=2``) need ``1`` here on 2 ranks."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (must match the model's config)."""
    seed: int = 1234
    """Seeds Python, NumPy, torch and Megatron's RNG tracker (offset per pipeline stage and
    tensor-parallel rank as Megatron-LM does)."""
    ckpt_async_save: bool = False
    """Write checkpoints in the background after staging them."""
    ckpt_parallel_save: bool = True
    """Spread the writes of replicated tensors across data-parallel ranks."""
    ckpt_parallel_load: bool = False
    """Spread the reads across data-parallel ranks (CUDA only; ignored with an info message on
    CPU)."""
    ckpt_optimizer_sharding: OptimizerSharding = "dp_reshardable"
    """How a Megatron-Core distributed optimizer's state is saved (Megatron-LM's
    ``distrib_optim_sharding_type``). ``"dp_reshardable"``: each rank writes its own slice of
    the optimizer buffers, no communication; loads into any data-parallel size, but only the
    same tensor/pipeline/context/expert-parallel sizes. ``"fully_reshardable"``: the state is
    gathered on each data-parallel group's first rank and saved per parameter, like the
    weights: loads into any layout, at the cost of that gather (memory and time on those ranks)
    at every save. A step always loads with the type it was saved with; torch optimizers are
    not affected (their state always reshards)."""
    ckpt_writer: WriterKind = "threads"
    """Who writes the shard files. ``"threads"`` (the default, the fastest): a thread pool of
    each rank, started at the first save and reused, with staging buffers allocated once (pinned
    host memory for GPU tensors); async saves are written by one persistent thread of the
    training process. ``"megatron"``: Megatron-Core's own async machinery, a process forked per
    save, or NVIDIA's resiliency extension (persistent worker process) where a compatible one
    is installed and the ranks train on GPUs. Both write the same files (Megatron-Core's
    ``torch_dist`` format) and keep every async guarantee."""
    ckpt_write_threads: int | None = None
    """Shard files each rank writes in parallel (``"threads"`` writer). Default: the cores
    available to each rank on its machine, between 2 and 8."""
    ckpt_read_threads: int | None = None
    """Shard files each rank reads in parallel at a load. Default: as ``ckpt_write_threads``."""
    ckpt_verify_hashes: bool = False
    """At a load, also hash every file of the step it reads and compare with the digests its
    commit recorded (a changed byte anywhere is caught; ``"last"`` then takes the previous
    undamaged step). Costs a read of the step before the load (see ``docs/performance.md``).
    Off: sizes and structure are checked (always)."""
    ckpt_dedup: bool = False
    """Write the tensors of frozen parameters once: into the run directory's ``shared/``, and
    from the second save of a run on, only when their bytes changed (hashed at each save); a
    step's index points at them. Retention keeps a shared file while a step references it.
    Needs ``ckpt_writer="threads"``. A step then depends on ``shared/`` (copy both)."""
    ckpt_cache_plans: bool = True
    """Reuse Megatron-Core's save plans (and the assignment of replicated tensors to writers)
    while the state's structure does not change; every save checks it (a fingerprint of keys,
    shapes, dtypes and offsets, one all-reduce) and plans afresh on every rank when it did."""
    ckpt_max_staging_bytes: int | None = None
    """The most host memory, in bytes, a save copies the state into at once (``"threads"``
    writer). ``None`` (the default, the fastest): every tensor is copied at once, into buffers
    kept for the next saves (as much host memory as the rank's state). A number: the tensors go
    through one buffer of that size (or of the largest tensor, if larger), kept for the next
    saves; each shard file is written as its tensors are copied, and their bytes reused. The
    training thread is then blocked until every tensor is copied, i.e. until all but the last
    buffer's worth is written. Bounds async saves, and sync saves of GPU tensors; a sync save of
    CPU tensors copies nothing."""
    process_group_backend: ProcessGroupBackend | None = None
    """``"nccl"`` or ``"gloo"``; default: nccl when the ranks train on GPUs, gloo with
    ``accelerator="cpu"`` (also on a machine with GPUs). ``"nccl"`` with CPU devices is refused."""
    timeout: datetime.timedelta = field(default=DEFAULT_TIMEOUT)
    """How long any rank waits for a peer that does not answer before it fails (default 10
    minutes): the timeout of every process group (the default group, Megatron-Core's groups, the
    gloo groups of the checkpoint and of the fast tier, which waits at most this long even if
    its ``timeout_s`` is longer), and of global rank 0's wait for each node's upload
    confirmation (``s3://`` without a shared file system). A node that stops without closing its
    sockets (power loss, kernel panic, a network partition) then ends every other rank with an
    error within about this time, during training as during a save. Longer than the slowest
    save's wait for the slowest rank (and, with NCCL, the longest step between collectives):
    see ``docs/nodes.md``."""
    init_from: str | os.PathLike[str] | None = None
    """Initial weights for a ``fit`` that does not resume from a checkpoint: a Hugging Face
    model directory (converted on the fly through mbridge; every rank reads only its own shards)
    or a step directory (e.g. from ``lightning-mcore-ckpt import``; any layout). When ``fit``
    resumes (``ckpt_path="last"`` finds a step), resuming wins and this is ignored, with a log
    line."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            _check_size(name, getattr(self, name))
        if self.expert_tensor_parallel_size is not None:
            _check_size("expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        for name in (
            "sequence_parallel",
            "ckpt_async_save",
            "ckpt_parallel_save",
            "ckpt_parallel_load",
            "ckpt_cache_plans",
        ):
            flag = getattr(self, name)
            if not isinstance(flag, bool):
                raise ConfigurationError(
                    f"MegatronStrategy({name}={flag!r}): must be True or False"
                )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigurationError(
                "MegatronStrategy(sequence_parallel=True) needs tensor_model_parallel_size > 1; "
                "set sequence_parallel=False or raise tensor_model_parallel_size"
            )
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigurationError(f"MegatronStrategy(seed={seed!r}): must be a non-negative int")
        _check_choice("ckpt_optimizer_sharding", self.ckpt_optimizer_sharding, OptimizerSharding)
        _check_choice("ckpt_writer", self.ckpt_writer, WriterKind)
        if self.ckpt_dedup and self.ckpt_writer != "threads":
            raise ConfigurationError(
                f"MegatronStrategy(ckpt_dedup=True, ckpt_writer={self.ckpt_writer!r}): dedup is "
                "done by our shard writer; use ckpt_writer='threads' (the default) with it"
            )
        for name in ("ckpt_write_threads", "ckpt_read_threads"):
            if getattr(self, name) is not None:
                _check_size(name, getattr(self, name))
        self._check_max_staging_bytes()
        if self.process_group_backend not in (None, *typing.get_args(ProcessGroupBackend)):
            raise ConfigurationError(
                f"MegatronStrategy(process_group_backend={self.process_group_backend!r}): "
                "use 'nccl', 'gloo' or None (nccl with CUDA, gloo without)"
            )
        if not isinstance(self.timeout, datetime.timedelta) or self.timeout.total_seconds() <= 0:
            raise ConfigurationError(
                f"MegatronStrategy(timeout={self.timeout!r}): pass a positive "
                "datetime.timedelta, e.g. datetime.timedelta(minutes=10)"
            )
        if self.init_from is not None:
            self._check_init_from(self.init_from)

    def _check_max_staging_bytes(self) -> None:
        cap = self.ckpt_max_staging_bytes
        if cap is None:
            return
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ConfigurationError(
                f"MegatronStrategy(ckpt_max_staging_bytes={cap!r}): must be a positive int "
                "(bytes, e.g. 8 * 2**30 for 8 GiB) or None (unbounded, the fastest)"
            )
        if self.ckpt_writer != "threads":
            raise ConfigurationError(
                f"MegatronStrategy(ckpt_max_staging_bytes={cap}, "
                f"ckpt_writer={self.ckpt_writer!r}): Megatron-Core's writer copies the whole "
                "state to host memory at once and cannot be bounded; use ckpt_writer='threads' "
                "(the default) with it, or ckpt_max_staging_bytes=None"
            )

    @staticmethod
    def _check_init_from(init_from: str | os.PathLike[str]) -> None:
        source = Path(init_from).expanduser()
        if not ((source / "config.json").is_file() or (source / MODEL_DIR).is_dir()):
            found = (
                f"holds neither config.json nor {MODEL_DIR}/"
                if source.exists()
                else "does not exist"
            )
            raise ConfigurationError(
                f"MegatronStrategy(init_from={str(init_from)!r}): {str(source)!r} {found}. "
                "Pass a local directory holding a Hugging Face model's config.json, or a "
                f"checkpoint step (a global_step_<N> directory) with {MODEL_DIR}/; for a model "
                "on the Hugging Face Hub, download it first with "
                "huggingface_hub.snapshot_download(repo_id, local_dir=...) and pass that directory"
            )
        if (source / "config.json").is_file():
            from lightning_mcore_ckpt.hf import HFBridge

            HFBridge(source, argument="MegatronStrategy(init_from=...)")

    @property
    def init_path(self) -> Path | None:
        """``init_from`` as a path, ``~`` expanded."""
        return None if self.init_from is None else Path(self.init_from).expanduser()
